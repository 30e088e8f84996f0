"""The explicit rank grid t × p × d that every backend builds its groups from.

Order (fastest-varying first): tensor, data, pipeline — Megatron-Core's default "tp-dp-pp" without
context/expert parallelism, and the layout DeepSpeed AutoTP assumes (consecutive ranks form a TP
group). Keeping TP fastest puts each TP group inside a node; pipeline outermost puts stage
boundaries across nodes, as Narayanan et al. recommend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """The whole numbers that divide n, ascending: the degrees a dimension of n ranks (or layers) can split into.
    `at_most`: only those up to it. Tried up to √n (or `at_most`), not up to n: a world of 10^12 ranks has 169."""
    if at_most is not None and at_most < math.isqrt(n):
        return [d for d in range(1, at_most + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    out = small + [n // d for d in reversed(small) if d * d != n]
    return out if at_most is None else [d for d in out if d <= at_most]


@dataclass(frozen=True)
class RankGrid:
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    nodes: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def tp_group(self, rank: int) -> tuple[int, ...]:
        _, d, p = self.coords(rank)
        return tuple(self.rank(t, d, p) for t in range(self.tp))

    def dp_group(self, rank: int) -> tuple[int, ...]:
        t, _, p = self.coords(rank)
        return tuple(self.rank(t, d, p) for d in range(self.dp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        t, d, _ = self.coords(rank)
        return tuple(self.rank(t, d, p) for p in range(self.pp))

    # The same groups as ranges (tuple(g.tp_span(r)) == g.tp_group(r)), for the planner: a group of a million ranks
    # is three numbers, and where its members sit (spans_nodes, ranks_per_node_in) is arithmetic, not a walk.
    def tp_span(self, rank: int) -> range:
        start = rank - rank % self.tp
        return range(start, start + self.tp)

    def dp_span(self, rank: int) -> range:
        t, _, p = self.coords(rank)
        start = self.rank(t, 0, p)
        return range(start, start + self.tp * self.dp, self.tp)

    def pp_span(self, rank: int) -> range:
        t, d, _ = self.coords(rank)
        start = self.rank(t, d, 0)
        return range(start, start + self.world, self.tp * self.dp)

    def stage_span(self, stage: int) -> range:
        """The ranks of pipeline stage `stage`: consecutive, pipeline being the outermost dimension."""
        return range(stage * self.tp * self.dp, (stage + 1) * self.tp * self.dp)

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        get = {"tp": self.tp_group, "dp": self.dp_group, "pp": self.pp_group}[kind]
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world):
            seen.setdefault(get(r), None)
        return list(seen)

    def spans_nodes(self, group: Sequence[int]) -> bool:
        if isinstance(group, range) and group.step > 0:
            return len(group) > 1 and self.node(group[0]) != self.node(group[-1])
        return len({self.node(r) for r in group}) > 1

    def ranks_per_node_in(self, group: Sequence[int]) -> int:
        """How many members of `group` share the busiest node (they share its network links)."""
        if isinstance(group, range) and group.step > 0 and len(group):
            return _most_per_node(group.start, group.step, len(group), self.gpus_per_node)
        counts: dict[int, int] = {}
        for r in group:
            counts[self.node(r)] = counts.get(self.node(r), 0) + 1
        return max(counts.values())

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "order": "tp-dp-pp"}

    @classmethod
    def from_dict(cls, d: dict) -> "RankGrid":
        return cls(d["tp"], d["pp"], d["dp"], d["gpus_per_node"], d["nodes"])

    def describe(self) -> list[str]:
        """One line per node (at most SHOWN_NODES of them, then a count of the rest): which ranks it holds and their
        (t, d, p) coordinates."""
        lines = [f"rank grid t×p×d = {self.tp}×{self.pp}×{self.dp} = {self.world} ranks "
                 f"on {self.nodes} node(s) × {self.gpus_per_node} (order tp-dp-pp, tp fastest)"]
        shown = shown_nodes(self.nodes)
        for i, n in enumerate(shown):
            if i and n != shown[i - 1] + 1:
                lines.append(f"  ... nodes {shown[i - 1] + 1}-{n - 1}: the same pattern, ranks continuing")
            ranks = range(n * self.gpus_per_node, min((n + 1) * self.gpus_per_node, self.world))
            cells = " ".join(f"{r}:(t{t},d{d},p{p})" for r in ranks for t, d, p in [self.coords(r)])
            lines.append(f"  node {n}: {cells}")
        return lines


def _most_per_node(first: int, step: int, count: int, per_node: int) -> int:
    """The most members of the ranks first, first + step, ... (`count` of them) that one node of `per_node` ranks
    holds. Nodes strictly between the first and the last node the ranks touch hold a number that depends only on
    where the progression enters them, which repeats every step / gcd(step, per_node) nodes: a walk over at most
    that many nodes (fewer than per_node), whatever the count."""
    if step >= per_node:
        return 1

    def before(x: int) -> int:  # members below rank x
        return min(max(-(-(x - first) // step), 0), count)

    lo, hi = first // per_node, (first + (count - 1) * step) // per_node
    period = step // math.gcd(step, per_node)
    nodes = {lo, hi, *range(lo + 1, min(hi, lo + 1 + period))}
    return max(before((k + 1) * per_node) - before(k * per_node) for k in nodes)


# A grid or a dry run of thousands of nodes lists the first few and the last; the rest follow the same pattern.
SHOWN_NODES = 4


def shown_nodes(nodes: int) -> list[int]:
    """The node ranks a listing shows: all up to SHOWN_NODES, else the first SHOWN_NODES - 1 and the last."""
    return list(range(nodes)) if nodes <= SHOWN_NODES else [*range(SHOWN_NODES - 1), nodes - 1]
