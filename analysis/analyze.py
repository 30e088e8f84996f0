"""Analyzers: pure functions from parser tables to documented tables; nothing here reads a file or draws.

Steps (how fast)
  `steps_from_*` bring each source to one per-step table (STEP_COLUMNS): our metrics JSONL,
  Megatron iteration lines, DeepSpeed's own lines, TensorBoard scalars. `step_statistics` drops the
  warm-up and summarises (STEP_STATS_COLUMNS). Warm-up rule, stated in every result:
    * our runs: the steps the trainer marked warmup=true (the run's train.warmup_steps, meta record);
    * foreign logs: the first 10% of the logged step range, at least 10 steps, counted from the
      first logged step; when that would leave fewer than half of the logged records, only the first
      half (rounded down) is dropped.
  MFU: ours = tokens/s/device × flops_per_token / peak FLOP/s of the hardware profile, with the
  flops_per_token formula from the meta record (model FLOPs, torchtitan's count); Megatron logs =
  the log's own TFLOP/s/GPU ÷ the peak of the hardware profile given (Megatron's FLOP count, which
  may include recomputation); unknown without a peak.

Memory
  `memory_from_*` give the peak per rank (MEMORY_COLUMNS); `memory_vs_plan` puts the planner's
  prediction (plan.json, or recomputed from resolved.json) and the device limit beside it.

Time and communication (from Kineto traces, or nsys exports via analysis.nsys_adapter)
  `time_breakdown` merges trace_analysis's temporal breakdown, overlap and exposed communication
  per rank (BREAKDOWN_COLUMNS); `collective_calls` lists every collective call with its size and
  bandwidth; `collective_bandwidth` summarises them per collective type against the nccl-tests
  ceiling; `expected_collectives` derives from a resolved layout how many collectives a step needs,
  and `collectives_vs_layout` compares the observed counts.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from analysis import trace_analysis as ta
from analysis.collectives import (
    BACKEND_ANNOTATION,
    CPU_LAYERS,
    NCCL_TESTS_OP,
    REDUCTIONS,
    bus_factor_of,
    gloo_reduce_scatters,
    group_size_hint,
    nccl_tests_bytes,
)
from analysis.parsers.kineto import rows_equal, rows_not
from analysis.parsers.nccl_tests import large_message_busbw
from analysis.table import Table
from launch.comm.nccl_format import BUS_FACTORS, bus_factor

# ------------------------------------------------------------------------------------------ steps

STEP_COLUMNS = {
    "rank": "rank that recorded the step (None when the log does not say, e.g. Megatron's last-rank lines)",
    "step": "optimizer step / iteration number as recorded",
    "step_time_s": "wall time of the step in seconds (Megatron: the interval average it prints; DeepSpeed: see "
                   "step_source)",
    "tokens_per_s_per_device": "tokens per second per device (None when the source lacks the sequence length)",
    "tflops_per_device": "TFLOP/s per device as the source computes it (ours: model FLOPs; Megatron: its own count)",
    "mfu": "model FLOPs utilisation, a fraction (None when the peak is unknown)",
    "warmup": "True/False when the source marks warm-up steps (ours), None otherwise",
    "step_source": "which record gave step_time_s",
    "source": "file:line of the record",
}


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def steps_from_metrics(metrics: Table) -> Table:
    """Our metrics table (analysis.parsers.metrics) as STEP_COLUMNS rows."""
    rows = [{"rank": r["rank"], "step": r["step"], "step_time_s": _finite(r["step_time_s"]),
             "tokens_per_s_per_device": _finite(r["tokens_per_s_per_device"]),
             "tflops_per_device": _finite(r["tflops_per_device"]), "mfu": _finite(r["mfu"]), "warmup": r["warmup"],
             "step_source": "metrics step_time_s", "source": f"{r['file']}:{r['line']}"} for r in metrics.rows()]
    return Table.from_rows("steps", STEP_COLUMNS, rows, source=metrics.source, warnings=metrics.warnings,
                           meta=dict(metrics.meta))


def steps_from_megatron(log: Table, *, peak_flops: float | None = None) -> Table:
    """Megatron iteration lines as STEP_COLUMNS rows (each line is the average of its logging interval).

    tokens/s/device: the printed `tokens per gpu per second (tgs)` when present, else global batch ×
    sequence length / step time / world size from the arguments dump; MFU: printed TFLOP/s/GPU ÷ peak.
    """
    layout = log.meta.get("layout", {}) or {}
    world = layout.get("world_size")
    seq = layout.get("seq_length")
    rows = []
    for r in log.rows():
        if r["kind"] != "iteration":
            continue
        t = _finite(r["elapsed_ms_per_iteration"])
        t = t / 1000.0 if t else None
        tps = _finite(r["tokens_per_s_per_gpu"])
        s = r["seq_length"] or seq
        if tps is None and t and r["global_batch_size"] and s and world:
            tps = r["global_batch_size"] * s / t / world
        tflops = _finite(r["throughput_tflops_per_gpu"])
        rows.append({"rank": None, "step": r["iteration"], "step_time_s": t, "tokens_per_s_per_device": tps,
                     "tflops_per_device": tflops,
                     "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
                     "warmup": None, "step_source": "Megatron 'elapsed time per iteration (ms)'",
                     "source": f"{log.source}:{r['line']}"})
    return Table.from_rows("steps", STEP_COLUMNS, rows, source=log.source, warnings=log.warnings,
                           meta={"layout": layout})


def steps_from_deepspeed(log: Table) -> Table:
    """DeepSpeed's own lines as STEP_COLUMNS rows.

    Step time, first source present: the pipeline engine's `iter time (s)`; the time between
    consecutive `step=` lines' logging timestamps divided by the steps between them (wall clock,
    everything included); the sum of the global fwd/bwd/step timers (forward/backward/step before
    2023), which leaves out data loading and anything outside the engine.
    """
    rows_all = list(log.rows())
    out: list[dict[str, Any]] = []
    pipe = [r for r in rows_all if r["kind"] == "pipe_step" and _finite(r["iter_time_s"])]
    if pipe:
        for r in pipe:
            out.append(_ds_row(r["step"], r["iter_time_s"], "DeepSpeed pipeline 'iter time (s)'", log, r))
    else:
        stamped = [r for r in rows_all if r["kind"] == "step" and r["timestamp"] and r["step"] is not None]
        by_rank: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for r in stamped:
            by_rank[r["rank"]].append(r)
        for rank, rs in by_rank.items():
            rs.sort(key=lambda r: r["step"])
            for a, b in zip(rs, rs[1:]):
                dt = _timestamp_s(b["timestamp"]) - _timestamp_s(a["timestamp"])
                if b["step"] > a["step"] and dt > 0:
                    out.append(_ds_row(b["step"], dt / (b["step"] - a["step"]),
                                       "time between DeepSpeed 'step=' lines", log, b, rank))
        if not out:
            sums: dict[tuple[Any, Any], list[Any]] = {}
            for r in rows_all:
                if r["kind"] == "timer" and r["name"] in ("fwd", "bwd", "step", "forward", "backward") \
                        and r["step"] is not None and _finite(r["time_ms"]) is not None:
                    key = (r["rank"], r["step"])
                    acc = sums.setdefault(key, [0.0, r])
                    acc[0] += r["time_ms"] / 1000.0
            for (rank, step), (total, r) in sorted(sums.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
                out.append(_ds_row(step, total, "sum of DeepSpeed fwd+bwd+step timers" + (
                    f"; steps: {log.meta['steps_from']}" if log.meta.get("steps_from") else ""), log, r, rank))
    return Table.from_rows("steps", STEP_COLUMNS, out, source=log.source, warnings=log.warnings)


def _ds_row(step: Any, seconds: float, what: str, log: Table, r: Mapping[str, Any], rank: Any = None) -> dict:
    return {"rank": rank if rank is not None else r.get("rank"), "step": step, "step_time_s": seconds,
            "tokens_per_s_per_device": None, "tflops_per_device": None, "mfu": None, "warmup": None,
            "step_source": what, "source": f"{log.source}:{r['line']}"}


def _timestamp_s(text: str) -> float:
    import datetime as dt

    text = text.replace(",", ".")
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S"):
        try:
            return dt.datetime.strptime(text, fmt).timestamp()
        except ValueError:
            continue
    return math.nan


# TensorBoard tags that hold a step time, and their unit scale to seconds.
_TB_STEP_TIME_TAGS = {"train/step_time_s": 1.0, "iteration-time": 1.0, "iteration_time": 1.0,
                      "Train/Samples/elapsed_time_ms": 1e-3}


def steps_from_tensorboard(tb: Table) -> Table:
    """Step times from TensorBoard scalars: our `train/step_time_s`, Megatron's `iteration-time` (s)."""
    rows = []
    for r in tb.rows():
        scale = _TB_STEP_TIME_TAGS.get(r["tag"])
        if scale is None or _finite(r["value"]) is None:
            continue
        rows.append({"rank": None, "step": r["step"], "step_time_s": r["value"] * scale,
                     "tokens_per_s_per_device": None, "tflops_per_device": None, "mfu": None, "warmup": None,
                     "step_source": f"TensorBoard '{r['tag']}'", "source": f"{tb.source}: {r['run']}/{r['file']}"})
    return Table.from_rows("steps", STEP_COLUMNS, rows, source=tb.source, warnings=tb.warnings)


