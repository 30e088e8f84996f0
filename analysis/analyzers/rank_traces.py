"""A run's Kineto traces reduced rank by rank: memory that does not grow with the ranks, and every core at work.

Each trace file is parsed (analysis.parsers.kineto) and at once reduced to what the report takes from that rank, a
`RankSummary` (its time breakdown, exposed communication and kernel types, its step and communication medians, its
profiled steps, its collective calls as bandwidth sums and arrival times, its kernel totals for the kernel diff); the
event table is dropped before the file's worker reads the next one. `read_traces` runs the files through `jobs` worker
processes; `TraceSet` holds the summaries and answers with the report's tables, the same tables the analyzers give on
the stacked table of every rank (analysis.analyzers.breakdown, collective_calls, trace_analysis, arrivals). It takes
the summaries in file order, so the answer does not depend on the number of workers.

Three facts belong to the whole job rather than to one rank: HTA's step filter applies when the job shows two or more
ProfilerStep names, the group size of calls that record none (collectives.group_size_hint) depends on every rank's
process groups and on the layout, and two files of one rank are pooled into one rank (as parse_kineto_ranks pools
them). A worker decides the first two from its own rank; `TraceSet.settle` summarises again, in this process, the ranks
whose decision differs from the job's and the ranks read from two files: rare (ranks that profiled different steps or
recorded different groups, or a folder holding a rank twice).
"""
from __future__ import annotations

import functools
import os
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

from analysis.analyzers import trace_analysis as ta
from analysis.analyzers.arrivals import ArrivalSet, match_keys
from analysis.analyzers.breakdown import (
    BREAKDOWN_COLUMNS,
    EXPOSED_BY_COLLECTIVE_COLUMNS,
    exposed_by_collective,
    time_breakdown,
    with_rank_files,
)
from analysis.analyzers.collective_calls import (
    BandwidthPart,
    bandwidth_parts,
    collective_calls,
    combine_bandwidth,
    in_window,
)
from analysis.analyzers.collectives import group_size_hint, hint_of
from analysis.analyzers.distributions import PER_RANK_ROWS_MAX
from analysis.parsers.kineto import KinetoMeta, KinetoRanksMeta, parse_kineto_ranks, rows_not
from analysis.table import Table

# The busbw-vs-size figure draws the calls of every rank of a run the report shows rank by rank, and of the first this
# many read of a larger one: more points only hide each other.
PLOTTED_RANKS = PER_RANK_ROWS_MAX


class RankSummary(NamedTuple):
    """What the report takes from one rank's events (summarise)."""

    files: tuple[str, ...]  # the trace file(s) read for the rank, as given
    rank: Any
    meta: KinetoMeta  # the rank's file meta, source set
    warnings: tuple[str, ...]  # the parser's warnings about the file(s) (a table of several ranks: on its first)
    rows: int  # events in the rank's table
    steps: frozenset[str]  # its ProfilerStep names (empty when summarised with other ranks, whose table is scoped whole)
    job_steps: frozenset[str] | None  # the job's ProfilerStep names it was scoped with; None: its own
    hint: tuple[int | None, str]  # the group size taken for calls that record none, and why
    unsized: bool  # some call records no group size: the hint counts
    names_groups: bool  # some call records its process group (collectives.hint_of)
    gpu: bool  # it has GPU events
    breakdown: dict[str, Any] | None  # its row of breakdown.time_breakdown; None without events
    exposed: tuple[dict[str, Any], ...]  # its rows of breakdown.exposed_by_collective
    kernel_types: tuple[dict[str, Any], ...]  # its rows of trace_analysis.kernel_type_breakdown
    straggler: ta.StragglerInput | None
    window: frozenset[int] | None  # trace_analysis.window_steps of the rank; None without events
    bandwidth: dict[str, BandwidthPart]  # collective_calls.bandwidth_parts of the rank
    points: tuple[tuple[Any, float], ...]  # (message_bytes, busbw_GBps) of each call with a busbw
    kernels: ta.KernelTotals | None
    calls: tuple[list, list, list, list] | None  # match keys, collectives, starts, ends (arrivals.ArrivalSet.add)


def _rank_order(rank: Any) -> tuple[bool, Any]:
    return rank is None, rank if rank is not None else 0


