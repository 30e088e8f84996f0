"""How a collective call is counted and sized, defined once for the library (trace_analysis) and the
report (analysis.analyzers.collective_calls), so that the two cannot disagree on a trace.

- `NCCL_TESTS_OP` (from launch.comm.nccl_format, its one home): our collective names (the `collective` column of
  analysis.parsers.kineto) -> nccl-tests op names, the names `bus_factor` knows.
- `REDUCTIONS`: the collectives a gradient reduction may run as.
- `CPU_LAYERS`: the CPU-side layers of one collective call, most precise first.
- `nccl_tests_bytes`: a call's message size in nccl-tests' convention.
- `group_size_hint`: the group size of calls that record none.
- `gloo_reduce_scatters`: the gloo all-reduce annotations that run a reduce-scatter, so that a call is counted once,
  under the collective the program asked for.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Sequence

from analysis.parsers.kineto import KinetoMeta, KinetoRanksMeta, rows_not
from analysis.table import Table
from launch.comm.nccl_format import NCCL_TESTS_OP, bus_factor

# A data-parallel gradient reduction runs as either, by implementation and backend (DeepSpeed's ZeRO-2
# reduce-scatters on NCCL but all-reduces on gloo), so a prediction of one is compared with both.
REDUCTIONS = ("all_reduce", "reduce_scatter")

BACKEND_ANNOTATION = "backend annotation"
C10D_OP = re.compile(r"^(?:c10d::|_?c10d_functional::)")
# The backend's own annotation spans the work itself (on gloo's worker thread it is the only layer
# that does), then the profiler's record_param_comms, then the c10d dispatcher op.
CPU_LAYERS = ((BACKEND_ANNOTATION, re.compile(r"^(?:nccl|gloo|mpi|ucc):")),
              ("record_param_comms", re.compile(r"^record_param_comms$")),
              ("c10d op", C10D_OP))


def bus_factor_of(collective: str, group_size: int | None) -> float | None:
    """nccl-tests' busbw / algbw factor for one of our collective names; None when it has none."""
    op = NCCL_TESTS_OP.get(collective)
    return bus_factor(op, group_size) if op and group_size else None


def nccl_tests_bytes(collective: str, message_bytes: int | float | None, message_from: str | None,
                     layer: str | None, group_size: int | None) -> int | float | None:
    """`message_bytes` (parsers.kineto) in nccl-tests' convention, where all_gather counts the gathered output.

    Only an all_gather sized from the `Input Dims` of a backend annotation (gloo:all_gather,
    nccl:all_gather) holds this rank's input shard, so only it is scaled by the group size; sizes from
    'In/Out msg size' or nelems are already the larger of input and output, and a kernel takes the
    largest size among the calls that launched it (c10d::_allgather_base_ records the output).
    """
    if (message_bytes is not None and collective == "all_gather" and layer == BACKEND_ANNOTATION
            and message_from == "input_dims" and group_size):
        return message_bytes * group_size
    return message_bytes


def group_size_hint(trace: Table, layout: Mapping[str, Any] | None = None) -> tuple[int | None, str]:
    """The group size of calls that record none, and why; the first rule that applies:

    1. every process group listed in distributedInfo.pg_config (over all ranks of the trace) has the
       same size: "only process group" when one is listed, "every process group has this size";
    2. `layout` (tp/pp/dp) has exactly one dimension > 1, so every collective spans it;
    3. the trace lists no process group at all (no pg_config, no group on any call) and one world
       size: "world_size" (traces from before PyTorch recorded groups);
    else (None, "unknown"). trace_analysis.collective_summary applies it without a layout.
    """
    meta = trace.meta
    metas: list[KinetoMeta] = (list(meta.ranks.values()) if isinstance(meta, KinetoRanksMeta) else
                               [meta] if isinstance(meta, KinetoMeta) else [])
    return hint_of(metas, layout, meta.world_size if isinstance(meta, KinetoRanksMeta) else None,
                   lambda: bool(rows_not(trace.columns["group"], None)))


def hint_of(metas: Sequence[KinetoMeta], layout: Mapping[str, Any] | None, stated_world: int | None,
            calls_name_groups: Callable[[], bool]) -> tuple[int | None, str]:
    """group_size_hint from the ranks' metas, the world size the ranks state together (KinetoRanksMeta.world_size) and
    whether some call records its group (asked only when the last rule needs it)."""
    sizes: set[int] = set()
    listed = 0
    for m in metas:
        for pg in m.pg_config or []:
            listed += 1
            if isinstance(pg, Mapping) and isinstance(pg.get("pg_size"), int) and pg["pg_size"] > 0:
                sizes.add(pg["pg_size"])
    if len(sizes) == 1:
        names = {str(pg.get("pg_name")) for m in metas for pg in m.pg_config or [] if isinstance(pg, Mapping)}
        return sizes.pop(), "only process group" if len(names) == 1 else "every process group has this size"
    if layout:
        dims = {k: v for k, v in layout.items() if k in ("tp", "pp", "dp") and isinstance(v, int) and v > 1}
        if len(dims) == 1:
            (k, v), = dims.items()
            return v, f"layout: only {k}={v} is > 1"
    worlds = {m.world_size for m in metas} | {stated_world}
    worlds.discard(None)
    if not listed and len(worlds) == 1 and not calls_name_groups():
        world = worlds.pop()
        if isinstance(world, int) and world > 0:
            return world, "world_size"
    return None, "unknown"


def gloo_reduce_scatters(name: Sequence[str | None], collective: Sequence[str | None],
                         message_bytes: Sequence[Any], ts_us: Sequence[float | None], idx: Iterable[int]) -> set[int]:
    """Of the rows `idx` of one rank (columns as in analysis.parsers.kineto), the `gloo:all_reduce` annotations
    that carry a reduce-scatter.

    gloo has no reduce-scatter of its own: torch runs `c10d::_reduce_scatter_base_` as an all-reduce of
    the full input, whose annotation (on gloo's worker thread, after the c10d op returns) names all_reduce.
    gloo runs a rank's work first in, first out, so the c10d all-reduces and reduce-scatters, in issue order, pair
    with the gloo all-reduce annotations in start order, when both counts agree and every pair whose sizes are
    both known agrees in size (a c10d all-reduce of a tensor list records no size). Otherwise (a call cut off at
    the edge of the trace) each known size pairs on its own, and a size whose counts differ is left as recorded
    rather than paired wrongly."""
    issued: list[int] = []
    ran: list[int] = []
    for i in sorted((i for i in idx if ts_us[i] is not None), key=lambda i: ts_us[i]):
        label, coll = name[i] or "", collective[i]
        if coll in ("all_reduce", "reduce_scatter") and C10D_OP.match(label):
            issued.append(i)
        elif coll == "all_reduce" and label == "gloo:all_reduce":
            ran.append(i)
    if len(issued) == len(ran) and all(message_bytes[a] is None or message_bytes[b] is None
                                       or message_bytes[a] == message_bytes[b] for a, b in zip(issued, ran, strict=True)):
        return {g for op, g in zip(issued, ran, strict=True) if collective[op] == "reduce_scatter"}
    by_size_issued: dict[Any, list[int]] = defaultdict(list)
    by_size_ran: dict[Any, list[int]] = defaultdict(list)
    for i in issued:
        by_size_issued[message_bytes[i]].append(i)
    for i in ran:
        by_size_ran[message_bytes[i]].append(i)
    return {g for size, ops in by_size_issued.items() if size is not None and len(ops) == len(by_size_ran.get(size, ()))
            for op, g in zip(ops, by_size_ran[size], strict=True) if collective[op] == "reduce_scatter"}