STEP_STATS_COLUMNS = {
    "steps_logged": "distinct steps recorded",
    "steps_dropped": "steps excluded as warm-up",
    "drop_rule": "why those steps were dropped (the rule and where its numbers came from)",
    "steps_measured": "steps in the measured window",
    "first_measured_step": "first step of the measured window",
    "step_time_median_s": "median step time over the measured window, seconds (per step: the slowest rank)",
    "step_time_mean_s": "mean step time, seconds",
    "step_time_p10_s": "10th percentile step time, seconds",
    "step_time_p90_s": "90th percentile step time, seconds",
    "step_time_cv_pct": "standard deviation / mean x 100",
    "tokens_per_s_per_device": "median over measured steps of tokens/s per device (GPU)",
    "tflops_per_device": "median TFLOP/s per device as the source computes it",
    "mfu_pct": "median MFU x 100",
    "mfu_formula": "how MFU was computed, or why it is unknown",
    "step_source": "which record gave the step time",
    "source": "files of the records",
}


def measured_window(steps: Sequence[int], *, warmup_flags: Mapping[int, bool] | None = None,
                    warmup_from: str = "") -> tuple[set[int], int, str]:
    """(measured steps, steps dropped, rule) for the distinct steps given (see the module docstring)."""
    distinct = sorted(set(s for s in steps if s is not None))
    if not distinct:
        return set(), 0, "no steps recorded"
    if warmup_flags and any(v is not None for v in warmup_flags.values()):
        kept = {s for s in distinct if not warmup_flags.get(s)}
        dropped = len(distinct) - len(kept)
        return kept, dropped, (f"the run's warm-up: {dropped} step(s) marked warmup=true by the trainer "
                               f"(train.warmup_steps{' from ' + warmup_from if warmup_from else ''})")
    first, last = distinct[0], distinct[-1]
    k = max(10, math.ceil(0.1 * (last - first + 1)))
    kept = {s for s in distinct if s >= first + k}
    rule = (f"foreign log: first 10% of the logged step range {first}-{last}, at least 10 steps "
            f"(steps < {first + k})")
    if len(kept) < len(distinct) / 2:
        half = len(distinct) // 2
        kept = set(distinct[half:])
        rule += f"; that would leave fewer than half of the {len(distinct)} records, so only the first {half} are dropped"
    return kept, len(distinct) - len(kept), rule