def summarise(table: Table, files: tuple[str, ...] = (), *, layout: Mapping[str, Any] | None = None,
              job_steps: frozenset[str] | None = None, hint: tuple[int | None, str] | None = None,
              kernels: bool = True) -> list[RankSummary]:
    """One RankSummary per rank of `table` (parse_kineto_ranks, or an nsys export through nsys_adapter), in the order
    of its meta's ranks. `job_steps` (the job's ProfilerStep names) and `hint` (its group size for calls that record
    none) stand in for what the table's own ranks show; `kernels=False` leaves the kernel totals out (only the kernel
    diff of two runs reads them)."""
    # one scope of the table for every analysis below: deriving it takes longer than most of them
    scopes = ta.TraceScopes(table, job_steps=job_steps)
    used = hint if hint is not None else group_size_hint(table, layout)
    c = table.columns
    meta = table.meta
    metas: Mapping[Any, KinetoMeta] = meta.ranks if isinstance(meta, KinetoRanksMeta) else {}
    rows = Counter(c["rank"]) if len(metas) > 1 else {r: len(table) for r in metas}
    stream, rank_col = c["stream"], c["rank"]
    with_stream = rows_not(stream, None)
    if len(metas) == 1:  # stop at the first GPU event
        gpu = set(metas) if any(stream[i] != -1 for i in with_stream) else set()
    else:
        gpu = {rank_col[i] for i in with_stream if stream[i] != -1}
    names_groups = bool(rows_not(c["group"], None))
    steps = ta.step_names(table)
    breakdown = {r["rank"]: r for r in time_breakdown(table, scopes=scopes).rows()}
    exposed, kernel_types, calls = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in exposed_by_collective(table, scopes=scopes).rows():
        exposed[r["rank"]].append(r)
    for r in ta.kernel_type_breakdown(table, scopes=scopes).rows():
        kernel_types[r["rank"]].append(r)
    stragglers = {s.rank: s for s in ta.straggler_inputs(table, scopes=scopes)}
    windows = ta.window_steps(table, scopes=scopes)
    call_table = collective_calls(table, group_size=used[0], group_size_from=used[1])
    for r in call_table.rows():
        calls[r["rank"]].append(r)
    parts = bandwidth_parts(call_table, windows)
    totals = ta.kernel_totals(table, scopes=scopes) if gpu and kernels else {}
    out = []
    for position, (rank, m) in enumerate(metas.items()):
        own = calls.get(rank, [])
        window = windows.get(rank)
        timed = [r for r in own if in_window(r["step"], window)]
        cols = {k: [r[k] for r in timed] for k in ("collective", "step", "start_us", "dur_us", "group", "seq")}
        ends = [s + d if s is not None and d is not None else None
                for s, d in zip(cols["start_us"], cols["dur_us"], strict=True)]
        out.append(RankSummary(
            files=files, rank=rank, meta=m, warnings=table.warnings if position == 0 else (), rows=rows.get(rank, 0),
            steps=steps if len(metas) == 1 else frozenset(), job_steps=job_steps, hint=used,
            unsized=any(r["group_size_from"] != "recorded" for r in own), names_groups=names_groups,
            gpu=rank in gpu, breakdown=breakdown.get(rank), exposed=tuple(exposed.get(rank, ())),
            kernel_types=tuple(kernel_types.get(rank, ())), straggler=stragglers.get(rank),
            window=frozenset(windows[rank]) if rank in windows else None, bandwidth=parts.get(rank, {}),
            points=tuple((r["message_bytes"], r["busbw_GBps"]) for r in own if r["busbw_GBps"]),
            kernels=totals.get(rank),
            calls=(match_keys(cols["collective"], cols["step"], cols["start_us"], cols["group"], cols["seq"]),
                   cols["collective"], cols["start_us"], ends)))
    return out


def _summarise_files(files: tuple[str, ...], *, layout: Mapping[str, Any] | None = None,
                     job_steps: frozenset[str] | None = None, hint: tuple[int | None, str] | None = None,
                     kernels: bool = True) -> list[RankSummary]:
    """Read `files` (one rank's; several are pooled) and summarise them: a worker's task. The table is freed when it
    returns."""
    return summarise(parse_kineto_ranks(files), files, layout=layout, job_steps=job_steps, hint=hint,
                     kernels=kernels)


