"""Analyses of Kineto trace tables (analysis.parsers.kineto), HTA-compatible where HTA has a definition.

Every function is a pure function of a table from `parse_kineto` / `parse_kineto_ranks` and returns
a Table with documented columns, one group of rows per rank. Analyses of one table share the per-rank scope
derived from it through a `TraceScopes` the caller creates for that table and passes as `scopes=`; without one,
each call derives its own.

Which GPU events count (the "HTA scope"), as HolisticTraceAnalysis 0.5.0 loads a trace
(hta/common/trace.py `_filter_irrelevant_gpu_kernels`, hta/common/trace_parser.py):
- GPU events are rows with a stream other than -1 (kernels, memcpy, memset).
- When the table holds two or more distinct ProfilerStep names, each rank keeps only the GPU events
  launched (same correlation) by a CPU event that starts before the rank's last ProfilerStep
  starts (`include_last_step=True`: no later than it ends); the last step is usually cut off by
  the profiler stopping. With fewer ProfilerSteps every GPU event counts.
- When a rank's trace writes some timestamp as a non-integer (ns-resolution traces, PyTorch PR
  122425), HTA rounds every interval inward to whole microseconds: start = ceil(ts), end =
  floor(ts + dur). `hta_rounding=False` keeps the exact intervals.
- Intervals of one kind are merged as hta.utils.merge_kernel_intervals does (sort by start; a new
  block starts when a start lies after every earlier end).
Known differences: HTA counts a GPU kernel once per CPU event that shares its correlation (we count
it once); HTA's JSON backend decides rounding per file exactly as here, its ijson backends always
round.

A file cut short (parsers.kineto meta `truncated`) holds no event that starts after the last one
read (`read_until_us`): each rank's window keeps only the steps that end before it, and the GPU
scope only what was launched before the last of those ends (no HTA counterpart; HTA cannot load
such a file). Threads the writer had not reached are lost with the cut.

CPU-only traces (gloo runs have no GPU events) use a stated CPU-side definition instead, marked
basis = "cpu_ops" in the outputs:
- training thread(s): the thread(s) holding the ProfilerStep annotations, else the thread with the
  most cpu_op time; window W: the union of the ProfilerStep spans (last one dropped as above), or
  the whole trace when there are none;
- communication M: collective calls (c10d::*, record_param_comms, nccl:*, gloo:*, functional
  collectives) on any thread of the rank, M_sync being those on the training thread(s);
- computation C: the other cpu_op events on the training thread(s), less the time inside M_sync
  (the ops a collective call runs are part of the call);
- compute = |C ∩ W|, non-compute (communication) = |(M \\ C) ∩ W|, idle = |W| - |(C ∪ M) ∩ W|,
  overlap = |M ∩ C ∩ W| / |M ∩ W|.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, NamedTuple

from analysis.analyzers.collectives import (
    CPU_LAYERS,
    bus_factor_of,
    gloo_reduce_scatters,
    group_size_hint,
    nccl_tests_bytes,
)
from analysis.parsers import kineto as _kineto
from analysis.parsers.kineto import PROFILER_STEP, KinetoMeta, KinetoRanksMeta, gc_paused, rows_in, rows_not
from analysis.table import Table
from launch.run.rundir import RECOMPUTE_REGION

_KINDS = ("computation", "communication", "memory")  # HTA's order: bit 1, 2, 4


# What the GPU-basis analyses read: the GPU events, the runtime / driver calls that launch them
# (their correlation gives the launch time HTA's scope uses, and the step), and the user annotations
# that hold ProfilerStep#N. On a GPU trace whose ProfilerStep spans are user annotations (as
# Kineto writes them), a table from parse_kineto(..., categories=GPU_ANALYSIS_CATEGORIES) gives the
# same temporal_breakdown, comm_comp_overlap, kernel_breakdown, kernel_type_breakdown and
# kernel_diff as the full table, and is read faster (no rows for the cpu_op events, often half of
# them). Not for CPU-only traces, nor for the collective and size columns of communication kernels,
# which come from the CPU collective calls.
GPU_ANALYSIS_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_runtime",
                                     "cuda_driver", "user_annotation"})



class ScopeMeta(NamedTuple):
    """Table.meta of temporal_breakdown, comm_comp_overlap, exposed_communication, kernel_breakdown,
    kernel_type_breakdown and collective_summary: the scope they were computed with."""

    include_last_step: bool  # the last ProfilerStep of each rank was kept in the window
    hta_rounding: bool  # GPU intervals of float-ts traces were rounded inward to whole microseconds, as HTA does


class KernelDiffMeta(NamedTuple):
    """Table.meta of kernel_diff."""

    normalize: str  # "none" (totals) or "per_step" (per profiled step of each side)


class StragglersMeta(NamedTuple):
    """Table.meta of stragglers: the rule's settings."""

    threshold_pct: float  # how far (% of the median step) a rank must stand out to be a straggler
    include_last_step: bool  # the last ProfilerStep of each rank was kept in the window


# ---------------------------------------------------------------------------------------------
# interval helpers