def _percentile(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def step_statistics(steps: Table, *, mfu_formula: str = "", warmup_from: str = "") -> Table:
    """One row: step-time distribution, tokens/s/device and MFU over the measured window."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in steps.rows():
        if r["step"] is not None and r["step_time_s"] is not None:
            by_step[r["step"]].append(r)
    flags = {s: any(x["warmup"] for x in rs) if any(x["warmup"] is not None for x in rs) else None
             for s, rs in by_step.items()}
    kept, dropped, rule = measured_window(list(by_step), warmup_flags=flags, warmup_from=warmup_from)
    # The slowest rank's record stands for the step: a synchronous step ends when its last rank does.
    per_step = {s: max(by_step[s], key=lambda x: x["step_time_s"]) for s in sorted(kept)}
    times = [r["step_time_s"] for r in per_step.values()]
    row: dict[str, Any] = {"steps_logged": len(by_step), "steps_dropped": dropped, "drop_rule": rule,
                           "steps_measured": len(per_step), "first_measured_step": min(per_step) if per_step else None,
                           "mfu_formula": mfu_formula,
                           "step_source": ", ".join(sorted({r["step_source"] for r in per_step.values()})),
                           "source": steps.source}
    if times:
        mean = statistics.fmean(times)
        row.update(step_time_median_s=statistics.median(times), step_time_mean_s=mean,
                   step_time_p10_s=_percentile(times, 0.1), step_time_p90_s=_percentile(times, 0.9),
                   step_time_cv_pct=100 * statistics.pstdev(times) / mean if mean else None)
        for col, key, scale in (("tokens_per_s_per_device", "tokens_per_s_per_device", 1.0),
                                ("tflops_per_device", "tflops_per_device", 1.0), ("mfu_pct", "mfu", 100.0)):
            vals = [r[key] for r in per_step.values() if r[key] is not None]
            row[col] = statistics.median(vals) * scale if vals else None
    return Table.from_rows("step_statistics", STEP_STATS_COLUMNS, [row], source=steps.source,
                           meta={"measured_steps": sorted(per_step), "step_times_s": times})


def measured_step_times(steps: Table, stats: Table) -> list[tuple[int, float, str]]:
    """(step, seconds, source) of the measured window, in step order (for plots and the doctor)."""
    kept = set(stats.meta.get("measured_steps", []))
    best: dict[int, dict[str, Any]] = {}
    for r in steps.rows():
        if r["step"] in kept and r["step_time_s"] is not None:
            if r["step"] not in best or r["step_time_s"] > best[r["step"]]["step_time_s"]:
                best[r["step"]] = r
    return [(s, best[s]["step_time_s"], best[s]["source"]) for s in sorted(best)]


# ------------------------------------------------------------------------------------------ memory

MEMORY_COLUMNS = {
    "rank": "rank (None when the log does not say which rank printed)",
    "max_allocated_bytes": "peak bytes allocated by tensors (torch max_memory_allocated)",
    "max_reserved_bytes": "peak bytes held by the caching allocator (torch max_memory_reserved)",
    "rss_max_bytes": "CPU ranks: peak resident set of the process, bytes",
    "measured_bytes": "the number compared: the larger of max_reserved and max_allocated (GPU), else rss (CPU)",
    "measured_what": "which of the three measured_bytes is",
    "predicted_bytes": "the planner's total for this rank (its backend's accounting); None without a plan",
    "predicted_what": "where the prediction comes from, or 'none' and why",
    "measured_over_predicted": "measured_bytes / predicted_bytes",
    "device_memory_bytes": "memory of one device (CPU profile: per rank) from the hardware profile or as given",
    "pct_of_device": "measured_bytes / device_memory_bytes x 100",
    "source": "file:line of the peak record",
}


def memory_from_metrics(metrics: Table) -> Table:
    """Peak per rank over all steps of our metrics (the trainer records the running peak)."""
    best: dict[Any, dict[str, Any]] = {}
    for r in metrics.rows():
        cur = best.setdefault(r["rank"], {"rank": r["rank"], "max_allocated_bytes": None, "max_reserved_bytes": None,
                                          "rss_max_bytes": None, "source": None, "_key": -1})
        for col, src in (("max_allocated_bytes", "mem_max_allocated_bytes"),
                         ("max_reserved_bytes", "mem_max_reserved_bytes"), ("rss_max_bytes", "rss_max_bytes")):
            v = r[src]
            if v is not None and (cur[col] is None or v > cur[col]):
                cur[col] = v
        key = r["mem_max_reserved_bytes"] or r["mem_max_allocated_bytes"] or r["rss_max_bytes"] or 0
        if key > cur["_key"]:
            cur["_key"], cur["source"] = key, f"{r['file']}:{r['line']}"
    return _memory_table(best.values(), metrics.source, metrics.warnings)


def memory_from_megatron(log: Table) -> Table:
    """Peak per rank from Megatron's `[Rank N] ... memory (MB)` reports."""
    best: dict[Any, dict[str, Any]] = {}
    for r in log.rows():
        if r["kind"] != "memory":
            continue
        _take_peak(best, r["rank"], r["max_allocated_bytes"], r["max_reserved_bytes"], f"{log.source}:{r['line']}")
    return _memory_table(best.values(), log.source, log.warnings)


def memory_from_deepspeed(log: Table) -> Table:
    """Peak per rank from DeepSpeed's ThroughputTimer / see_memory_usage lines (printed in GiB, 2 decimals)."""
    best: dict[Any, dict[str, Any]] = {}
    for r in log.rows():
        if r["kind"] not in ("memory", "throughput"):
            continue
        _take_peak(best, r["rank"], r["max_allocated_bytes"], r["max_reserved_bytes"], f"{log.source}:{r['line']}")
    return _memory_table(best.values(), log.source, log.warnings)


def _take_peak(best: dict, rank: Any, alloc: Any, reserved: Any, source: str) -> None:
    cur = best.setdefault(rank, {"rank": rank, "max_allocated_bytes": None, "max_reserved_bytes": None,
                                 "rss_max_bytes": None, "source": None, "_key": -1})
    if alloc is not None and (cur["max_allocated_bytes"] is None or alloc > cur["max_allocated_bytes"]):
        cur["max_allocated_bytes"] = alloc
    if reserved is not None and (cur["max_reserved_bytes"] is None or reserved > cur["max_reserved_bytes"]):
        cur["max_reserved_bytes"] = reserved
    key = reserved or alloc or 0
    if key > cur["_key"]:
        cur["_key"], cur["source"] = key, source


def _memory_table(rows: Iterable[dict[str, Any]], source: str, warnings: Iterable[str]) -> Table:
    out = []
    for r in sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0)):
        res, alloc = r["max_reserved_bytes"], r["max_allocated_bytes"]
        # Logs print the two peaks at different moments (DeepSpeed's see_memory_usage before training, its
        # throughput line during it), so the larger one is the peak that happened.
        if res is not None and (alloc is None or res >= alloc):
            measured, what = res, "max_reserved (GPU)"
        elif alloc is not None:
            measured, what = alloc, "max_allocated (GPU)"
        elif r["rss_max_bytes"] is not None:
            measured, what = r["rss_max_bytes"], "peak RSS (CPU process)"
        else:
            continue
        out.append({**r, "measured_bytes": measured, "measured_what": what, "predicted_bytes": None,
                    "predicted_what": None, "measured_over_predicted": None, "device_memory_bytes": None,
                    "pct_of_device": None})
    return Table.from_rows("memory", MEMORY_COLUMNS, out, source=source, warnings=warnings)