class TraceSet:
    """A run's traces as RankSummary's, with the report's tables (breakdown, exposed, kernel_types, stragglers,
    bandwidth, busbw_points, arrivals, kernel_totals). Also what analysis.parsers.runs reads of a trace table: name,
    source, warnings, meta (a KinetoRanksMeta, every file's meta), len (events read)."""

    name = "kineto"

    def __init__(self, *, layout: Mapping[str, Any] | None = None, source: str = "",
                 rel: Callable[[str], str] = str, relabel: Callable[[str], str] = str,
                 table: Table | None = None, kernels: bool = True) -> None:
        self.layout = layout
        self.kernels = kernels  # the summaries hold kernel totals (summarise)
        self.source = source
        self._rel, self._relabel = rel, relabel
        self._table = table  # an in-memory table summarised whole (nsys exports); None: read from files
        self._summaries: dict[Any, RankSummary] = {}  # by rank, in file order
        self._sources: dict[Any, str] = {}  # each rank's file, relabelled
        self._again: dict[Any, list[RankSummary]] = {}  # later files of a rank already read: pooled by settle
        self._names: dict[str, str] = {}  # kernel names, one object each across ranks
        self._sized: set[Any] = set()  # ranks with a call that has a busbw
        self._arrivals = ArrivalSet()
        self.hint: tuple[int | None, str] = (None, "unknown")

    def add(self, summary: RankSummary) -> None:
        if summary.rank in self._summaries:
            self._again.setdefault(summary.rank, []).append(summary)
            return
        self._keep(summary)

    def _keep(self, s: RankSummary) -> None:
        """Hold `s` compactly: its calls into the ArrivalSet, its kernel names shared, its points only for the first
        PLOTTED_RANKS ranks."""
        src = self._rel(s.meta.source or "")
        self._sources[s.rank] = src
        for part in s.bandwidth.values():
            part.sources = {src}
        kernels = s.kernels
        if kernels is not None:
            names = self._names
            kernels = ta.KernelTotals(Counter({names.setdefault(k, k): v for k, v in kernels.counts.items()}),
                                      Counter({names.setdefault(k, k): v for k, v in kernels.times.items()}),
                                      {names.setdefault(k, k): v for k, v in kernels.kinds.items()}, kernels.steps)
        if s.calls is not None:
            self._arrivals.add(s.rank, src, *s.calls)
        if s.points:
            self._sized.add(s.rank)
        plotted = sum(1 for r, k in self._summaries.items() if k.points and r != s.rank)
        self._summaries[s.rank] = s._replace(kernels=kernels, calls=None,
                                             points=s.points if plotted < PLOTTED_RANKS else ())

    def settle(self, layout: Mapping[str, Any] | None = None) -> None:
        """Make the job's facts hold on every rank: summarise again the ranks read twice and those scoped or sized
        otherwise than the whole job is (module docstring). `layout`: the run's tp/pp/dp, when known better now."""
        if layout is not None:
            self.layout = layout
        every = [*self._summaries.values(), *(s for again in self._again.values() for s in again)]
        job_steps = frozenset().union(*(s.steps for s in every))
        self.hint = hint_of([s.meta for s in every], self.layout, self.meta.world_size,
                            lambda: any(s.names_groups for s in every))
        if self._table is not None:  # the whole job's table, summarised whole: its decisions are the job's
            return
        redo = [rank for rank, s in self._summaries.items()
                if rank in self._again or (s.unsized and s.hint != self.hint)
                or (len(job_steps) >= 2 and len(s.steps) == 1 and s.job_steps is None)]
        for rank in redo:
            files = self._summaries[rank].files + tuple(f for s in self._again.get(rank, ()) for f in s.files)
            for s in _summarise_files(files, layout=self.layout, job_steps=job_steps, hint=self.hint,
                                      kernels=self.kernels):
                self._keep(s)
        self._again.clear()

    # what analysis.parsers.runs and the report read of a trace table ------------------------------------------
    @property
    def meta(self) -> KinetoRanksMeta:
        ranks = {r: s.meta._replace(source=self._sources[r]) for r, s in self._summaries.items()}
        worlds = {m.world_size for m in ranks.values()} - {None}
        return KinetoRanksMeta(ranks=ranks, world_size=worlds.pop() if len(worlds) == 1 else None)

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(self._relabel(w) for s in self._summaries.values() for w in s.warnings)

    def __len__(self) -> int:
        return sum(s.rows for s in self._summaries.values())

    @property
    def has_gpu(self) -> bool:
        return any(s.gpu for s in self._summaries.values())

    def source_of(self, rank: Any) -> str:
        """The rank's trace file, relabelled."""
        return self._sources.get(rank, self.source)

    # the report's tables ----------------------------------------------------------------------------------------
    def _ranked(self) -> list[RankSummary]:
        """The ranks with events, in rank order (the analyzers' order)."""
        return sorted((s for s in self._summaries.values() if s.breakdown is not None),
                      key=lambda s: _rank_order(s.rank))

    def breakdown(self) -> Table:
        rows = [{**s.breakdown, "source": self._sources[s.rank]} for s in self._ranked()]
        return Table.from_rows("time_breakdown", BREAKDOWN_COLUMNS, rows, source=self.source, warnings=self.warnings)

    def exposed(self) -> Table:
        rows = [{**r, "source": self._sources[s.rank]} for s in self._ranked() for r in s.exposed]
        return Table.from_rows("exposed_by_collective", EXPOSED_BY_COLLECTIVE_COLUMNS, rows, source=self.source)

    def kernel_types(self) -> Table | None:
        """trace_analysis.kernel_type_breakdown of every rank; None when no rank has GPU events."""
        if not self.has_gpu:
            return None
        return Table.from_rows("kernel_type_breakdown", ta.KERNEL_TYPE_COLUMNS,
                               [r for s in self._ranked() for r in s.kernel_types], source=self.source,
                               meta=ta.ScopeMeta(include_last_step=False, hta_rounding=True))

    def stragglers(self, *, threshold_pct: float) -> Table:
        inputs = [s.straggler for s in self._ranked() if s.straggler is not None]
        return with_rank_files(ta.stragglers_of(inputs, threshold_pct=threshold_pct, source=self.source),
                               self.source_of)

    def window_steps(self) -> dict[Any, set[int]]:
        return {s.rank: set(s.window) for s in self._ranked() if s.window is not None}

    def bandwidth(self, ceilings: Table | None, *, no_ceiling_reason: str) -> Table:
        parts = {r: s.bandwidth for r, s in self._summaries.items() if s.bandwidth}
        steps = {s.rank: len(s.window) for s in self._ranked() if s.window is not None}
        return combine_bandwidth(parts, steps, ceilings, no_ceiling_reason=no_ceiling_reason, source=self.source)

    def busbw_points(self) -> tuple[list[tuple[Any, float]], tuple[int, int]]:
        """(message_bytes, busbw_GBps) of the calls of the ranks plotted (PLOTTED_RANKS at most, the first read) in
        rank order, and (ranks plotted, ranks with such calls)."""
        plotted = [s for s in self._ranked() if s.points]
        return [p for s in plotted for p in s.points], (len(plotted), len(self._sized))

    def arrivals(self) -> tuple[Table, Table]:
        """arrivals.ArrivalSet.tables: (by collective, by rank)."""
        return self._arrivals.tables(source=self.source)

    def kernel_totals(self) -> ta.KernelTotals:
        """The kernel diff's side of this run: every rank's KernelTotals added up in rank order (read with kernels)."""
        if not self.kernels:
            raise ValueError("these traces were read without kernel totals (read_traces(kernels=False))")
        return functools.reduce(ta.KernelTotals.plus, (s.kernels for s in self._ranked() if s.kernels is not None),
                                ta.NO_KERNELS)