def _hta_merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """hta.utils.merge_kernel_intervals: blocks of intervals, a new block when a start lies after
    every earlier end; each block spans (min start, max end). In C when the parser's extension is
    built (same objects out; the equality is tested)."""
    if _kineto._kscan is not None:
        merged = _kineto._kscan.hta_merge(intervals)
        if merged is not None:
            return merged
    intervals.sort()
    out = []
    reach = -math.inf
    cs = ce = None
    for s, e in intervals:
        if s > reach:
            if cs is not None:
                out.append((cs, ce))
            cs, ce = s, e
        elif e > ce:
            ce = e
        if e > reach:
            reach = e
    if cs is not None:
        out.append((cs, ce))
    return out


def _measure(blocks: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in blocks)


def _sweep(groups: list[list[tuple[float, float]]]) -> dict[int, float]:
    """Time spent in each combination of groups (bit i = group i active), as HTA computes it:
    +bit at each block start, -bit at each end, running sum held until the next event (in C when
    the parser's extension is built)."""
    if _kineto._kscan is not None:
        states = _kineto._kscan.sweep(groups)
        if states is not None:
            return states
    events = []
    for bit, blocks in enumerate(groups):
        v = 1 << bit
        for s, e in blocks:
            events.append((s, v))
            events.append((e, -v))
    events.sort(key=operator.itemgetter(0))  # stable: ties keep HTA's order
    times = list(map(operator.itemgetter(0), events))
    running = itertools.accumulate(map(operator.itemgetter(1), events))
    out: dict[int, float] = defaultdict(float)
    for state, held in zip(running, map(operator.sub, times[1:], times)):
        if state > 0:
            out[state] += held
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Time covered by at least one of the intervals (their union's length)."""
    return sum(e - s for s, e in _union(intervals))


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# ---------------------------------------------------------------------------------------------
# scoping

_UNKNOWN_FILE = KinetoMeta()  # the file meta of a rank whose table says nothing about its files


class _Rank:
    """The rows of one rank and the derived sets every analysis needs (held by a TraceScopes)."""

    def __init__(self, columns: Mapping[str, list[Any]], table_meta: Any, rank: Any,
                 rows: list[int] | range, step_numbers: dict[str, int], filter_steps: bool,
                 include_last_step: bool, hta_rounding: bool):
        self.columns, self.table_meta, self.rank, self.rows = columns, table_meta, rank, rows
        c = columns
        self.ts, self.dur, self.name = c["ts_us"], c["dur_us"], c["name"]
        self.stream, self.corr, self.kind = c["stream"], c["correlation"], c["kind"]
        self.coll, self.cat, self.pid, self.tid = c["collective"], c["category"], c["pid"], c["tid"]
        # The rank's file: its entry of a many-rank table, a one-file table's own; nothing known otherwise.
        meta = (table_meta.ranks.get(rank) if isinstance(table_meta, KinetoRanksMeta) else
                table_meta if isinstance(table_meta, KinetoMeta) else None)
        self.meta: KinetoMeta = meta if meta is not None else _UNKNOWN_FILE
        self.round = hta_rounding and bool(self.meta.ts_float)
        stream, name, ts, dur = self.stream, self.name, self.ts, self.dur
        if isinstance(rows, range):  # a one-rank table: scan the columns in C
            with_stream = rows_not(stream, None)
            step_rows = rows_in(name, step_numbers)
        else:
            with_stream = [i for i in rows if stream[i] is not None]
            step_rows = [i for i in rows if name[i] in step_numbers]
        self.gpu_all = [i for i in with_stream if stream[i] != -1] if -1 in stream else with_stream
        if not self.gpu_all:
            # gloo runs a reduce-scatter as an all-reduce: its annotation counts as the reduce-scatter it is, in
            # every analysis, so that one call has one name.
            carried = gloo_reduce_scatters(name, self.coll, c["message_bytes"], ts, rows)
            if carried:
                self.coll = ["reduce_scatter" if i in carried else x for i, x in enumerate(self.coll)]
        # (start, end, N, row) of the rank's ProfilerStep#N spans, by start
        self.steps = sorted((ts[i], ts[i] + dur[i], step_numbers[name[i]], i) for i in step_rows
                            if stream[i] is None or stream[i] == -1)
        self.last_step_dropped = len(self.steps) >= 2 and not include_last_step
        self.window_steps = self.steps[:-1] if self.last_step_dropped else self.steps
        # A cut-short file (parsers.kineto meta) holds no event that starts after the last one read: a
        # step ending later would count its missing events as idle, so the window keeps only the steps
        # that end before it (the parser warns which).
        self.read_until: float | None = self.meta.read_until_us if self.meta.truncated else None
        if self.read_until is not None:
            self.window_steps = [s for s in self.window_steps if s[1] <= self.read_until]
        self.gpu = self._gpu_scope(filter_steps, include_last_step)
        self._gpu_iv: list[tuple[float, float]] | None = None
        self._blocks: dict[tuple[str | None, str | None], list[tuple[float, float]]] = {}

    def intervals(self, rows: Iterable[int]) -> list[tuple[float, float]]:
        ts, dur = self.ts, self.dur
        if self.round:
            return [(math.ceil(ts[i]), math.floor(ts[i] + dur[i])) for i in rows]
        return [(ts[i], ts[i] + dur[i]) for i in rows]

    def gpu_intervals(self) -> list[tuple[float, float]]:
        """intervals(self.gpu), computed once."""
        if self._gpu_iv is None:
            self._gpu_iv = self.intervals(self.gpu)
        return self._gpu_iv

    def _gpu_scope(self, filter_steps: bool, include_last_step: bool) -> list[int]:
        if not filter_steps or not self.steps:
            return self.gpu_all
        stream, corr, ts = self.stream, self.corr, self.ts
        launch = self.columns["launch_ts_us"]
        limit = max(s[1] for s in self.steps) if include_last_step else self.steps[-1][0]
        if self.read_until is not None:
            limit = min(limit, self.window_steps[-1][1] if self.window_steps else -math.inf)
        # HTA's split: a GPU kernel (stream >= 0 and correlation >= 0) is kept when a CPU event
        # with its correlation starts in scope (the launch); an event with a stream but no
        # correlation counts as a CPU event, kept when it starts in scope itself.
        kept = []
        for i in self.gpu_all:
            c = corr[i]
            t = launch[i] if stream[i] >= 0 and c is not None and c >= 0 else ts[i]
            if t is not None and (t <= limit if include_last_step else t < limit):
                kept.append(i)
        return kept

    def gpu_blocks(self, kind: str | None = None, collective: str | None = None) -> list[tuple[float, float]]:
        """Merged intervals of the GPU events in scope of one kind (and collective); computed once
        per rank, since the analyses ask for the same ones."""
        blocks = self._blocks.get((kind, collective))
        if blocks is None:
            k, coll = self.kind, self.coll
            blocks = self._blocks[(kind, collective)] = _hta_merge(
                [iv for i, iv in zip(self.gpu, self.gpu_intervals())
                 if (kind is None or k[i] == kind) and (collective is None or coll[i] == collective)])
        return blocks

    # CPU basis -------------------------------------------------------------------------------
    def training_threads(self) -> set[tuple[Any, Any]]:
        if self.steps:
            return {(self.pid[s[3]], self.tid[s[3]]) for s in self.steps}
        busy: Counter[tuple[Any, Any]] = Counter()
        for i in self.rows:
            if self.cat[i] == "cpu_op":
                busy[(self.pid[i], self.tid[i])] += self.dur[i]
        return {busy.most_common(1)[0][0]} if busy else set()

    def is_cpu(self, i: int) -> bool:
        return self.stream[i] is None or self.stream[i] == -1

    def window(self) -> list[tuple[float, float]]:
        if self.window_steps:
            return _union((s[0], s[1]) for s in self.window_steps)
        if self.steps:  # a truncated file cut every step short
            return []
        cpu = self.intervals(i for i in self.rows if self.is_cpu(i))
        if not cpu:
            return []
        end = max(e for _, e in cpu)
        return [(min(s for s, _ in cpu), min(end, self.read_until) if self.read_until is not None else end)]

    def cpu_sets(self, collective: str | None = None):
        """(W, M, C) of the CPU definition; M restricted to `collective` when given."""
        threads = self.training_threads()
        m_all, m_sync, c_ops = [], [], []
        pid, tid, coll, cat = self.pid, self.tid, self.coll, self.cat
        for i in self.rows:
            if not self.is_cpu(i):
                continue
            on_train = (pid[i], tid[i]) in threads
            if coll[i] is not None:
                if collective is None or coll[i] == collective:
                    m_all.append(i)
                if on_train:
                    m_sync.append(i)
            elif on_train and cat[i] == "cpu_op":
                c_ops.append(i)
        w = self.window()
        c = _intersect(_subtract(_union(self.intervals(c_ops)), _union(self.intervals(m_sync))), w)
        return w, _intersect(_union(self.intervals(m_all)), w), c

    def has_gpu(self) -> bool:
        return bool(self.gpu)

    def recompute_us(self) -> float | None:
        """The compute time inside the trainer's recompute ranges (launch.run.rundir.RECOMPUTE_REGION), a part of the
        breakdown's compute (a recomputed block's own collectives stay communication): computation kernels under the
        range on the GPU timeline where the rank has GPU activity (gpu_user_annotation), else the training thread's
        compute under it; None where the trace holds no such range (a trainer that does not mark recomputation, or
        none to mark)."""
        name, cat = self.name, self.cat
        if self.has_gpu():
            marked = [i for i in self.rows if name[i] == RECOMPUTE_REGION and cat[i] == "gpu_user_annotation"]
            compute = self.gpu_blocks("computation")
        else:
            marked = [i for i in self.rows if name[i] == RECOMPUTE_REGION and self.is_cpu(i)]
            compute = self.cpu_sets()[2]
        if not marked:
            return None
        return _measure(_intersect(_union(self.intervals(marked)), compute))


class TraceScopes:
    """The per-rank scopes of one trace table, derived once per setting and shared by the analyses given it.

    A report runs several analyses on one table; its per-rank scope and merged blocks take longer to derive than most
    analyses take, so the caller creates one TraceScopes per table and passes it to each (`scopes=`; tables are not
    modified once built). `job_steps`: the ProfilerStep names of the whole job the table is part of (every rank's
    step_names): HTA's step filter applies when the job shows two or more, which the table's own ranks alone may not
    (analysis.analyzers.rank_traces summarises a job rank by rank); None: the table's own names decide."""

    def __init__(self, table: Table, *, job_steps: Iterable[str] | None = None) -> None:
        self.table = table
        self.job_steps = frozenset(job_steps) if job_steps is not None else None
        self._derived: dict[tuple[bool, bool], list[_Rank]] = {}  # by (include_last_step, hta_rounding)

    def ranks(self, include_last_step: bool = False, hta_rounding: bool = True) -> list[_Rank]:
        key = (include_last_step, hta_rounding)
        if key not in self._derived:
            self._derived[key] = _scope(self.table, include_last_step, hta_rounding, self.job_steps)
        return self._derived[key]


def _ranks(table: Table, scopes: TraceScopes | None, include_last_step: bool = False,
           hta_rounding: bool = True) -> list[_Rank]:
    """The ranks of `table` as `scopes` (derived from it) holds them, else derived for this call alone."""
    if scopes is None:
        return TraceScopes(table).ranks(include_last_step, hta_rounding)
    if scopes.table is not table:
        raise ValueError(f"trace_analysis: scopes of {scopes.table.source!r} given for {table.source!r}; create one "
                         f"TraceScopes per table")
    return scopes.ranks(include_last_step, hta_rounding)


def step_names(table: Table) -> frozenset[str]:
    """The ProfilerStep#N names among the table's events."""
    return frozenset(n for n in set(table.columns["name"]) if "ProfilerStep" in n and PROFILER_STEP.match(n))


def _scope(table: Table, include_last_step: bool, hta_rounding: bool,
           job_steps: frozenset[str] | None) -> list[_Rank]:
    ranks = table.columns["rank"]
    by_rank: dict[Any, list[int] | range] = {}
    if len(set(ranks)) == 1:
        by_rank[ranks[0]] = range(len(ranks))
    else:
        for i, r in enumerate(ranks):
            by_rank.setdefault(r, []).append(i)
    own = step_names(table)
    step_numbers = {n: int(PROFILER_STEP.match(n).group(1)) for n in own}
    # HTA filters only when the whole job shows two or more ProfilerStep names.
    filter_steps = len(own if job_steps is None else job_steps | own) >= 2
    return [_Rank(table.columns, table.meta, r, rows, step_numbers, filter_steps, include_last_step, hta_rounding)
            for r, rows in sorted(by_rank.items(), key=lambda kv: (kv[0] is None, kv[0] if kv[0] is not None else 0))]


def window_steps(table: Table, *, include_last_step: bool = False,
                 scopes: TraceScopes | None = None) -> dict[Any, set[int]]:
    """ProfilerStep numbers of each rank's measured window, the scope every analysis here uses: the
    rank's steps, less the last one when it has two or more, less those a truncated file cuts short."""
    return {rk.rank: {s[2] for s in rk.window_steps} for rk in _ranks(table, scopes, include_last_step)}


def rank_source(table: Table, rank: Any) -> str:
    """The file a rank's rows came from (parse_kineto_ranks meta `ranks`), else the table's source."""
    meta = table.meta
    if isinstance(meta, KinetoRanksMeta) and rank in meta.ranks:
        return str(meta.ranks[rank].source or table.source)
    return table.source


def _gc_paused(analysis):
    """Run an analysis with the cyclic garbage collector held off (see kineto.gc_paused): it
    allocates an interval tuple per GPU event and would otherwise trigger collections that walk
    every container alive, the large table included."""
    @functools.wraps(analysis)
    def run(*args, **kwargs):
        with gc_paused():
            return analysis(*args, **kwargs)
    return run


def _stdev(values: list[float], mean: float) -> float:
    """Sample standard deviation (n - 1), two-pass in floats as pandas' std; 0 for one value."""
    if len(values) < 2:
        return 0.0
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _pct(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return 100.0 * part / whole


# ---------------------------------------------------------------------------------------------
# analyses

TEMPORAL_COLUMNS = {
    "rank": "trainer rank",
    "basis": "gpu_kernels (HTA's definition) or cpu_ops (CPU-only trace; see the module docstring)",
    "idle_time_us": "gpu_kernels: kernel_time_us minus the merged time of all GPU events; cpu_ops: "
                    "window time with neither computation nor communication",
    "compute_time_us": "gpu_kernels: merged time of computation kernels; cpu_ops: |C ∩ W|",
    "non_compute_time_us": "gpu_kernels: merged time of all GPU events minus compute_time_us "
                           "(communication, memory, other); cpu_ops: communication not overlapped "
                           "by computation, |(M \\ C) ∩ W|",
    "kernel_time_us": "gpu_kernels: end of the last GPU event minus start of the first (HTA's "
                      "kernel_time); cpu_ops: |W|, the ProfilerStep window",
    "idle_pct": "idle_time_us / kernel_time_us x 100 (HTA rounds its idle_time_pctg to 2 places)",
    "compute_pct": "compute_time_us / kernel_time_us x 100",
    "non_compute_pct": "non_compute_time_us / kernel_time_us x 100",
}


@_gc_paused
def recompute_time(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                   scopes: TraceScopes | None = None) -> dict[Any, float | None]:
    """Per rank, the time its trainer spent recomputing checkpointed blocks, where its traces mark it (_Rank.recompute_us)."""
    return {rk.rank: rk.recompute_us() for rk in _ranks(table, scopes, include_last_step, hta_rounding)}


def temporal_breakdown(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                       scopes: TraceScopes | None = None) -> Table:
    """Per rank compute / non-compute / idle time: HTA's get_temporal_breakdown for GPU traces
    (hta/analyzers/breakdown_analysis.py), the CPU-side definition for CPU-only ones."""
    rows = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        if rk.has_gpu():
            all_blocks = rk.gpu_blocks()
            span = all_blocks[-1][1] - all_blocks[0][0]
            idle = span - _measure(all_blocks)
            compute = _measure(rk.gpu_blocks("computation"))
            non_compute = span - compute - idle
            basis = "gpu_kernels"
        else:
            w, m, c = rk.cpu_sets()
            span = _measure(w)
            compute = _measure(c)
            non_compute = _measure(_subtract(m, c))
            idle = span - _measure(_union(m + c))
            basis = "cpu_ops"
        rows.append({"rank": rk.rank, "basis": basis, "idle_time_us": idle, "compute_time_us": compute,
                     "non_compute_time_us": non_compute, "kernel_time_us": span,
                     "idle_pct": _pct(idle, span), "compute_pct": _pct(compute, span),
                     "non_compute_pct": _pct(non_compute, span)})
    return Table.from_rows("temporal_breakdown", TEMPORAL_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


OVERLAP_COLUMNS = {
    "rank": "trainer rank",
    "basis": "gpu_kernels or cpu_ops",
    "comm_time_us": "merged time of communication (kernels, or collective calls within W)",
    "overlapped_us": "part of comm_time_us during which computation runs",
    "overlap_pct": "overlapped_us / comm_time_us x 100 (HTA's comp_comm_overlap_pctg, unrounded); "
                   "None without communication",
}


@_gc_paused
def comm_comp_overlap(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                      scopes: TraceScopes | None = None) -> Table:
    """Per rank share of communication time overlapped by computation: HTA's get_comm_comp_overlap
    (hta/analyzers/communication_analysis.py) for GPU traces, the CPU-side definition otherwise."""
    rows = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        comm, overlap, basis = _comm_and_overlap(rk, None)
        rows.append({"rank": rk.rank, "basis": basis, "comm_time_us": comm, "overlapped_us": overlap,
                     "overlap_pct": _pct(overlap, comm)})
    return Table.from_rows("comm_comp_overlap", OVERLAP_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


def _comm_and_overlap(rk: _Rank, collective: str | None) -> tuple[float, float, str]:
    if rk.has_gpu():
        comm = rk.gpu_blocks("communication", collective)
        comp = rk.gpu_blocks("computation")
        return _measure(comm), _sweep([comm, comp]).get(3, 0.0), "gpu_kernels"
    _, m, c = rk.cpu_sets(collective)
    return _measure(m), _measure(_intersect(m, c)), "cpu_ops"


EXPOSED_COLUMNS = {
    "rank": "trainer rank",
    "collective": "collective type, or 'all' for every communication kernel (call) of the rank",
    "basis": "gpu_kernels or cpu_ops",
    "comm_time_us": "merged time of that communication",
    "overlapped_us": "part of comm_time_us during which computation runs on the rank",
    "exposed_us": "comm_time_us - overlapped_us: communication nothing hides",
    "exposed_pct_of_comm": "exposed_us / comm_time_us x 100",
    "exposed_pct_of_span": "exposed_us / kernel_time_us of temporal_breakdown x 100",
}


@_gc_paused
def exposed_communication(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                          scopes: TraceScopes | None = None) -> Table:
    """Communication time not overlapped by any computation on the same rank, in total and per collective."""
    rows = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        if rk.has_gpu():
            blocks = rk.gpu_blocks()
            span = blocks[-1][1] - blocks[0][0]
            kinds = sorted({rk.coll[i] for i in rk.gpu if rk.kind[i] == "communication" and rk.coll[i]})
        else:
            span = _measure(rk.window())
            kinds = sorted({rk.coll[i] for i in rk.rows if rk.coll[i] is not None and rk.is_cpu(i)})
        for coll in ["all", *kinds]:
            comm, overlap, basis = _comm_and_overlap(rk, None if coll == "all" else coll)
            exposed = comm - overlap
            rows.append({"rank": rk.rank, "collective": coll, "basis": basis, "comm_time_us": comm,
                         "overlapped_us": overlap, "exposed_us": exposed,
                         "exposed_pct_of_comm": _pct(exposed, comm), "exposed_pct_of_span": _pct(exposed, span)})
    return Table.from_rows("exposed_communication", EXPOSED_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


KERNEL_COLUMNS = {
    "rank": "trainer rank",
    "kind": "computation, communication, memory or other (HTA's kernel type)",
    "name": "full kernel (memcpy, memset) name",
    "count": "number of events",
    "total_us": "sum of durations",
    "wall_us": "time with at least one of these calls running (the union of their intervals): below total_us "
               "when calls run at once, e.g. on gloo's two worker threads",
    "mean_us": "total_us / count",
    "min_us": "shortest duration",
    "max_us": "longest duration",
    "std_us": "sample standard deviation of the durations (0 for one event), as pandas' std",
    "share_of_kind_pct": "total_us / (total_us of all names of this kind on the rank) x 100",
}


@_gc_paused
def kernel_breakdown(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                     scopes: TraceScopes | None = None) -> Table:
    """Time and count per kernel name and type, per rank (HTA's get_gpu_kernel_breakdown per-name
    table, without its folding of the tail into 'others'), longest total first within a kind."""
    rows = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        durs: dict[tuple[str, str], list[float]] = defaultdict(list)
        for i, (s, e) in zip(rk.gpu, rk.gpu_intervals()):
            durs[(rk.kind[i], rk.name[i])].append(e - s)
        kind_total: Counter[str] = Counter()
        for (kind, _), ds in durs.items():
            kind_total[kind] += sum(ds)
        for (kind, name), ds in sorted(durs.items(), key=lambda kv: (kv[0][0], -sum(kv[1]))):
            total = sum(ds)
            rows.append({"rank": rk.rank, "kind": kind, "name": name, "count": len(ds), "total_us": total,
                         "mean_us": total / len(ds), "min_us": min(ds), "max_us": max(ds),
                         "std_us": _stdev(ds, total / len(ds)),
                         "share_of_kind_pct": _pct(total, kind_total[kind])})
    return Table.from_rows("kernel_breakdown", KERNEL_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


KERNEL_TYPE_COLUMNS = {
    "rank": "trainer rank",
    "kernel_type": "one kind (computation, communication, memory) or kinds running at once, joined "
                   "by ' overlapping ' in HTA's order (computation, communication, memory)",
    "time_us": "wall time in that state, from the merged intervals of each kind",
    "share_pct": "time_us / the rank's total over all states x 100",
}


@_gc_paused
def kernel_type_breakdown(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                          scopes: TraceScopes | None = None) -> Table:
    """HTA's kernel-type table of get_gpu_kernel_breakdown (include_memory_kernels=True), per rank;
    HTA sums it over ranks."""
    rows = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        if not rk.has_gpu():
            continue
        states = _sweep([rk.gpu_blocks(k) for k in _KINDS])
        total = sum(states.values())
        for mask, t in sorted(states.items(), key=lambda kv: -kv[1]):
            label = " overlapping ".join(k for b, k in enumerate(_KINDS) if mask & (1 << b))
            rows.append({"rank": rk.rank, "kernel_type": label, "time_us": t, "share_pct": _pct(t, total)})
    return Table.from_rows("kernel_type_breakdown", KERNEL_TYPE_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


DIFF_COLUMNS = {
    "name": "kernel name",
    "kind": "kernel type (of run b when it differs)",
    "count_a": "events in run a (per rank-step with normalize='per_step')",
    "count_b": "events in run b (same normalisation)",
    "count_delta": "count_b - count_a",
    "time_a_us": "total duration in run a (same normalisation)",
    "time_b_us": "total duration in run b (same normalisation)",
    "time_delta_us": "time_b_us - time_a_us",
    "time_delta_pct": "time_delta_us / time_a_us x 100; None when the kernel is new in b",
}


class KernelTotals(NamedTuple):
    """GPU events per kernel name over some ranks of a run (kernel_totals), one side of kernel_diff."""

    counts: Counter[str]  # events per name
    times: Counter[str]  # summed duration per name, us
    kinds: dict[str, str]  # kernel type per name (the last rank's, where they differ)
    steps: int  # (rank, ProfilerStep) pairs in scope

    def plus(self, other: "KernelTotals") -> "KernelTotals":
        # update, not +: Counter's + drops the names whose sum is not positive (an inward-rounded kernel can last 0 us)
        counts, times = Counter(self.counts), Counter(self.times)
        counts.update(other.counts)
        times.update(other.times)
        return KernelTotals(counts, times, {**self.kinds, **other.kinds}, self.steps + other.steps)


NO_KERNELS = KernelTotals(Counter(), Counter(), {}, 0)


@_gc_paused
def kernel_totals(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                  scopes: TraceScopes | None = None) -> dict[Any, KernelTotals]:
    """Each rank's KernelTotals, by rank; kernel_diff adds them up in that order."""
    out = {}
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        counts: Counter[str] = Counter()
        times: Counter[str] = Counter()
        kinds: dict[str, str] = {}
        for i, (s, e) in zip(rk.gpu, rk.gpu_intervals()):
            counts[rk.name[i]] += 1
            times[rk.name[i]] += e - s
            kinds[rk.name[i]] = rk.kind[i]
        out[rk.rank] = KernelTotals(counts, times, kinds, len(rk.window_steps))
    return out


def kernel_diff(a: Table, b: Table, *, normalize: str = "none", include_last_step: bool = False,
                hta_rounding: bool = True) -> Table:
    """Counts and time changed per kernel name between two runs, largest absolute time change first.

    normalize='per_step' divides each run by its number of (rank, ProfilerStep) pairs in scope, so
    runs that profiled different numbers of steps or ranks compare."""
    sides = [functools.reduce(KernelTotals.plus, kernel_totals(t, include_last_step=include_last_step,
                                                              hta_rounding=hta_rounding).values(), NO_KERNELS)
             for t in (a, b)]
    return kernel_totals_diff(*sides, normalize=normalize, source=f"{a.source} -> {b.source}")


def kernel_totals_diff(a: KernelTotals, b: KernelTotals, *, normalize: str = "none", source: str = "") -> Table:
    """kernel_diff of two runs' KernelTotals (each summed over its ranks)."""
    if normalize not in ("none", "per_step"):
        raise ValueError(f"kernel_diff: normalize must be 'none' or 'per_step' (got {normalize!r})")
    sides = [(t.counts, t.times, t.kinds, 1.0 / t.steps if normalize == "per_step" and t.steps else 1.0)
             for t in (a, b)]
    (ca, ta, ka, sa), (cb, tb, kb, sb) = sides
    rows = []
    for name in set(ca) | set(cb):
        time_a, time_b = ta[name] * sa, tb[name] * sb
        rows.append({"name": name, "kind": kb.get(name, ka.get(name)), "count_a": ca[name] * sa,
                     "count_b": cb[name] * sb, "count_delta": cb[name] * sb - ca[name] * sa,
                     "time_a_us": time_a, "time_b_us": time_b, "time_delta_us": time_b - time_a,
                     "time_delta_pct": _pct(time_b - time_a, time_a)})
    rows.sort(key=lambda r: (-abs(r["time_delta_us"]), r["name"]))
    return Table.from_rows("kernel_diff", DIFF_COLUMNS, rows, source=source, meta=KernelDiffMeta(normalize=normalize))


COLLECTIVE_COLUMNS = {
    "rank": "trainer rank",
    "collective": "collective type",
    "source": "what was counted: gpu_kernels, or the CPU layer used (backend annotation such as "
              "gloo:all_reduce, record_param_comms, c10d op), the most precise one present",
    "count": "number of calls",
    "total_us": "sum of durations",
    "wall_us": "time with at least one of these calls running (the union of their intervals): below total_us "
               "when calls run at once, e.g. on gloo's two worker threads",
    "mean_us": "total_us / count",
    "sized_count": "calls whose message size is known",
    "message_bytes": "sum over the sized calls of their size in nccl-tests' convention "
                     "(analysis.analyzers.collectives.nccl_tests_bytes: an all_gather backend annotation sized "
                     "from its Input Dims, this rank's shard, is scaled by group_size)",
    "group_size": "ranks in the group (most common value among the calls)",
    "group_size_from": "recorded (args, or pg_config by group name); else the rule of "
                       "analysis.analyzers.collectives.group_size_hint (only process group | every process group "
                       "has this size | world_size); None when none applies",
    "algbw_GBps": "message_bytes / (summed duration of the sized calls), 1e9 bytes per second",
    "bus_factor": "nccl-tests factor for the collective and group_size: all_reduce 2(n-1)/n; "
                  "all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, send_recv 1",
    "busbw_GBps": "algbw_GBps x bus_factor; None when the size or the group size is unknown",
}


@_gc_paused
def collective_summary(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                       scopes: TraceScopes | None = None) -> Table:
    """Per rank and collective type: count, time, and achieved bus bandwidth where the message
    and group sizes are known. GPU traces count communication kernels (HTA scope); CPU-only traces
    count one CPU layer of each call."""
    rows = []
    hint = group_size_hint(table)
    order = [lbl for lbl, _ in CPU_LAYERS]
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        c = rk.columns
        msg, msg_from, gsize = c["message_bytes"], c["message_from"], c["group_size"]
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        if rk.has_gpu():
            for i in rk.gpu:
                if rk.kind[i] == "communication":
                    groups[(rk.coll[i] or "unknown", "gpu_kernels")].append(i)
        else:
            w = rk.window()
            for i in rk.rows:
                if rk.coll[i] is None or not rk.is_cpu(i) or not _starts_in(rk.ts[i], w):
                    continue
                layer = next((lbl for lbl, rx in CPU_LAYERS if rx.match(rk.name[i])), None)
                if layer is not None:
                    groups[(rk.coll[i], layer)].append(i)
            best: dict[str, str] = {}
            for coll, layer in groups:
                if coll not in best or order.index(layer) < order.index(best[coll]):
                    best[coll] = layer
            groups = defaultdict(list, {k: v for k, v in groups.items() if best[k[0]] == k[1]})
        for (coll, source), idx in sorted(groups.items()):
            spans = rk.intervals(idx)
            durs = [e - s for s, e in spans]
            sizes = Counter(gsize[i] for i in idx if gsize[i] is not None)
            if sizes:
                n, n_from = sizes.most_common(1)[0][0], "recorded"
            else:
                n, n_from = hint if hint[0] else (None, None)
            sized = [(nccl_tests_bytes(coll, msg[i], msg_from[i], source, n), d)
                     for i, d in zip(idx, durs) if msg[i] is not None]
            nbytes = sum(m for m, _ in sized) if sized else None
            sized_time = sum(d for _, d in sized)
            algbw = nbytes / sized_time / 1e3 if sized and sized_time > 0 else None
            factor = bus_factor_of(coll, n)
            rows.append({"rank": rk.rank, "collective": coll, "source": source, "count": len(idx),
                         "total_us": sum(durs), "wall_us": covered_us(spans),
                         "mean_us": sum(durs) / len(idx), "sized_count": len(sized),
                         "message_bytes": nbytes, "group_size": n, "group_size_from": n_from,
                         "algbw_GBps": algbw, "bus_factor": factor,
                         "busbw_GBps": algbw * factor if algbw is not None and factor is not None else None})
    return Table.from_rows("collective_summary", COLLECTIVE_COLUMNS, rows, source=table.source,
                           meta=ScopeMeta(include_last_step=include_last_step, hta_rounding=hta_rounding))


def _starts_in(t: float, window: list[tuple[float, float]]) -> bool:
    return any(s <= t < e for s, e in window)


STRAGGLER_COLUMNS = {
    "rank": "trainer rank",
    "steps": "ProfilerSteps in scope on the rank",
    "step_time_us": "median ProfilerStep duration",
    "comm_time_us": "median per step of the merged communication time (kernels launched in the "
                    "step, or collective calls inside it on CPU-only traces)",
    "step_excess_pct": "step_time_us / median step_time_us of the other ranks x 100 - 100",
    "comm_deficit_pct": "(median comm_time_us of the other ranks - comm_time_us) / median step "
                        "time of the other ranks x 100: how much less this rank waits in collectives",
    "straggler": "True when step_excess_pct or comm_deficit_pct exceeds threshold_pct",
    "reason": "slow steps | others wait for it in collectives | both; None otherwise",
}


def stragglers(table: Table, *, threshold_pct: float = 10.0, include_last_step: bool = False,
               hta_rounding: bool = True, scopes: TraceScopes | None = None) -> Table:
    """Ranks that stand out from the others.

    Rule: each rank is compared with the median of the *other* ranks (so it works from two ranks
    on). It is a straggler when its median step is more than threshold_pct longer, or when it
    spends less time in collectives than the others by more than threshold_pct of a step: in a
    synchronous job the rank that arrives last at a collective waits least, and everyone else's
    wait is the time lost to it. Needs ProfilerStep annotations; a lone rank is never flagged.
    """
    return stragglers_of(straggler_inputs(table, include_last_step=include_last_step, hta_rounding=hta_rounding,
                                          scopes=scopes),
                         threshold_pct=threshold_pct, include_last_step=include_last_step, source=table.source)


class StragglerInput(NamedTuple):
    """What stragglers compares of one rank (straggler_inputs)."""

    rank: Any
    steps: int  # ProfilerSteps in scope
    step_time_us: float | None  # median step
    comm_time_us: float | None  # median communication per step


@_gc_paused
def straggler_inputs(table: Table, *, include_last_step: bool = False, hta_rounding: bool = True,
                     scopes: TraceScopes | None = None) -> list[StragglerInput]:
    """Each rank's steps and medians, by rank: the part of stragglers that needs the rank's events."""
    import statistics  # here, not at the top: start-up time of the trace analyses
    per_rank = []
    for rk in _ranks(table, scopes, include_last_step, hta_rounding):
        steps = {s[2]: s[1] - s[0] for s in rk.window_steps}
        comm_by_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
        if rk.has_gpu():
            step_col = rk.columns["step"]
            for i, iv in zip(rk.gpu, rk.gpu_intervals()):
                if rk.kind[i] == "communication" and step_col[i] in steps:
                    comm_by_step[step_col[i]].append(iv)
            comm = [_measure(_hta_merge(comm_by_step[n])) for n in steps]
        else:
            _, m, _ = rk.cpu_sets()
            comm = [_measure(_intersect(m, [(s[0], s[1])])) for s in rk.window_steps]
        per_rank.append(StragglerInput(rk.rank, len(steps), statistics.median(steps.values()) if steps else None,
                                       statistics.median(comm) if comm else None))
    return per_rank


def stragglers_of(per_rank: list[StragglerInput], *, threshold_pct: float = 10.0, include_last_step: bool = False,
                  source: str = "") -> Table:
    """stragglers from the ranks' straggler_inputs (in rank order)."""
    import statistics
    rows = []
    for rank, nsteps, step_t, comm_t in per_rank:
        others = [(s, c) for r, _, s, c in per_rank if r != rank and s is not None]
        excess = deficit = None
        if step_t is not None and others:
            med_step = statistics.median(s for s, _ in others)
            med_comm = statistics.median(c for _, c in others)
            excess = _pct(step_t - med_step, med_step)
            deficit = _pct(med_comm - comm_t, med_step)
        slow = excess is not None and excess > threshold_pct
        early = deficit is not None and deficit > threshold_pct
        reason = ("both" if slow and early else "slow steps" if slow else
                  "others wait for it in collectives" if early else None)
        rows.append({"rank": rank, "steps": nsteps, "step_time_us": step_t, "comm_time_us": comm_t,
                     "step_excess_pct": excess, "comm_deficit_pct": deficit, "straggler": slow or early,
                     "reason": reason})
    return Table.from_rows("stragglers", STRAGGLER_COLUMNS, rows, source=source,
                           meta=StragglersMeta(threshold_pct=threshold_pct, include_last_step=include_last_step))