def memory_vs_plan(memory: Table, plan: Any | None, *, plan_source: str = "",
                   device_memory_bytes: int | None = None, device_source: str = "",
                   no_plan_reason: str = "none (foreign run: no plan)") -> Table:
    """Put the plan's per-rank total and the device limit beside each measured peak.

    `plan` is a launch.plan.layout.Plan; each rank takes the RankPlan listing it, in the plan's
    implementation accounting (the backend's own), total = model states + activations + buffers
    + allowance.
    """
    rows = []
    for r in memory.rows():
        pred, what = None, no_plan_reason
        if plan is not None:
            rp = next((p for p in plan.ranks if r["rank"] in p.ranks), None)
            if rp is None and r["rank"] is None and len(plan.ranks) == 1:
                rp = plan.ranks[0]
            if rp is not None:
                mem = rp.memory[rp.implementation]
                pred = mem.total
                what = (f"{plan_source}: {rp.kind}, {rp.implementation} accounting, total = model states "
                        f"{mem.model_states} + activations {mem.activations} + buffers {mem.buffers} + "
                        f"allowance {mem.allowance} B")
                if device_memory_bytes is None:
                    device_memory_bytes, device_source = rp.device_memory_bytes, f"{plan_source} (hardware profile)"
            else:
                what = f"{plan_source}: no rank plan lists rank {r['rank']}"
        dev = device_memory_bytes
        rows.append({**r, "predicted_bytes": pred, "predicted_what": what,
                     "measured_over_predicted": r["measured_bytes"] / pred if pred else None,
                     "device_memory_bytes": dev,
                     "pct_of_device": 100.0 * r["measured_bytes"] / dev if dev else None})
    return Table.from_rows("memory", MEMORY_COLUMNS, rows, source=memory.source, warnings=memory.warnings,
                           meta={"plan_source": plan_source, "device_source": device_source})


# ------------------------------------------------------------------------- time breakdown (traces)

BREAKDOWN_COLUMNS = {
    "rank": "trainer rank",
    "basis": "gpu_kernels (HTA's definition on GPU activity) or cpu_ops (CPU-only trace: training-thread ops "
             "vs collective calls; see analysis.trace_analysis)",
    "span_us": "the window measured: first to last GPU activity in the profiled steps (gpu_kernels), or the "
               "ProfilerStep spans (cpu_ops)",
    "compute_us": "time computation runs (merged)",
    "comm_us": "time communication runs (merged), overlapped or not",
    "overlapped_comm_us": "part of comm_us during which computation also runs",
    "exposed_comm_us": "comm_us - overlapped_comm_us: communication nothing hides",
    "other_us": "non-compute time that is not communication (memcpy/memset and other GPU activity)",
    "idle_us": "time with nothing running (gpu_kernels: no GPU activity; cpu_ops: the training thread neither "
               "computes nor waits in a collective)",
    "compute_pct": "compute_us / span_us x 100",
    "exposed_comm_pct": "exposed_comm_us / span_us x 100",
    "other_pct": "other_us / span_us x 100",
    "idle_pct": "idle_us / span_us x 100",
    "overlap_pct": "overlapped_comm_us / comm_us x 100 (HTA's comp_comm_overlap); None without communication",
    "source": "trace file of the rank",
}


def _rank_source(trace: Table, rank: Any) -> str:
    ranks = trace.meta.get("ranks")
    if isinstance(ranks, Mapping) and rank in ranks:
        return str(ranks[rank].get("source") or trace.source)
    return trace.source


def time_breakdown(trace: Table) -> Table:
    """Per rank: compute, exposed communication, other, idle (they add up to the span), and overlap."""
    temporal = {r["rank"]: r for r in ta.temporal_breakdown(trace).rows()}
    exposed = {r["rank"]: r for r in ta.exposed_communication(trace).rows() if r["collective"] == "all"}
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
                     "comm_us": comm, "overlapped_comm_us": overlapped, "exposed_comm_us": exp, "other_us": other,
                     "idle_us": t["idle_time_us"], "compute_pct": pct(t["compute_time_us"]),
                     "exposed_comm_pct": pct(exp), "other_pct": pct(other), "idle_pct": pct(t["idle_time_us"]),
                     "overlap_pct": 100.0 * overlapped / comm if comm else None,
                     "source": _rank_source(trace, rank)})
    return Table.from_rows("time_breakdown", BREAKDOWN_COLUMNS, rows, source=trace.source, warnings=trace.warnings)