def of_table(table: Table, layout: Mapping[str, Any] | None = None) -> TraceSet:
    """The TraceSet of a trace table held whole (an nsys export through nsys_adapter)."""
    traces = TraceSet(layout=layout, source=table.source, table=table)
    for s in summarise(table, layout=layout):
        traces.add(s)
    traces.settle()
    return traces


def default_jobs() -> int:
    """Worker processes by default: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_traces(files: Sequence[str | os.PathLike[str]], *, layout: Mapping[str, Any] | None = None,
                jobs: int | None = None, progress: Callable[[int, int], None] | None = None,
                rel: Callable[[str], str] = str, relabel: Callable[[str], str] = str, kernels: bool = True) -> TraceSet:
    """A TraceSet of one run's trace files (one rank each), read by `jobs` worker processes (default_jobs; 1: in this
    process); `progress(done, total)` after each file. `rel` names a file in the report, `relabel` rewrites the
    parser's warnings; `layout` is the run's tp/pp/dp (collectives.group_size_hint); `kernels=False` leaves out the
    kernel totals (summarise)."""
    paths = [os.fspath(f) for f in files]
    traces = TraceSet(layout=layout, source=", ".join(rel(p) for p in paths), rel=rel, relabel=relabel,
                      kernels=kernels)
    work = functools.partial(_summarise_files, layout=layout, kernels=kernels)
    for summaries in _summaries(paths, work, min(jobs or default_jobs(), len(paths)), progress):
        for s in summaries:
            traces.add(s)
    traces.settle()
    return traces


def _summaries(paths: list[str], work: Callable[[tuple[str, ...]], list[RankSummary]], jobs: int,
               progress: Callable[[int, int], None] | None) -> Iterator[list[RankSummary]]:
    """`work` on each file, in file order."""
    if jobs <= 1:
        for done, p in enumerate(paths, start=1):
            yield work((p,))
            if progress is not None:
                progress(done, len(paths))
        return
    # imported here: 10 ms of start-up that `doctor` on one trace never needs
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # fork: the workers start with this process's imports (a spawned one would import them again, ~0.1 s each), and
    # ProcessPoolExecutor forks them all before its own thread starts
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(work, (p,)): k for k, p in enumerate(paths)}
        finished: dict[int, list[RankSummary]] = {}
        due = 0
        for done, future in enumerate(as_completed(futures), start=1):
            finished[futures[future]] = future.result()
            if progress is not None:
                progress(done, len(paths))
            while due in finished:
                yield finished.pop(due)
                due += 1
