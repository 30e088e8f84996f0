"""The explicit rank grid t × p × d that every backend builds its groups from.

Order (fastest-varying first): tensor, data, pipeline — Megatron-Core's default "tp-dp-pp" without
context/expert parallelism, and the layout DeepSpeed AutoTP assumes (consecutive ranks form a TP
group). Keeping TP fastest puts each TP group inside a node; pipeline outermost puts stage
boundaries across nodes, as Narayanan et al. recommend.
"""
from __future__ import annotations

from dataclasses import dataclass


def divisors(n: int) -> list[int]:
    """The whole numbers that divide n, ascending: the degrees a dimension of n ranks (or layers) can split into."""
    return [d for d in range(1, n + 1) if n % d == 0]


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

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        get = {"tp": self.tp_group, "dp": self.dp_group, "pp": self.pp_group}[kind]
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world):
            seen.setdefault(get(r), None)
        return list(seen)

    def spans_nodes(self, group: tuple[int, ...]) -> bool:
        return len({self.node(r) for r in group}) > 1

    def ranks_per_node_in(self, group: tuple[int, ...]) -> int:
        """How many members of `group` share the busiest node (they share its network links)."""
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


# A grid or a dry run of thousands of nodes lists the first few and the last; the rest follow the same pattern.
SHOWN_NODES = 4


def shown_nodes(nodes: int) -> list[int]:
    """The node ranks a listing shows: all up to SHOWN_NODES, else the first SHOWN_NODES - 1 and the last."""
    return list(range(nodes)) if nodes <= SHOWN_NODES else [*range(SHOWN_NODES - 1), nodes - 1]