EXPOSED_COLUMNS = {
    "rank": "trainer rank",
    "collective": "collective type",
    "basis": "gpu_kernels or cpu_ops",
    "comm_us": "merged time of that collective type",
    "exposed_us": "part of it with no computation running",
    "exposed_pct_of_span": "exposed_us / span x 100",
    "source": "trace file of the rank",
}


def exposed_by_collective(trace: Table) -> Table:
    """trace_analysis.exposed_communication per collective type, with the rank's file."""
    rows = [{"rank": r["rank"], "collective": r["collective"], "basis": r["basis"], "comm_us": r["comm_time_us"],
             "exposed_us": r["exposed_us"], "exposed_pct_of_span": r["exposed_pct_of_span"],
             "source": _rank_source(trace, r["rank"])}
            for r in ta.exposed_communication(trace).rows() if r["collective"] != "all"]
    return Table.from_rows("exposed_by_collective", EXPOSED_COLUMNS, rows, source=trace.source)


STRAGGLER_COLUMNS = {**ta.STRAGGLER_COLUMNS, "source": "trace file of the rank"}


def stragglers(trace: Table, *, threshold_pct: float = 10.0) -> Table:
    """trace_analysis.stragglers (rule in its docstring) with the rank's file."""
    t = ta.stragglers(trace, threshold_pct=threshold_pct)
    rows = [{**r, "source": _rank_source(trace, r["rank"])} for r in t.rows()]
    return Table.from_rows("stragglers", STRAGGLER_COLUMNS, rows, source=trace.source, meta=dict(t.meta))


# ------------------------------------------------------------------------------------ collectives

LARGE_MESSAGE_BYTES = 1 << 20

CALL_COLUMNS = {
    "rank": "trainer rank",
    "collective": "collective type",
    "step": "ProfilerStep the call belongs to (None outside steps)",
    "message_bytes": "message size in nccl-tests' convention (all_gather: the gathered output); None when unknown",
    "dur_us": "duration of the call (GPU kernel, or the CPU layer named in `layer`)",
    "start_us": "start of the call, trace clock",
    "group_size": "ranks in the group: recorded, else analysis.collectives.group_size_hint (see group_size_from)",
    "group_size_from": "recorded in the trace, or the rule of the hint that gave it",
    "busbw_GBps": "message_bytes / dur_us / 1e3 x nccl-tests bus factor(collective, group_size); None when unknown",
    "layer": "gpu_kernels, or the CPU layer counted (backend annotation, record_param_comms, c10d op)",
    "source": "trace file of the rank",
}


def collective_calls(trace: Table, *, group_size: int | None = None, group_size_from: str = "") -> Table:
    """Every collective call: GPU communication kernels, or on CPU-only ranks the most precise CPU layer.

    Calls that record no group size take `group_size`, by default group_size_hint(trace) without a
    layout, the size trace_analysis.collective_summary assumes."""
    if group_size is None:
        group_size, group_size_from = group_size_hint(trace)
    c = trace.columns
    by_rank: dict[Any, list[int]] = defaultdict(list)
    # Only rows that can be a call: two C scans over a 150 MB trace's half million events, not a loop.
    ranks = c["rank"]
    for i in sorted({*rows_not(c["collective"], None), *rows_equal(c["kind"], "communication")}):
        by_rank[ranks[i]].append(i)
    rows = []
    for rank, idx in by_rank.items():
        gpu = [i for i in idx if c["kind"][i] == "communication" and c["stream"][i] not in (None, -1)]
        if gpu:
            chosen, layer = gpu, "gpu_kernels"
        else:
            chosen, layer = [], None
            for lbl, rx in CPU_LAYERS:
                chosen = [i for i in idx if c["collective"][i] is not None and c["stream"][i] in (None, -1)
                          and rx.match(c["name"][i] or "")]
                if chosen:
                    layer = lbl
                    break
        carried = (gloo_reduce_scatters(c["name"], c["collective"], c["message_bytes"], c["ts_us"], idx)
                   if layer == BACKEND_ANNOTATION else set())
        for i in chosen:
            coll = "reduce_scatter" if i in carried else c["collective"][i] or "unknown"
            if coll == "barrier":
                continue
            n, n_from = c["group_size"][i], "recorded"
            if n is None:
                n, n_from = group_size, group_size_from or "unknown"
            msg = nccl_tests_bytes(coll, c["message_bytes"][i], c["message_from"][i], layer, n)
            dur = c["dur_us"][i]
            factor = bus_factor_of(coll, n) if n and n > 1 else None
            bw = msg / dur / 1e3 * factor if msg and dur and factor is not None else None
            rows.append({"rank": rank, "collective": coll, "step": c["step"][i], "message_bytes": msg, "dur_us": dur,
                         "start_us": c["ts_us"][i],
                         "group_size": n, "group_size_from": n_from if n else "unknown", "busbw_GBps": bw,
                         "layer": layer, "source": _rank_source(trace, rank)})
    return Table.from_rows("collective_calls", CALL_COLUMNS, rows, source=trace.source)


CEILING_COLUMNS = {
    "op": "nccl-tests collective (all_reduce, all_gather, reduce_scatter, alltoall, sendrecv, broadcast, ...)",
    "busbw_GBps": "large-message bus bandwidth: median busbw over the top quartile of the sizes measured "
                  "(analysis.parsers.nccl_tests.large_message_busbw)",
    "peak_busbw_GBps": "highest busbw measured",
    "nranks": "ranks in the nccl-tests run (printed, else inferred from busbw/algbw)",
    "curve": "(size bytes, busbw GB/s) per size measured, the median over placements and sections, by size",
    "source": "nccl-tests output file",
}


