"""Where the time went, from Kineto traces (or nsys exports via analysis.parsers.nsys_adapter), and from `nsys stats`.

`time_breakdown` merges trace_analysis's temporal breakdown, overlap and exposed communication per rank
(BREAKDOWN_COLUMNS); `exposed_by_collective` gives the exposed time per collective type, `stragglers` the ranks
that stand out, `kernel_diff` the kernel-level difference of two traces per profiled step, and
`nsys_stats_totals` the GPU time by kind from `nsys stats` summaries (sums, no timeline).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from analysis.analyzers import trace_analysis as ta
from analysis.table import Table

# ------------------------------------------------------------------------- time breakdown (traces)

BREAKDOWN_COLUMNS = {
    "rank": "trainer rank",
    "basis": "gpu_kernels (HTA's definition on GPU activity) or cpu_ops (CPU-only trace: training-thread ops "
             "vs collective calls; see analysis.analyzers.trace_analysis)",
    "span_us": "the window measured: first to last GPU activity in the profiled steps (gpu_kernels), or the "
               "ProfilerStep spans (cpu_ops)",
    "compute_us": "time computation runs (merged): HTA's compute_time",
    "non_compute_us": "span_us - compute_us - idle_us: HTA's non_compute_time (exposed communication, memory copies "
                      "and sets, other GPU activity; cpu_ops: collective calls outside computation)",
    "comm_us": "time communication runs (merged), overlapped or not",
    "overlapped_us": "part of comm_us during which computation also runs",
    "exposed_comm_us": "comm_us - overlapped_us: communication nothing hides",
    "other_us": "non-compute time that is not communication (memcpy/memset and other GPU activity)",
    "idle_us": "time with nothing running (gpu_kernels: no GPU activity; cpu_ops: the training thread neither "
               "computes nor waits in a collective)",
    "compute_pct": "compute_us / span_us x 100",
    "non_compute_pct": "non_compute_us / span_us x 100 (HTA's non_compute_time_pctg, unrounded)",
    "exposed_comm_pct": "exposed_comm_us / span_us x 100",
    "other_pct": "other_us / span_us x 100",
    "idle_pct": "idle_us / span_us x 100",
    "overlap_pct": "overlapped_us / comm_us x 100 (HTA's comp_comm_overlap); None without communication",
    "recompute_us": "time inside the trainer's recompute ranges (our torch ranks mark each checkpointed block's "
                    "recomputation: launch.run.rundir.RECOMPUTE_REGION); None where the trace marks none",
    "recompute_pct": "recompute_us / span_us x 100",
    "source": "trace file of the rank",
}


def time_breakdown(trace: Table, *, scopes: ta.TraceScopes | None = None) -> Table:
    """Per rank: compute, exposed communication, other, idle (they add up to the span), and overlap. `scopes`: the
    trace's trace_analysis.TraceScopes, shared with the caller's other analyses of it."""
    temporal = {r["rank"]: r for r in ta.temporal_breakdown(trace, scopes=scopes).rows()}
    exposed = {r["rank"]: r for r in ta.exposed_communication(trace, scopes=scopes).rows() if r["collective"] == "all"}
    recompute = ta.recompute_time(trace, scopes=scopes)
    rows = []
    for rank, t in temporal.items():
        e = exposed.get(rank, {})
        span = t["kernel_time_us"] or 0.0
        comm = e.get("comm_time_us") or 0.0
        overlapped = e.get("overlapped_us") or 0.0
        exp = e.get("exposed_us") or 0.0
        other = max(0.0, (t["non_compute_time_us"] or 0.0) - exp)
        pct = (lambda x: 100.0 * x / span if span else None)
        rows.append({"rank": rank, "basis": t["basis"], "span_us": span, "compute_us": t["compute_time_us"],
                     "non_compute_us": t["non_compute_time_us"], "comm_us": comm, "overlapped_us": overlapped,
                     "exposed_comm_us": exp, "other_us": other, "idle_us": t["idle_time_us"],
                     "compute_pct": pct(t["compute_time_us"]), "non_compute_pct": pct(t["non_compute_time_us"]),
                     "exposed_comm_pct": pct(exp), "other_pct": pct(other), "idle_pct": pct(t["idle_time_us"]),
                     "overlap_pct": 100.0 * overlapped / comm if comm else None,
                     "recompute_us": recompute.get(rank), "recompute_pct": (
                         pct(recompute[rank]) if recompute.get(rank) is not None else None),
                     "source": ta.rank_source(trace, rank)})
    return Table.from_rows("time_breakdown", BREAKDOWN_COLUMNS, rows, source=trace.source, warnings=trace.warnings)


# The columns of trace_analysis.exposed_communication (their one home), with the rank's file.
EXPOSED_BY_COLLECTIVE_COLUMNS = {**ta.EXPOSED_COLUMNS, "source": "trace file of the rank"}


def exposed_by_collective(trace: Table, *, scopes: ta.TraceScopes | None = None) -> Table:
    """trace_analysis.exposed_communication per collective type (the 'all' rows left out), with the rank's file;
    `scopes` as for time_breakdown."""
    rows = [{**r, "source": ta.rank_source(trace, r["rank"])}
            for r in ta.exposed_communication(trace, scopes=scopes).rows() if r["collective"] != "all"]
    return Table.from_rows("exposed_by_collective", EXPOSED_BY_COLLECTIVE_COLUMNS, rows, source=trace.source)


STRAGGLER_COLUMNS = {**ta.STRAGGLER_COLUMNS, "source": "trace file of the rank"}


def stragglers(trace: Table, *, threshold_pct: float = 10.0) -> Table:
    """trace_analysis.stragglers (rule in its docstring) with the rank's file."""
    return with_rank_files(ta.stragglers(trace, threshold_pct=threshold_pct), lambda r: ta.rank_source(trace, r))


