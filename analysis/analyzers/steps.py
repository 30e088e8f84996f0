"""Steps (how fast): each source's step records as one per-step table, and their statistics.

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

`run_boundaries` says where one framework log holds more than one run (the step count falls back).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

from analysis.analyzers._numbers import finite
from analysis.table import Table

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


class MegatronStepsMeta(NamedTuple):
    """Table.meta of steps_from_megatron's `steps` table (steps_from_metrics passes the metrics' MetricsMeta on)."""

    layout: dict[str, Any]  # the log's layout (analysis.parsers.megatron_log.MegatronLogMeta.layout)


class StepStatisticsMeta(NamedTuple):
    """Table.meta of step_statistics."""

    measured_steps: list[int]  # the steps of the measured window, in order
    step_times_s: list[float]  # their step times (each step's slowest rank), seconds


def steps_from_metrics(metrics: Table) -> Table:
    """Our metrics table (analysis.parsers.metrics) as STEP_COLUMNS rows."""
    rows = [{"rank": r["rank"], "step": r["step"], "step_time_s": finite(r["step_time_s"]),
             "tokens_per_s_per_device": finite(r["tokens_per_s_per_device"]),
             "tflops_per_device": finite(r["tflops_per_device"]), "mfu": finite(r["mfu"]), "warmup": r["warmup"],
             "step_source": "metrics step_time_s", "source": f"{r['file']}:{r['line']}"} for r in metrics.rows()]
    return Table.from_rows("steps", STEP_COLUMNS, rows, source=metrics.source, warnings=metrics.warnings,
                           meta=metrics.meta)


def steps_from_megatron(log: Table, *, peak_flops: float | None = None) -> Table:
    """Megatron iteration lines as STEP_COLUMNS rows (each line is the average of its logging interval).

    tokens/s/device: the printed `tokens per gpu per second (tgs)` when present, else global batch ×
    sequence length / step time / world size from the arguments dump; MFU: printed TFLOP/s/GPU ÷ peak.
    """
    layout = log.meta.layout or {}
    world = layout.get("world_size")
    seq = layout.get("seq_length")
    rows = []
    for r in log.rows():
        if r["kind"] != "iteration":
            continue
        t = finite(r["elapsed_ms_per_iteration"])
        t = t / 1000.0 if t else None
        tps = finite(r["tokens_per_s_per_gpu"])
        s = r["seq_length"] or seq
        if tps is None and t and r["global_batch_size"] and s and world:
            tps = r["global_batch_size"] * s / t / world
        tflops = finite(r["throughput_tflops_per_gpu"])
        rows.append({"rank": None, "step": r["iteration"], "step_time_s": t, "tokens_per_s_per_device": tps,
                     "tflops_per_device": tflops,
                     "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
                     "warmup": None, "step_source": "Megatron 'elapsed time per iteration (ms)'",
                     "source": f"{log.source}:{r['line']}"})
    return Table.from_rows("steps", STEP_COLUMNS, rows, source=log.source, warnings=log.warnings,
                           meta=MegatronStepsMeta(layout=layout))


def steps_from_deepspeed(log: Table) -> Table:
    """DeepSpeed's own lines as STEP_COLUMNS rows.

    Step time, first source present: the pipeline engine's `iter time (s)`; the time between
    consecutive `step=` lines' logging timestamps divided by the steps between them (wall clock,
    everything included); the sum of the global fwd/bwd/step timers (forward/backward/step before
    2023), which leaves out data loading and anything outside the engine.
    """
    rows_all = list(log.rows())
    out: list[dict[str, Any]] = []
    pipe = [r for r in rows_all if r["kind"] == "pipe_step" and finite(r["iter_time_s"])]
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
                        and r["step"] is not None and finite(r["time_ms"]) is not None:
                    key = (r["rank"], r["step"])
                    acc = sums.setdefault(key, [0.0, r])
                    acc[0] += r["time_ms"] / 1000.0
            for (rank, step), (total, r) in sorted(sums.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
                out.append(_ds_row(step, total, "sum of DeepSpeed fwd+bwd+step timers" + (
                    f"; steps: {log.meta.steps_from}" if log.meta.steps_from else ""), log, r, rank))
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
        if scale is None or finite(r["value"]) is None:
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
                           meta=StepStatisticsMeta(measured_steps=sorted(per_step), step_times_s=times))


def measured_step_times(steps: Table, stats: Table) -> list[tuple[int, float, str]]:
    """(step, seconds, source) of the measured window, in step order (for plots and the doctor)."""
    kept = set(stats.meta.measured_steps)
    best: dict[int, dict[str, Any]] = {}
    for r in steps.rows():
        if r["step"] in kept and r["step_time_s"] is not None:
            if r["step"] not in best or r["step_time_s"] > best[r["step"]]["step_time_s"]:
                best[r["step"]] = r
    return [(s, best[s]["step_time_s"], best[s]["source"]) for s in sorted(best)]


# ---------------------------------------------------------------------------------- run boundaries (logs)

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