def busbw_at(curve: Sequence[tuple[float, float]], nbytes: float) -> float | None:
    """The sweep's busbw at a message size: linear in log(size) between the two nearest sizes measured, the
    nearest end's value outside the range (busbw flattens at both ends of a sweep)."""
    pts = [(s, b) for s, b in curve if s > 0 and b is not None and math.isfinite(b)]
    if not pts or not (nbytes > 0 and math.isfinite(nbytes)):
        return None
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1]
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if s0 <= nbytes <= s1:
            f = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0)) if s1 > s0 else 0.0
            return b0 + f * (b1 - b0)
    return None


def nccl_ceilings(tables: Iterable[Table]) -> Table:
    """The best large-message busbw per collective over the nccl-tests files given."""
    best: dict[str, dict[str, Any]] = {}
    for t in tables:
        for op in sorted({r["op"] for r in t.rows() if r["op"]}):
            try:
                bw = large_message_busbw(t, op)
            except ValueError:
                continue
            if bw is None:
                continue
            peak = max((r["busbw_GBps"] for r in t.rows() if r["op"] == op and _finite(r["busbw_GBps"]) is not None),
                       default=None)
            sec = next((m for m in t.meta.get("sections") or [] if m.get("op") == op), {})
            nranks = sec.get("nranks") or sec.get("nranks_inferred") or t.meta.get("nranks")
            factor = bus_factor(op, nranks) if nranks and op in BUS_FACTORS else None
            by_size: dict[float, list[float]] = defaultdict(list)
            for r in t.rows():
                if r["op"] != op or not _finite(r["size_bytes"]):
                    continue
                # From size and time where the bus factor is known: the printed busbw has two decimals, so small
                # messages print 0.00 and a ceiling read there would be 0.
                if factor is not None and _finite(r["time_us"]):
                    by_size[r["size_bytes"]].append(r["size_bytes"] / r["time_us"] / 1e3 * factor)
                elif _finite(r["busbw_GBps"]) is not None:
                    by_size[r["size_bytes"]].append(r["busbw_GBps"])
            curve = [(size, statistics.median(v)) for size, v in sorted(by_size.items())]
            if op not in best or bw > best[op]["busbw_GBps"]:
                best[op] = {"op": op, "busbw_GBps": bw, "peak_busbw_GBps": peak, "nranks": nranks, "curve": curve,
                            "source": t.source}
    return Table.from_rows("nccl_ceilings", CEILING_COLUMNS, [best[k] for k in sorted(best)])


BANDWIDTH_COLUMNS = {
    "collective": "collective type",
    "calls_per_step": "calls per profiled step in trace_analysis.window_steps, mean over ranks (None without "
                      "ProfilerStep annotations)",
    "time_per_step_ms": "time per profiled step with at least one call of the collective running (calls that run "
                        "at once, e.g. on gloo's two worker threads, count once), mean over ranks, ms",
    "calls": "calls counted over all ranks in the window",
    "mean_message_bytes": "mean message size of the calls whose size is known",
    "group_size": "most common group size (see group_size_from)",
    "group_size_from": "recorded, or the hint used",
    "busbw_GBps": "achieved bus bandwidth over all sized calls: sum(bytes x factor) / sum(time)",
    "busbw_large_GBps": "the same over calls of at least 1 MiB (bandwidth-bound sizes); None when there are none",
    "ceiling_GBps": "nccl-tests busbw of the same collective at the same message size: the calls' mean size (those "
                    "of at least 1 MiB where any), interpolated on the sweep (analyze.busbw_at)",
    "ceiling_at_bytes": "the message size the ceiling is read at",
    "ceiling_ranks": "ranks of the nccl-tests run; compare with group_size (the note says when they differ)",
    "pct_of_ceiling": "(busbw_large_GBps, else busbw_GBps) / ceiling_GBps x 100",
    "ceiling_source": "nccl-tests file of the ceiling, or why there is none",
    "ceiling_note": "what makes the comparison weaker: another rank count, a size outside the sweep ('' if none)",
    "basis": "gpu_kernels or the CPU layer counted",
    "source": "trace files",
}