def with_rank_files(stragglers: Table, file_of: Callable[[Any], str]) -> Table:
    """A trace_analysis.stragglers table with each rank's file (`file_of(rank)`)."""
    rows = [{**r, "source": file_of(r["rank"])} for r in stragglers.rows()]
    return Table.from_rows("stragglers", STRAGGLER_COLUMNS, rows, source=stragglers.source, meta=stragglers.meta)


# ------------------------------------------------------------------------------ nsys stats totals

NSYS_STATS_COLUMNS = {
    "kind": "computation, communication or memory (kernel and memory-time reports)",
    "collective": "collective for NCCL kernels; None otherwise",
    "instances": "calls summed over the rows",
    "total_ms": "summed GPU time, ms",
    "share_pct": "total_ms / all GPU time in these reports x 100 (sums, not a timeline: overlap and idle unknown)",
    "source": "nsys stats file",
}


def nsys_stats_totals(stats: Table) -> Table:
    """GPU time by kind and collective from `nsys stats` kernel and memory-time summaries."""
    acc: dict[tuple[str, Any], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in stats.rows():
        if r["report"] not in ("cuda_gpu_kern_sum", "cuda_gpu_mem_time_sum") or r["total_ns"] is None:
            continue
        kind = r["kind"] or ("memory" if r["report"] == "cuda_gpu_mem_time_sum" else "computation")
        a = acc[(kind, r["collective"])]
        a[0] += r["total_ns"] / 1e6
        a[1] += r["instances"] or 0
    total = sum(a[0] for a in acc.values())
    rows = [{"kind": k, "collective": c, "instances": int(a[1]), "total_ms": a[0],
             "share_pct": 100 * a[0] / total if total else None, "source": stats.source}
            for (k, c), a in sorted(acc.items(), key=lambda kv: -kv[1][0])]
    return Table.from_rows("nsys_stats_totals", NSYS_STATS_COLUMNS, rows, source=stats.source)


def kernel_diff(a: Table, b: Table, *, top: int = 15) -> Table:
    """trace_analysis.kernel_diff per profiled step (normalize='per_step'), the largest changes first."""
    return _top(ta.kernel_diff(a, b, normalize="per_step"), top)


def kernel_totals_diff(a: ta.KernelTotals, b: ta.KernelTotals, *, source: str = "", top: int = 15) -> Table:
    """kernel_diff of two runs' trace_analysis.KernelTotals (each over all its ranks)."""
    return _top(ta.kernel_totals_diff(a, b, normalize="per_step", source=source), top)


def _top(d: Table, top: int) -> Table:
    return Table.from_rows("kernel_diff", d.doc, list(d.rows())[:top], source=d.source, meta=d.meta)