def collective_bandwidth(calls: Table, windows: Mapping[Any, set[int]], ceilings: Table | None, *,
                         no_ceiling_reason: str = "no nccl-tests output (commbench/ or ceiling=)") -> Table:
    """Per collective type over the calls in the profiled window (trace_analysis.window_steps; every call of a rank
    without ProfilerSteps): calls and time per step, achieved busbw, and the nccl-tests ceiling."""
    ceil = {r["op"]: r for r in ceilings.rows()} if ceilings is not None else {}
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in calls.rows():
        w = windows.get(r["rank"])
        if not w or r["step"] in w:  # the profiled window; every call when the rank has no ProfilerStep
            groups[r["collective"]].append(r)
    rows = []
    for coll, rs in sorted(groups.items()):
        per_rank_calls: Counter[Any] = Counter()
        spans: dict[Any, list[tuple[float, float]]] = defaultdict(list)
        for r in rs:
            per_rank_calls[r["rank"]] += 1
            if r["start_us"] is not None and r["dur_us"]:
                spans[r["rank"]].append((r["start_us"], r["start_us"] + r["dur_us"]))
        per_rank_time = {k: ta.covered_us(v) for k, v in spans.items()}
        cps = [per_rank_calls[k] / len(w) for k, w in windows.items() if w]
        tps = [per_rank_time.get(k, 0.0) / len(w) / 1e3 for k, w in windows.items() if w]
        sized = [r for r in rs if r["busbw_GBps"] is not None]
        large = [r for r in sized if r["message_bytes"] >= LARGE_MESSAGE_BYTES]

        def achieved(rows_: list[dict[str, Any]]) -> float | None:
            t = sum(r["dur_us"] for r in rows_)
            return sum(r["busbw_GBps"] * r["dur_us"] for r in rows_) / t if rows_ and t else None

        sizes = Counter(r["group_size"] for r in rs if r["group_size"])
        n = sizes.most_common(1)[0][0] if sizes else None
        n_from = next((r["group_size_from"] for r in rs if r["group_size"] == n), "unknown")
        bw, bw_large = achieved(sized), achieved(large)
        op = NCCL_TESTS_OP.get(coll)
        c = ceil.get(op) if op else None
        chosen = bw_large if bw_large is not None else bw
        msgs = [r["message_bytes"] for r in rs if r["message_bytes"] is not None]
        at = statistics.fmean(r["message_bytes"] for r in (large or sized)) if (large or sized) else None
        ceiling = busbw_at(c["curve"], at) if c and at is not None else None
        notes = []
        if c and n and c["nranks"] and c["nranks"] != n:
            notes.append(f"the sweep ran on {c['nranks']} ranks, these calls on {n}")
        if c and at is not None and c["curve"] and not c["curve"][0][0] <= at <= c["curve"][-1][0]:
            notes.append(f"{at:,.0f} B is outside the sweep ({c['curve'][0][0]:,.0f}–{c['curve'][-1][0]:,.0f} B): "
                         "its nearest end is used")
        rows.append({"collective": coll, "calls_per_step": statistics.fmean(cps) if cps else None,
                     "time_per_step_ms": statistics.fmean(tps) if tps else None, "calls": len(rs),
                     "mean_message_bytes": statistics.fmean(msgs) if msgs else None, "group_size": n,
                     "group_size_from": n_from, "busbw_GBps": bw, "busbw_large_GBps": bw_large,
                     "ceiling_GBps": ceiling, "ceiling_at_bytes": at if c else None,
                     "ceiling_ranks": c["nranks"] if c else None,
                     "pct_of_ceiling": 100.0 * chosen / ceiling if ceiling and chosen is not None else None,
                     "ceiling_source": c["source"] if c else (f"no {op} in the nccl-tests output" if ceil and op
                                                              else no_ceiling_reason),
                     "ceiling_note": "; ".join(notes),
                     "basis": ", ".join(sorted({r["layer"] for r in rs if r["layer"]})),
                     "source": ", ".join(sorted({r["source"] for r in rs}))})
    return Table.from_rows("collective_bandwidth", BANDWIDTH_COLUMNS, rows, source=calls.source)


# -------------------------------------------------------------------- collectives vs the layout

EXPECTED_COLUMNS = {
    "collective": "collective type",
    "min_per_step": "calls per step one rank makes on the pipeline stage with the fewest (launch.plan.collectives.communication)",
    "max_per_step": "calls per step on the stage with the most, each data-parallel gradient reduction counted under "
                    "either name (it runs as all-reduce or reduce-scatter by implementation and backend)",
    "layers": "transformer layers on one rank (num_layers / pp)",
    "why": "the planner's account of the calls (first pipeline stage)",
}


def _gradient_reduction(c: Any) -> bool:
    return c.parallelism == "dp" and c.collective in REDUCTIONS and not c.after_step


def expected_collectives(layout: Any) -> Table:
    """Collectives one optimizer step needs on one rank, per collective type: the planner's own model
    (launch.plan.collectives.communication, per pipeline stage), so that what the plan times and what the report
    compares the traces with cannot drift apart. The observed count is a mean over ranks, so the range spans
    the stages (the embedding is on the first, the output layer and the loss on the last); a data-parallel
    gradient reduction counts under either name (DeepSpeed's ZeRO-2 reduce-scatters on NCCL, all-reduces on gloo)."""
    # the planner's imports cost a doctor run 50 ms
    from launch.plan.collectives import communication
    from launch.plan.memory import stage_params

    g = layout.grid
    stages = [communication(layout, stage=s) for s in range(g.pp)]
    fixed = [Counter() for _ in stages]
    either = [0 for _ in stages]
    for s, comms in enumerate(stages):
        for c in comms:
            if _gradient_reduction(c):
                either[s] += c.calls_per_step
            else:
                fixed[s][c.collective] += c.calls_per_step
    why: dict[str, list[str]] = defaultdict(list)
    for c in stages[0]:
        names = " or ".join(REDUCTIONS) if _gradient_reduction(c) else c.collective
        for coll in REDUCTIONS if _gradient_reduction(c) else (c.collective,):
            why[coll].append(f"{c.parallelism.upper()}: {c.calls_per_step} {names} ({c.note})")
    colls = sorted(set().union(*fixed) | (set(REDUCTIONS) if any(either) else set()))
    _, layers = stage_params(layout, 0)
    rows = [{"collective": coll, "min_per_step": min(f[coll] for f in fixed),
             "max_per_step": max(f[coll] + (e if coll in REDUCTIONS else 0) for f, e in zip(fixed, either, strict=True)),
             "layers": layers, "why": "; ".join(why.get(coll, []))} for coll in colls]
    return Table.from_rows("expected_collectives", EXPECTED_COLUMNS, rows,
                           meta={"micro_batches": layout.grad_accum, "layers": layers})


def expected_from_resolved(resolved: Any) -> Table:
    """expected_collectives for a launch.config.resolve.Resolved layout."""
    from launch.plan.layout import Layout

    return expected_collectives(Layout.from_resolved(resolved))


VS_LAYOUT_COLUMNS = {
    "collective": "collective type",
    "observed_per_step": "calls per profiled step in the trace, mean over ranks",
    "expected_min_per_step": "the layout's minimum (expected_collectives)",
    "expected_max_per_step": "the most the layout and its implementation explain",
    "layers": "transformer layers per rank",
    "observed_per_layer": "observed_per_step / layers",
    "excess_per_layer": "(observed_per_step - expected_max_per_step) / layers when positive, else 0",
    "why": "how the expectation follows from the layout",
    "source": "trace files (observed) and resolved.json (expected)",
}


def collectives_vs_layout(bandwidth: Table, expected: Table, *, expected_source: str = "resolved.json") -> Table:
    """Observed calls per step against the layout's expectation, per collective type."""
    obs = {r["collective"]: r for r in bandwidth.rows()}
    exp = {r["collective"]: r for r in expected.rows()}
    layers = next(iter(exp.values()))["layers"] if exp else None
    rows = []
    for coll in sorted(set(obs) | set(exp)):
        o, e = obs.get(coll), exp.get(coll)
        per_step = o["calls_per_step"] if o else 0.0
        hi = e["max_per_step"] if e else 0
        excess = max(0.0, (per_step - hi) / layers) if per_step is not None and layers else None
        rows.append({"collective": coll, "observed_per_step": per_step,
                     "expected_min_per_step": e["min_per_step"] if e else 0, "expected_max_per_step": hi,
                     "layers": layers, "observed_per_layer": per_step / layers if per_step is not None and layers else None,
                     "excess_per_layer": excess, "why": e["why"] if e else "not needed by the layout",
                     "source": f"{o['source'] if o else 'no calls in the traces'} vs {expected_source}"})
    return Table.from_rows("collectives_vs_layout", VS_LAYOUT_COLUMNS, rows, source=bandwidth.source,
                           meta=dict(expected.meta))


# ------------------------------------------------------------------------- framework timers (logs)

TIMER_COLUMNS = {
    "name": "timer name as the framework prints it",
    "category": "compute, communication, optimizer, data, pipeline or other (by name)",
    "mean_ms": "mean over the measured steps (Megatron: its per-interval averages; DeepSpeed: per step), ms",
    "max_ms": "largest value in the measured steps, ms",
    "samples": "records averaged",
    "source": "log file",
}
_TIMER_CATEGORIES = (
    ("communication", re.compile(r"all[-_ ]?reduce|all[-_ ]?gather|reduce[-_ ]?scatter|allreduce|allgather|"
                                 r"all[-_]?to[-_]?all|broadcast|comm", re.I)),
    ("pipeline", re.compile(r"send|recv|pipe_", re.I)),
    ("optimizer", re.compile(r"optimizer|^step|step_microstep|grad[-_]norm|copy[-_]to[-_]main|unscale", re.I)),
    ("data", re.compile(r"batch[-_ ]?generator|batch_input|data|iterator", re.I)),
    ("compute", re.compile(r"forward|backward|fwd|bwd", re.I)),
)


def timer_category(name: str) -> str:
    for cat, rx in _TIMER_CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


@dataclass(frozen=True)
class Progression:
    """How a framework log counts its progress: the column, the record kinds that carry it, whether each rank
    counts on its own, and the column of a global batch size that marks another run when it changes."""

    column: str
    kinds: frozenset[str]
    per_rank: bool
    batch_column: str | None


# By log table name (the parsers' Table.name). A log kind missing here has no run boundaries to find.
PROGRESSIONS = {
    "megatron_log": Progression("iteration", frozenset({"iteration"}), False, "global_batch_size"),
    "deepspeed_log": Progression("step", frozenset({"step", "pipe_step"}), True, None),
}


def run_boundaries(log: Table) -> list[str]:
    """Where one framework log holds more than one run (a restarted job, an appended experiment): the step or
    iteration number falls back (per rank where the log counts per rank), or the global batch size changes (a
    batch-size ramp-up does that too). One line each, naming both records; empty when the log reads as one run."""
    spec = PROGRESSIONS.get(log.name)
    if spec is None:
        return []
    col = spec.column
    out: list[str] = []
    prev: dict[Any, Mapping[str, Any]] = {}
    for r in log.rows():
        if r["kind"] not in spec.kinds or not isinstance(r[col], int):
            continue
        key = (r["rank"], r["kind"]) if spec.per_rank else None
        p = prev.get(key)
        if p is not None:
            if r[col] <= p[col]:
                out.append(f"{log.source}:{r['line']}: {col} {r[col]} after {col} {p[col]} (line {p['line']}): "
                           "a restarted or appended run; the figures of this file pool both")
            elif spec.batch_column and r[spec.batch_column] and p[spec.batch_column] \
                    and r[spec.batch_column] != p[spec.batch_column]:
                out.append(f"{log.source}:{r['line']}: global batch size {r[spec.batch_column]} after "
                           f"{p[spec.batch_column]} (line {p['line']}): another run, or a batch-size ramp-up")
        prev[key] = r
    return out


def framework_timers(log: Table, measured_steps: Iterable[int] | None = None) -> Table:
    """Mean of each Megatron or DeepSpeed timer over the measured steps (all timed steps when none given)."""
    kept = set(measured_steps) if measured_steps is not None else None
    step_col = "iteration" if "iteration" in log.columns else "step"
    values: dict[str, list[float]] = defaultdict(list)
    for r in log.rows():
        if r["kind"] != "timer" or r["name"] is None or _finite(r["time_ms"]) is None:
            continue
        s = r[step_col]
        if s is None or (kept is not None and s not in kept):
            continue
        values[r["name"]].append(r["time_ms"])
    rows = [{"name": n, "category": timer_category(n), "mean_ms": statistics.fmean(v), "max_ms": max(v),
             "samples": len(v), "source": log.source} for n, v in values.items()]
    rows.sort(key=lambda r: -r["mean_ms"])
    return Table.from_rows("framework_timers", TIMER_COLUMNS, rows, source=log.source)


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
    d = ta.kernel_diff(a, b, normalize="per_step")
    rows = list(d.rows())[:top]
    return Table.from_rows("kernel_diff", d.doc, rows, source=d.source, meta=dict(d.meta))
