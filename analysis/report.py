"""One comparative report for N runs: compute everything first (`build_report`), then render it as
Markdown (`render_markdown`) or one self-contained HTML file (`render_html`).

Sections: runs and their files (used, skipped with the reason, warnings), the doctor's findings,
how fast (step time, tokens/s/GPU, MFU), memory per rank against the plan, where the time went
(compute, each collective's exposed time, other, idle; overlap), collectives (calls per step,
achieved bus bandwidth against the nccl-tests ceiling, counts against the layout), stragglers, a
kernel-level diff of the first two runs with GPU traces, prediction against measurement, and the
definitions used. Every table carries a `source` column naming the file (and line) each number
came from; strings read from logs and traces are escaped in both formats.
"""
from __future__ import annotations

import base64
import html
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from analysis import analyze as A
from analysis import doctor as D
from analysis import trace_analysis as ta
from analysis.collectives import NCCL_TESTS_OP, REDUCTIONS, group_size_hint
from analysis.parsers.nccl_tests import parse_nccl_tests
from analysis.recognize import group_runs, recognize
from analysis.runs import Run, load_run
from analysis import comm_tables as CT
from analysis import curves as C
from analysis.table import Table

MAX_WARNINGS_SHOWN = 30


# ============================================================================ computing


@dataclass
class RunResult:
    run: Run
    layout: dict[str, Any]
    steps: Table | None = None
    stats: Table | None = None
    step_times: list[tuple[int, float, str]] = field(default_factory=list)
    memory: Table | None = None
    breakdown: Table | None = None
    exposed: Table | None = None
    calls: Table | None = None
    bandwidth: Table | None = None
    ceilings: Table | None = None
    ceiling_curves: list[tuple[str, str, list[tuple[float, float]]]] = field(default_factory=list)
    vs_layout: Table | None = None
    stragglers: Table | None = None
    timers: list[Table] = field(default_factory=list)
    nsys_totals: list[Table] = field(default_factory=list)
    prediction: list[dict[str, Any]] = field(default_factory=list)
    curves: Table | None = None  # loss, grad norm, lr, loss scale per step (analysis.curves)
    validation: list[C.ValidationPoint] = field(default_factory=list)
    boundaries: list[str] = field(default_factory=list)  # where a log holds several runs (analyze.run_boundaries)
    nccl_rows: list[Table] = field(default_factory=list)  # each nccl-tests file, per size (analysis.comm_tables)
    transports: list[Table] = field(default_factory=list)  # each NCCL_DEBUG log, per rank pair
    kernel_types: Table | None = None  # HTA's kernel-type breakdown, per rank (GPU traces)
    notes: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # logs whose steps, memory or layout another log gave

    @property
    def label(self) -> str:
        return self.run.label


@dataclass(frozen=True)
class CurvePair:
    """The loss curve of `other` against that of `first` (the report's first run with a curve)."""

    first: str
    other: str
    not_comparable: str  # why the curves need not agree ('' : same global batch and sequence length)
    comparison: C.CurveComparison
    sources: str  # the two curves' files


@dataclass
class Report:
    runs: list[RunResult]
    findings: list[D.Finding]
    kernel_diff: Table | None
    kernel_diff_note: str
    inputs_missing: list[str]
    ceiling_note: str
    curve_pairs: list[CurvePair] = field(default_factory=list)


def parse_ceiling(path: str | os.PathLike[str]) -> list[Table]:
    """nccl-tests tables from a file or a folder (files chosen by content)."""
    inv = recognize(path)
    return [t for t in (parse_nccl_tests(f.path) for f in inv.files if "nccl_tests" in f.kinds) if len(t)]


def _dtype(text: Any) -> str | None:
    if not text:
        return None
    t = str(text).lower()
    for key, name in (("bfloat16", "bf16"), ("bf16", "bf16"), ("float16", "fp16"), ("half", "fp16"),
                      ("fp16", "fp16"), ("float32", "fp32"), ("fp32", "fp32")):
        if key in t:
            return name
    return None


def layout_of(run: Run) -> dict[str, Any]:
    """The run's layout facts and where they came from (resolved.json, metrics meta, or the logs)."""
    keys = ("backend", "tp", "pp", "dp", "zero_stage", "sp", "micro_batch_size", "global_batch_size", "seq_len",
            "dtype", "world", "hardware")
    out: dict[str, Any] = dict.fromkeys(keys)
    out["source"] = None
    if run.resolved is not None:
        rc, g = run.resolved.recipe, run.resolved.grid
        out.update(backend=rc.backend, tp=g.tp, pp=g.pp, dp=g.dp, zero_stage=rc.parallel.zero_stage,
                   sp=rc.parallel.sp, micro_batch_size=rc.batch.micro_batch_size,
                   global_batch_size=rc.batch.global_batch_size, seq_len=rc.batch.seq_len, dtype=rc.precision.dtype,
                   world=g.world, hardware=run.resolved.hardware.name, source=run.resolved_source)
        return out
    if run.metrics is not None and run.metrics.meta.get("ranks"):
        m = run.metrics.meta
        out.update(backend=m.get("backend"), tp=m.get("tp"), pp=m.get("pp"), dp=m.get("dp"),
                   zero_stage=m.get("zero_stage"), micro_batch_size=m.get("micro_batch_size"),
                   global_batch_size=m.get("global_batch_size"), seq_len=m.get("seq_len"), dtype=m.get("dtype"),
                   world=m.get("world"), hardware=m.get("hardware_profile"),
                   source=f"meta record of {m['files'][0]}" if m.get("files") else "metrics meta")
        return out
    for log in _megatron_first(run):
        if _layout_records(log):
            lay = log.meta.get("layout") or {}
            iters = [r for r in log.rows() if r["kind"] == "iteration"]
            gbs = lay.get("global_batch_size") or next((r["global_batch_size"] for r in iters if r["global_batch_size"]),
                                                       None)
            seq = lay.get("seq_length") or next((r["seq_length"] for r in iters if r["seq_length"]), None)
            out.update(backend="megatron", tp=lay.get("tp"), pp=lay.get("pp"), dp=lay.get("dp"),
                       zero_stage=lay.get("zero_stage"), sp=lay.get("sp"),
                       micro_batch_size=lay.get("micro_batch_size"), global_batch_size=gbs, seq_len=seq,
                       dtype=_dtype(lay.get("params_dtype")), world=lay.get("world_size"), source=log.source)
            break
    if out["source"] is None:
        for log in run.deepspeed:
            prof = _layout_records(log)
            if prof:
                p = prof[0]
                out.update(backend="deepspeed", dp=p["dp"], world=p["world_size"],
                           micro_batch_size=p["micro_batch_size"], source=f"{log.source}:{p['line']}")
                break
    if out["world"] is None and run.trace is not None:
        out["world"] = run.trace.meta.get("world_size")
        if out["source"] is None and out["world"]:
            out["source"] = "trace distributedInfo"
    if run.hardware is not None:
        out["hardware"] = run.hardware.name
    return out


def _megatron_first(run: Run) -> list[Table]:
    """The run's Megatron logs, those with the arguments dump first: such a log states the layout
    (iteration lines give only batch and sequence), so layout, steps and memory come from one log
    when it has them all."""
    return sorted(run.megatron, key=lambda t: not t.meta.get("layout"))


def _layout_records(log: Table) -> list[Any]:
    """What a log tells of the layout: Megatron's arguments dump or iteration lines, DeepSpeed's Flops
    Profiler summaries; empty when it tells nothing."""
    if log.name == "megatron_log":
        return [log.meta["layout"]] if log.meta.get("layout") else [r for r in log.rows() if r["kind"] == "iteration"]
    return [r for r in log.rows() if r["kind"] == "flops_profile"]


def _steps(run: Run, layout: dict[str, Any]) -> tuple[Table | None, str, str]:
    """(steps table, MFU formula, where the warm-up count came from) from the best source present."""
    if run.metrics is not None and len(run.metrics):
        m = run.metrics.meta
        first = m["files"][0] if m.get("files") else "metrics"
        peak, fpt = m.get("peak_flops_per_device"), m.get("flops_per_token")
        formula = (f"MFU = tokens/s/device x {fpt:,.0f} FLOP/token / {peak / 1e12:g} TFLOP/s ({m.get('hardware_profile')} "
                   f"{m.get('dtype')} peak, meta of {first}); FLOP/token: {m.get('flops_formula')}"
                   if peak and fpt else "unknown: the meta record lacks flops_per_token or the peak")
        return A.steps_from_metrics(run.metrics), formula, f"meta of {first}: warmup_steps={m.get('warmup_steps')}"
    peak, dtype_note = None, ""
    if run.hardware is not None:
        dtype = layout.get("dtype")
        if dtype is None:
            dtype, dtype_note = "bf16", "; the log names no dtype, bf16 assumed"
        peak = run.hardware.peak_flops(dtype)
    for log in _megatron_first(run):
        t = A.steps_from_megatron(log, peak_flops=peak)
        if _timed(t):
            if peak:
                formula = (f"MFU = the log's TFLOP/s/GPU / {peak / 1e12:g} TFLOP/s ({run.hardware.name} "
                           f"{layout.get('dtype') or 'bf16'} peak, {run.hardware_source}{dtype_note}); the TFLOP count "
                           f"is Megatron's own (it may include recomputation)")
            else:
                formula = ("unknown: the peak FLOP/s is not known for a foreign log; pass hardware=PROFILE "
                           "(and the log must print TFLOP/s/GPU)")
            return t, formula, ""
    for log in run.deepspeed:
        t = A.steps_from_deepspeed(log)
        if _timed(t):
            return t, "unknown: DeepSpeed's step lines carry no FLOP count", ""
    for tb in run.tensorboard:
        t = A.steps_from_tensorboard(tb)
        if _timed(t):
            return t, "unknown: TensorBoard step times carry no FLOP count", ""
    return None, "", ""


def _timed(steps: Table) -> bool:
    """Whether a steps table holds a step with a time (iteration lines without one measure nothing)."""
    return any(s is not None and t is not None for s, t in zip(steps.columns["step"], steps.columns["step_time_s"]))


def _unused_logs(run: Run, res: RunResult) -> list[str]:
    """Logs that hold steps, memory reports or a layout the report took from another log of the same run.

    A folder of foreign files is one run and each of these comes from one log, so the others are named
    rather than dropped silently (our runs take all three from resolved.json and metrics/)."""
    logs = [*run.megatron, *run.deepspeed, *run.tensorboard]
    if run.metrics is not None and len(run.metrics) or len({t.source for t in logs}) < 2:
        return []
    has = {
        "steps": (res.steps.source if res.steps is not None else None,
                  lambda t: _timed(_STEPS_FROM[t.name](t))),
        "memory": (res.memory.source if res.memory is not None else None,
                   lambda t: t.name != "tensorboard" and len(_MEMORY_FROM[t.name](t)) > 0),
        "layout": (res.layout.get("source") if run.resolved is None else None,
                   lambda t: t.name != "tensorboard" and bool(_layout_records(t))),
    }
    out = []
    for what, (used, holds) in has.items():
        chosen = next((t.source for t in logs if used is not None
                       and (used == t.source or used.startswith(t.source + ":"))), None)
        if chosen is None:
            continue
        others = sorted({t.source for t in logs if t.source != chosen and holds(t)})
        if others:
            out.append(f"{what} from {chosen}; not used for {what}: {', '.join(others)} (a folder of foreign files "
                       f"is one run and takes its {what} from one log; pass a log as its own PATH to report it as a "
                       f"run)")
    return out


_STEPS_FROM: dict[str, Callable[[Table], Table]] = {
    "megatron_log": A.steps_from_megatron, "deepspeed_log": A.steps_from_deepspeed,
    "tensorboard": A.steps_from_tensorboard}
_MEMORY_FROM: dict[str, Callable[[Table], Table]] = {
    "megatron_log": A.memory_from_megatron, "deepspeed_log": A.memory_from_deepspeed}


def _memory(run: Run, device_memory_bytes: int | None) -> Table | None:
    mem = None
    if run.metrics is not None and len(run.metrics):
        mem = A.memory_from_metrics(run.metrics)
    else:
        for log in [*_megatron_first(run), *run.deepspeed]:
            t = _MEMORY_FROM[log.name](log)
            if len(t):
                mem = t
                break
    if mem is None:
        return None
    dev, dev_src = device_memory_bytes, "given (device_memory_gib=)" if device_memory_bytes else ""
    if dev is None and run.hardware is not None and run.plan is None:
        dev, dev_src = run.hardware.memory_bytes, run.hardware_source or run.hardware.name
    reason = "none (foreign run: no plan)" if not run.run_dir else "none (no plan.json and no readable resolved.json)"
    return A.memory_vs_plan(mem, run.plan, plan_source=run.plan_source or "", device_memory_bytes=dev,
                            device_source=dev_src, no_plan_reason=reason)


def _prediction(run: Run, res: RunResult) -> list[dict[str, Any]]:
    plan = run.plan
    if plan is None:
        return []
    rows = []
    st = next(res.stats.rows()) if res.stats is not None and len(res.stats) else None
    src_m = res.stats.source if res.stats is not None else ""

    def add(q: str, pred: float | None, meas: float | None, unit: str, ms: str, missing: str = "") -> None:
        rows.append({"quantity": q, "predicted": pred, "measured": meas, "unit": unit,
                     "measured_over_predicted": meas / pred if pred and meas is not None else None,
                     "missing": missing, "source": f"{run.plan_source} vs {ms}"})

    if st:
        ms = (lambda x: x * 1e3 if x is not None else None)
        add("step time", ms(plan.step.total_s), ms(st.get("step_time_median_s")), "ms", src_m)
        add("tokens/s/device", plan.step.tokens_per_s_per_device, st.get("tokens_per_s_per_device"), "tok/s", src_m)
        add("MFU", plan.step.mfu * 100, st.get("mfu_pct"), "%", src_m)
    if res.memory is not None and len(res.memory):
        worst = max(res.memory.rows(), key=lambda r: r["measured_bytes"])
        add(f"peak memory (rank {worst['rank']}, {worst['measured_what']})", worst["predicted_bytes"],
            worst["measured_bytes"], "bytes", worst["source"])
    if res.bandwidth is not None:
        def group(collective: str) -> str:
            return " + ".join(REDUCTIONS) if collective in REDUCTIONS else collective

        planned: dict[str, float] = defaultdict(float)
        for c in plan.comm:
            planned[group(c.collective)] += c.time_s
        measured: dict[str, float] = defaultdict(float)
        sources: dict[str, set[str]] = defaultdict(set)
        for r in res.bandwidth.rows():
            if r["time_per_step_ms"] is not None:
                measured[group(r["collective"])] += r["time_per_step_ms"]
                sources[group(r["collective"])].add(r["source"])
        for q in sorted(planned):
            add(f"{q} time per step", planned[q] * 1e3, measured.get(q), "ms",
                ", ".join(sorted(sources[q])) or res.bandwidth.source, "" if q in measured else "not observed")
    return rows


def _ceiling_curves(tables: Sequence[Table]) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(op, file, [(size, busbw)]) per collective of each nccl-tests table (comm_plot's best-of-placements
    series)."""
    from analysis.comm_plot import busbw_series

    out = []
    for t in tables:
        for op in sorted({r["op"] for r in t.rows() if r["op"]}):
            sizes, bw = busbw_series(t, op)
            if sizes:
                out.append((op, t.source, list(zip(sizes, bw))))
    return out


def analyze_run(run: Run, *, ceilings: Sequence[Table] | None = None, ceiling_source: str = "",
                device_memory_bytes: int | None = None) -> RunResult:
    """Every analyzer that the run's files allow."""
    layout = layout_of(run)
    res = RunResult(run, layout)
    steps, formula, warm_from = _steps(run, layout)
    if steps is not None:
        res.steps = steps
        res.stats = A.step_statistics(steps, mfu_formula=formula, warmup_from=warm_from)
        res.step_times = A.measured_step_times(steps, res.stats)
    res.memory = _memory(run, device_memory_bytes)
    ceil_tables = list(ceilings) if ceilings is not None else run.nccl_tests
    if ceil_tables:
        res.ceilings = A.nccl_ceilings(ceil_tables)
        res.ceiling_curves = _ceiling_curves(ceil_tables)
    if run.trace is not None and len(run.trace):
        tr = run.trace
        res.breakdown = A.time_breakdown(tr)
        res.exposed = A.exposed_by_collective(tr)
        if _has_gpu(tr):
            res.kernel_types = ta.kernel_type_breakdown(tr)
        res.stragglers = A.stragglers(tr, threshold_pct=D.STRAGGLER_PCT)
        n, n_from = group_size_hint(tr, {k: layout[k] for k in ("tp", "pp", "dp") if layout.get(k)})
        res.calls = A.collective_calls(tr, group_size=n, group_size_from=n_from)
        res.bandwidth = A.collective_bandwidth(
            res.calls, ta.window_steps(tr), res.ceilings,
            no_ceiling_reason=("no nccl-tests output in the run (commbench/) and no ceiling= given"))
        if run.resolved is not None:
            res.vs_layout = A.collectives_vs_layout(res.bandwidth, A.expected_from_resolved(run.resolved),
                                                    expected_source=run.resolved_source or "resolved.json")
        if run.trace_from == "nsys":
            res.notes.append(f"time breakdown from Nsight Systems exports via analysis.nsys_adapter; ranks: "
                             f"{tr.meta.get('rank_from')}")
            # An nsys rank without GPU activity in the window would fall back to the CPU-op basis, which has
            # no meaning for CUDA API and NVTX rows: leave it out and say so.
            empty = [b["rank"] for b in res.breakdown.rows() if b["basis"] == "cpu_ops"]
            if empty:
                res.breakdown = Table.from_rows(res.breakdown.name, res.breakdown.doc,
                                                [b for b in res.breakdown.rows() if b["basis"] != "cpu_ops"],
                                                source=res.breakdown.source)
                res.notes.append(f"rank(s) {', '.join(map(str, empty))}: no GPU activity in the profiled window "
                                 f"of the nsys export; left out of the breakdown")
        if any(r["basis"] == "cpu_ops" for r in res.breakdown.rows()):
            res.notes.append("cpu_ops basis (CPU-only trace): " + _CPU_BASIS)
    measured = set(res.stats.meta.get("measured_steps", [])) if res.stats is not None else None
    for log in [*run.megatron, *run.deepspeed]:
        if any(r["kind"] == "timer" for r in log.rows()):
            own = res.steps is not None and res.steps.source == log.source
            t = A.framework_timers(log, measured if own else None)
            if len(t):
                res.timers.append(t)
    res.nsys_totals = [t for t in (A.nsys_stats_totals(s) for s in run.nsys_stats) if len(t)]
    res.prediction = _prediction(run, res)
    res.curves = _curves(run)
    res.validation = [v for log in run.megatron for v in C.validation_points(log)]
    res.boundaries = [b for log in [*run.megatron, *run.deepspeed] for b in A.run_boundaries(log)]
    res.nccl_rows = [t for t in (CT.nccl_tests_rows(n) for n in run.nccl_tests) if len(t)]
    res.transports = [t for t in (CT.transports(d) for d in run.nccl_debug) if len(t)]
    res.unused = _unused_logs(run, res)
    return res


def _curves(run: Run) -> Table | None:
    """The training curve from the first source that has one: our metrics, Megatron's iteration lines (the log
    with the arguments dump first), TensorBoard, DeepSpeed's own lines."""
    candidates = ([C.curves_from_metrics(run.metrics)] if run.metrics is not None else []) + [
        *(C.curves_from_megatron(log) for log in _megatron_first(run)),
        *(C.curves_from_tensorboard(tb) for tb in run.tensorboard),
        *(C.curves_from_deepspeed(log) for log in run.deepspeed)]
    return next((c for c in candidates if any(v is not None for v in c.columns["loss"])), None)


def curve_pairs(results: Sequence[RunResult]) -> list[CurvePair]:
    with_curve = [r for r in results if r.curves is not None]
    if len(with_curve) < 2:
        return []
    first = with_curve[0]
    return [CurvePair(first.label, r.label, C.comparable(first.layout, r.layout), C.compare(first.curves, r.curves),
                      f"{r.run.relabel(r.curves.source)} vs {first.run.relabel(first.curves.source)}")
            for r in with_curve[1:]]


_CPU_BASIS = ("compute = CPU ops on the training thread(s) (those holding the ProfilerStep annotations), less "
              "the time inside collective calls; communication = collective calls (c10d::*, record_param_comms, "
              "nccl:*/gloo:*) on any thread; idle = ProfilerStep window with neither; overlap = communication "
              "time during which the training thread computes (analysis.trace_analysis)")


def _overlap_allowed(layout: dict[str, Any], run: Run) -> tuple[bool | None, str]:
    if layout.get("dp") is None and layout.get("zero_stage") is None and layout.get("pp") is None:
        return None, "the layout is unknown (foreign trace) and data-parallel communication usually can overlap"
    reasons = []
    if (layout.get("dp") or 1) > 1:
        reasons.append(f"dp={layout['dp']} (gradient reduction can overlap the backward pass)")
    if layout.get("zero_stage") == 3:
        reasons.append("ZeRO-3 (parameter gathers can be prefetched)")
    if (layout.get("pp") or 1) > 1:
        reasons.append(f"pp={layout['pp']} (sends overlap other micro-batches)")
    return (True, " and ".join(reasons)) if reasons else (False, "")


def _expect_net(run: Run) -> str | None:
    hw = run.hardware
    if hw is None:
        return None
    link = (hw.inter_node_link or "").lower()
    return "IB" if "infiniband" in link or "roce" in link or " ib" in link else None


def diagnose(results: Sequence[RunResult]) -> list[D.Finding]:
    """All doctor rules over all runs."""
    out: list[D.Finding] = []
    for r in results:
        out += D.warmup_in_window(r.label, r.step_times, ours=r.run.run_dir)
        out += D.slow_transport(r.label, r.run.nccl_debug, expect_net=_expect_net(r.run))
        out += D.extra_collectives(r.label, r.vs_layout)
        allows, why = _overlap_allowed(r.layout, r.run)
        out += D.no_overlap(r.label, r.breakdown, allows=allows, why=why)
        out += D.straggler(r.label, r.stragglers)
        out += D.idle_device(r.label, r.breakdown)
        out += D.memory_near_limit(r.label, r.memory)
        out += D.low_busbw(r.label, r.bandwidth)
    if len(results) > 1:
        out += D.mismatched_runs([(r.label, r.layout.get("global_batch_size"), r.layout.get("seq_len"),
                                   r.layout.get("source") or "?") for r in results])
    return out


def _has_gpu(trace: Table | None) -> bool:
    return trace is not None and any(s not in (None, -1) for s in trace.columns["stream"])


def build_report(inputs: Sequence[tuple[str | None, str | os.PathLike[str]]], *, ceiling: str | None = None,
                 hardware: Any = None, hardware_source: str = "", device_memory_bytes: int | None = None) -> Report:
    """Recognise, load and analyse every input path (with an optional label each) into one Report."""
    ceilings = parse_ceiling(ceiling) if ceiling else None
    ceiling_note = (f"ceiling: nccl-tests output given as ceiling={ceiling}" if ceiling else
                    "ceiling: each run's own nccl-tests output (commbench/ or nccl-tests files among its files)")
    if ceiling and not ceilings:
        ceiling_note += " (no nccl-tests tables found there)"
    runs: list[Run] = []
    missing = []
    for label, path in inputs:
        if not Path(path).exists():
            missing.append(f"{path}: does not exist")
            continue
        for rf in group_runs(recognize(path), label):
            runs.append(load_run(rf, hardware=hardware, hardware_source=hardware_source))
    seen: dict[str, int] = {}
    for r in runs:  # labels must tell runs apart
        n = seen.get(r.label, 0)
        seen[r.label] = n + 1
        if n:
            r.label = f"{r.label}#{n + 1}"
    results = [analyze_run(r, ceilings=ceilings, device_memory_bytes=device_memory_bytes) for r in runs]
    diff, note = None, "needs two runs whose traces hold GPU kernels"
    gpu_runs = [r for r in results if _has_gpu(r.run.trace)]
    if len(gpu_runs) >= 2:
        a, b = gpu_runs[:2]
        diff = A.kernel_diff(a.run.trace, b.run.trace)
        note = f"{b.label} minus {a.label}, per profiled rank-step (trace_analysis.kernel_diff normalize='per_step')"
    elif gpu_runs:
        note = f"needs two runs whose traces hold GPU kernels; only {gpu_runs[0].label}'s do: no kernel-level diff"
    elif any(r.run.trace is not None for r in results):
        note = "the traces hold no GPU kernels (CPU-only runs): no kernel-level diff"
    return Report(results, diagnose(results), diff, note, missing, ceiling_note, curve_pairs(results))


# ============================================================================ rendering

def nice_bytes(n: Any) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.{digits}g}"
        return f"{x:,.{max(0, digits - len(str(int(abs(x)))))}f}" if abs(x) >= 1 else f"{x:.{digits}g}"
    return str(x)


def _ms(s: Any) -> str:
    return "–" if s is None else f"{s * 1e3:,.1f}"


def _us_ms(us: Any) -> str:
    return "–" if us is None else f"{us / 1e3:,.2f}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{x:.1f}"


@dataclass
class Block:
    """A unit of rendered content: a heading, text, a table or a figure."""

    kind: str  # h2 | h3 | p | table | img | list | details
    text: str = ""
    headers: Sequence[str] = ()
    rows: Sequence[Sequence[str]] = ()
    png: bytes = b""
    items: Sequence[str] = ()


def _runs_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Runs")]
    rows = []
    for r in rep.runs:
        lay = r.layout
        desc = ", ".join(f"{k}={lay[k]}" for k in ("backend", "tp", "pp", "dp", "zero_stage", "sp", "micro_batch_size",
                                                    "global_batch_size", "seq_len", "dtype") if lay.get(k) is not None)
        rows.append([r.label, str(r.run.root), "our run directory" if r.run.run_dir else "foreign files",
                     desc or "unknown", lay.get("hardware") or "unknown",
                     str(len(r.run.files)), str(len(r.run.skipped)), lay.get("source") or "–"])
    out.append(Block("table", headers=["run", "path", "kind", "layout", "hardware", "files used", "skipped", "source"],
                     rows=rows))
    if rep.inputs_missing:
        out.append(Block("list", "Inputs not found", items=rep.inputs_missing))
    for r in rep.runs:
        items = [f"{p} — {', '.join(k)}" for p, k in r.run.files]
        skipped = [f"{p} — skipped: {why}" for p, why in r.run.skipped]
        out.append(Block("details", f"{r.label}: {len(items)} file(s) used, {len(skipped)} skipped",
                         items=items + skipped))
    pooled = [f"{r.label}: {r.run.relabel(b)}" for r in rep.runs for b in r.boundaries]
    if pooled:
        out.append(Block("list", "Several runs in one file (split the file to compare them)", items=pooled))
    unused = [f"{r.label}: {u}" for r in rep.runs for u in r.unused]
    if unused:
        out.append(Block("list", "Logs not used", items=unused))
    warned = [(r.label, r.run.warnings) for r in rep.runs if r.run.warnings]
    if warned:
        out.append(Block("h3", "Warnings (partial inputs)"))
        for label, ws in warned:
            shown = list(ws[:MAX_WARNINGS_SHOWN])
            if len(ws) > MAX_WARNINGS_SHOWN:
                shown.append(f"… {len(ws) - MAX_WARNINGS_SHOWN} more")
            out.append(Block("list", f"{label}: {len(ws)} warning(s)", items=shown))
    return out


def _doctor_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Doctor")]
    if not rep.findings:
        out.append(Block("p", "No rule fired. Rules and thresholds are listed under Definitions."))
        return out
    rows = [[f.run, f.severity, f.rule, f.message, " · ".join(f.evidence), f.fix] for f in rep.findings]
    out.append(Block("table", headers=["run", "severity", "rule", "finding", "evidence (file: numbers)", "fix"],
                     rows=rows))
    return out


def _speed_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "How fast")]
    rows, series = [], []
    for r in rep.runs:
        if r.stats is None or not len(r.stats):
            rows.append([r.label] + ["–"] * 9 + ["no step records (metrics, Megatron or DeepSpeed lines)", "–"])
            continue
        s = next(r.stats.rows())
        p10, p90 = s.get("step_time_p10_s"), s.get("step_time_p90_s")
        rows.append([r.label, _ms(s.get("step_time_median_s")),
                     f"{_ms(p10)}–{_ms(p90)}" if p10 is not None and p90 is not None else "n/a",
                     _ms(s.get("step_time_mean_s")), _pct(s.get("step_time_cv_pct")),
                     _num(s.get("tokens_per_s_per_device")), _num(s.get("tflops_per_device")), _pct(s.get("mfu_pct")),
                     f"{s['steps_measured']} / {s['steps_dropped']}", s["drop_rule"], s["step_source"],
                     r.run.relabel(s["source"])])
        if r.step_times:
            series.append((r.label, [t for _, t, _ in r.step_times]))
    out.append(Block("table", headers=["run", "step time median, ms", "p10–p90, ms", "mean, ms", "CV %",
                                       "tokens/s/GPU", "TFLOP/s/GPU", "MFU %", "steps measured / dropped",
                                       "warm-up rule", "step time from", "source"], rows=rows))
    formulas = [f"{r.label}: {next(r.stats.rows())['mfu_formula']}" for r in rep.runs
                if r.stats is not None and len(r.stats) and next(r.stats.rows())["mfu_formula"]]
    if formulas:
        out.append(Block("list", "MFU formula per run", items=formulas))
    prof = [[r.label, str(p["step"] if p["step"] is not None else "–"), _sci(p["params_per_gpu"]),
             _sci(p["fwd_macs_per_gpu"]), _num(p["fwd_latency_ms"]), _num(p["bwd_latency_ms"]),
             _num(p["step_latency_ms"]), _num(p["iter_latency_ms"]),
             _num(None if p["fwd_bwd_flop_per_s_per_gpu"] is None else p["fwd_bwd_flop_per_s_per_gpu"] / 1e12),
             _num(None if p["flop_per_s_per_gpu"] is None else p["flop_per_s_per_gpu"] / 1e12), _num(p["samples_per_s"]),
             r.run.relabel(f"{log.source}:{p['line']}")]
            for r in rep.runs for log in r.run.deepspeed for p in log.rows() if p["kind"] == "flops_profile"]
    thr = []
    for r in rep.runs:
        for log in r.run.deepspeed:
            rows_ = [x for x in log.rows() if x["kind"] == "throughput" and x["samples_per_s"] is not None]
            if rows_:
                last = rows_[-1]
                thr.append([r.label, str(len(rows_)), _num(last["samples_per_s"]), _num(last["samples_per_s_avg"]),
                            str(last["step"] if last["step"] is not None else "–"),
                            r.run.relabel(f"{log.source}:{last['line']}")])
    if thr:
        out.append(Block("h3", "DeepSpeed's own throughput"))
        out.append(Block("table", headers=["run", "records", "samples/s (last step)", "samples/s (running average)",
                                           "at step", "source"], rows=thr))
    if prof:
        out.append(Block("h3", "DeepSpeed Flops Profiler"))
        out.append(Block("table", headers=["run", "step", "params/GPU", "fwd MACs/GPU", "fwd ms", "bwd ms", "step ms",
                                           "iter ms", "fwd+bwd TFLOP/s/GPU", "iter TFLOP/s/GPU", "samples/s",
                                           "source"], rows=prof))
    if series:
        out.append(Block("img", "Step-time distribution of the measured window (box: quartiles; points: steps). "
                                "Sources: the files in the table's source column.",
                         png=_plot("step_time_distribution", series)))
    return out


def _sci(x: Any) -> str:
    return "–" if x is None else f"{x:.3g}"


def _curve_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Training curves")]
    rows, series = [], []
    for r in rep.runs:
        if r.curves is None:
            rows.append([r.label, "0"] + ["–"] * 5 + ["no loss per step (metrics, Megatron, TensorBoard or DeepSpeed "
                                                      "pipeline lines)"])
            continue
        c = C.summarise(r.curves)
        rows.append([r.label, f"{c.steps} ({c.first_step}–{c.last_step})",
                     f"{_num(c.loss_first, 4)} → {_num(c.loss_last, 4)} (min {_num(c.loss_min, 4)})"
                     + (f"; {c.not_finite} not finite" if c.not_finite else ""),
                     f"{_num(c.grad_norm_last)} (max {_num(c.grad_norm_max)})" if c.grad_norm_last is not None else "–",
                     f"{_sci(c.lr_first)} → {_sci(c.lr_last)} (max {_sci(c.lr_max)})" if c.lr_first is not None else "–",
                     _num(c.loss_scale_last) if c.loss_scale_last is not None else "–",
                     str(c.skipped) if c.skipped is not None else "–", r.run.relabel(r.curves.source) or "–"])
        series.append((r.label, list(r.curves.columns["step"]),
                       {k: list(r.curves.columns[k]) for k in ("loss", "grad_norm", "lr")}))
    out.append(Block("table", headers=["run", "steps logged", "loss first → last", "grad norm last", "lr first → last",
                                       "loss scale last", "skipped iterations", "source"], rows=rows))
    if rep.curve_pairs:
        out.append(Block("h3", "Loss against the first run"))
        out.append(Block("table", headers=["run", "against", "steps compared", "max |Δ loss|", "max |Δ loss| / loss %",
                                           "at step", "mean |Δ loss|", "expected to agree", "source"],
                         rows=[[p.other, p.first, str(p.comparison.common_steps), _sci(p.comparison.max_abs_diff),
                                _sci(None if p.comparison.max_rel_diff is None else 100 * p.comparison.max_rel_diff),
                                str(p.comparison.at_step) if p.comparison.at_step is not None else "–",
                                _sci(p.comparison.mean_abs_diff),
                                "yes: same global batch and sequence length" if not p.not_comparable
                                else f"no: {p.not_comparable}", p.sources] for p in rep.curve_pairs]))
    val = [[r.label, "–" if v.iteration is None else str(v.iteration), v.what or "–", _num(v.loss, 4), _sci(v.ppl),
            r.run.relabel(v.source)] for r in rep.runs for v in r.validation]
    if val:
        out.append(Block("h3", "Validation"))
        out.append(Block("table", headers=["run", "iteration", "set", "loss", "PPL", "source"], rows=val))
    if series:
        out.append(Block("img", "Loss, gradient norm and learning rate per step, every run overlaid. Sources: the "
                                "table's source column.", png=_plot("training_curves", series)))
    return out


def _memory_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Memory")]
    rows, groups = [], []
    dev = None
    for r in rep.runs:
        if r.memory is None or not len(r.memory):
            rows.append([r.label, "–", "–", "no memory records", "–", "–", "–", "–", "–", "–"])
            continue
        ranks = []
        for m in r.memory.rows():
            rows.append([r.label, _num(m["rank"]), nice_bytes(m["measured_bytes"]), m["measured_what"],
                         nice_bytes(m["predicted_bytes"]), _num(m["measured_over_predicted"]),
                         nice_bytes(m["device_memory_bytes"]), _pct(m["pct_of_device"]),
                         r.run.relabel(m["predicted_what"] or "–"), r.run.relabel(m["source"] or "–")])
            ranks.append((_num(m["rank"]), m["measured_bytes"] / 2**30,
                          m["predicted_bytes"] / 2**30 if m["predicted_bytes"] else None))
            dev = dev or m["device_memory_bytes"]
        groups.append((r.label, ranks))
    out.append(Block("table", headers=["run", "rank", "peak", "measured as", "predicted", "measured / predicted",
                                       "device", "% of device", "prediction from", "source"], rows=rows))
    if groups:
        same_dev = len({m["device_memory_bytes"] for r in rep.runs if r.memory is not None
                        for m in r.memory.rows()}) == 1
        out.append(Block("img", "Peak memory per rank (bars) against the planner's prediction (black ticks)"
                                + (" and the device memory (dashed)" if same_dev and dev else ""),
                         png=_plot("memory_per_rank", groups, dev / 2**30 if same_dev and dev else None)))
    return out


def _time_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Where the time went")]
    rows, bars = [], []
    for r in rep.runs:
        if r.breakdown is None:
            continue
        for b in r.breakdown.rows():
            rows.append([r.label, _num(b["rank"]), b["basis"], _us_ms(b["span_us"]), _pct(b["compute_pct"]),
                         _pct(b["exposed_comm_pct"]), _pct(b["other_pct"]), _pct(b["idle_pct"]),
                         _us_ms(b["comm_us"]), _pct(b["overlap_pct"]), r.run.relabel(b["source"])])
        bars.append((r.label, _bar_segments(r)))
    if rows:
        out.append(Block("table", headers=["run", "rank", "basis", "span, ms", "compute %", "exposed comm %",
                                           "other %", "idle %", "comm, ms", "overlap %", "source"], rows=rows))
        out.append(Block("img", "Share of the measured span per run (mean over ranks): compute, each collective's "
                                "exposed time, other non-compute activity, idle. Sources: the trace files above.",
                         png=_plot("time_breakdown_bars", bars)))
        ex_rows = []
        for r in rep.runs:
            if r.exposed is None:
                continue
            for e in r.exposed.rows():
                ex_rows.append([r.label, _num(e["rank"]), e["collective"], e["basis"], _us_ms(e["comm_us"]),
                                _us_ms(e["exposed_us"]), _pct(e["exposed_pct_of_span"]), r.run.relabel(e["source"])])
        if ex_rows:
            out.append(Block("h3", "Exposed communication per collective"))
            out.append(Block("table", headers=["run", "rank", "collective", "basis", "time, ms", "exposed, ms",
                                               "exposed % of span", "source"], rows=ex_rows))
        kt_rows = [[r.label, _num(k["rank"]), k["kernel_type"], f"{k['time_us']:,.0f}", _pct(k["share_pct"]),
                    r.run.relabel(r.kernel_types.source)]
                   for r in rep.runs if r.kernel_types is not None for k in r.kernel_types.rows()]
        if kt_rows:
            out.append(Block("h3", "GPU kernel types (HTA's get_gpu_kernel_breakdown)"))
            out.append(Block("table", headers=["run", "rank", "kernel type", "time, µs", "share of the rank %",
                                               "source"], rows=kt_rows))
        notes = sorted({f"{r.label}: {n}" for r in rep.runs for n in r.notes})
        if notes:
            out.append(Block("list", "Basis of the numbers", items=notes))
    else:
        out.append(Block("p", "No profiler trace (Kineto or nsys export) in any run: no timeline breakdown."))
    for r in rep.runs:
        for t in r.timers:
            out.append(Block("h3", f"{r.label}: framework timers ({r.run.relabel(t.source)})"))
            out.append(Block("table", headers=["timer", "category", "mean, ms", "max, ms", "records", "source"],
                             rows=[[x["name"], x["category"], _num(x["mean_ms"]), _num(x["max_ms"]), _num(x["samples"]),
                                    r.run.relabel(x["source"])] for x in list(t.rows())[:25]]))
        for t in r.nsys_totals:
            out.append(Block("h3", f"{r.label}: GPU time from nsys stats (sums, no timeline)"))
            out.append(Block("table", headers=["kind", "collective", "instances", "total, ms", "share %", "source"],
                             rows=[[x["kind"], x["collective"] or "–", _num(x["instances"]), _num(x["total_ms"]),
                                    _pct(x["share_pct"]), r.run.relabel(x["source"])] for x in t.rows()]))
    return out


def _bar_segments(r: RunResult) -> dict[str, float]:
    rows = list(r.breakdown.rows())
    seg: dict[str, float] = defaultdict(float)
    n = len(rows) or 1
    exposed_by_coll: dict[Any, dict[str, float]] = defaultdict(dict)
    if r.exposed is not None:
        for e in r.exposed.rows():
            exposed_by_coll[e["rank"]][e["collective"]] = e["exposed_pct_of_span"] or 0.0
    for b in rows:
        seg["compute"] += (b["compute_pct"] or 0.0) / n
        total = b["exposed_comm_pct"] or 0.0
        per = exposed_by_coll.get(b["rank"], {})
        s = sum(per.values())
        # Collectives can run at once on different streams: scale their exposed shares to the merged total.
        for coll, v in per.items():
            seg[f"exposed {coll}"] += (v * total / s if s else 0.0) / n
        if not per and total:
            seg["exposed communication"] += total / n
        seg["other"] += (b["other_pct"] or 0.0) / n
        seg["idle"] += (b["idle_pct"] or 0.0) / n
    return dict(seg)


def _collective_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Collectives")]
    rows, points, curves = [], [], {}
    observed_ops = set()
    for r in rep.runs:
        if r.bandwidth is None:
            continue
        for b in r.bandwidth.rows():
            observed_ops.add(NCCL_TESTS_OP.get(b["collective"]))
            rows.append([r.label, b["collective"], _num(b["calls_per_step"]), _num(b["time_per_step_ms"]),
                         nice_bytes(b["mean_message_bytes"]), f"{_num(b['group_size'])} ({b['group_size_from']})",
                         _num(b["busbw_GBps"]), _num(b["busbw_large_GBps"]),
                         _num(b["ceiling_GBps"]) + (f" at {nice_bytes(b['ceiling_at_bytes'])}"
                                                    if b["ceiling_at_bytes"] is not None else ""),
                         _pct(b["pct_of_ceiling"]),
                         r.run.relabel(b["ceiling_source"]) + (f" ({b['ceiling_note']})" if b["ceiling_note"] else ""),
                         b["basis"],
                         r.run.relabel(b["source"])])
        pts = [(c["message_bytes"], c["busbw_GBps"]) for c in r.calls.rows() if c["busbw_GBps"]] if r.calls else []
        if pts:
            points.append((r.label, pts))
    for r in rep.runs:
        for op, src, pts in r.ceiling_curves:
            if op in observed_ops or not observed_ops:
                curves.setdefault((op, src), (f"nccl-tests {op} ({r.run.relabel(src)})", pts))
    if rows:
        out.append(Block("table", headers=["run", "collective", "calls/step", "time/step, ms", "mean message",
                                           "group size", "busbw, GB/s", "busbw ≥1 MiB, GB/s", "nccl-tests ceiling, GB/s",
                                           "% of ceiling", "ceiling source", "counted from", "source"], rows=rows))
    else:
        out.append(Block("p", "No collective calls found (no profiler trace)."))
    out.append(Block("p", rep.ceiling_note + "; ceiling = the sweep's busbw at the calls' mean message size (those "
                                             "of at least 1 MiB where any), interpolated in log size; the ceiling "
                                             "source says when the sweep ran on another rank count. The table below "
                                             "gives each sweep's large-message busbw (median over the top quartile "
                                             "of sizes) for reference."))
    ceil_rows = []
    for r in rep.runs:
        if r.ceilings is not None:
            for c in r.ceilings.rows():
                ceil_rows.append([r.label, c["op"], _num(c["busbw_GBps"]), _num(c["peak_busbw_GBps"]),
                                  _num(c["nranks"]), r.run.relabel(c["source"])])
    if ceil_rows:
        out.append(Block("table", headers=["run", "nccl-tests op", "large-message busbw, GB/s", "peak busbw, GB/s",
                                           "ranks", "source"], rows=ceil_rows))
    if points or curves:
        out.append(Block("img", "Achieved bus bandwidth per call vs message size (points) and the nccl-tests sweeps "
                                "(lines)", png=_plot("busbw_vs_size", points, list(curves.values())[:8])))
    lay_rows = []
    for r in rep.runs:
        if r.vs_layout is None:
            continue
        for v in r.vs_layout.rows():
            lay_rows.append([r.label, v["collective"], _num(v["observed_per_step"]),
                             f"{v['expected_min_per_step']}–{v['expected_max_per_step']}", _num(v["layers"]),
                             _num(v["observed_per_layer"]), _num(v["excess_per_layer"]), v["why"],
                             r.run.relabel(v["source"])])
    out.append(Block("h3", "Collective counts against the layout"))
    if lay_rows:
        out.append(Block("table", headers=["run", "collective", "observed/step", "layout explains/step", "layers",
                                           "observed/layer", "excess/layer", "why", "source"], rows=lay_rows))
    else:
        out.append(Block("p", "No run has both a trace and a resolved layout; foreign runs have no expectation."))
    return out


def _comm_file_blocks(rep: Report) -> list[Block]:
    out = []
    rows = [[r.label, n["op"], f"{n['ranks']} ({n['ranks_from']})" if n["ranks"] is not None else "unknown",
             nice_bytes(n["size_bytes"]), str(n["count"]), str(n["dtype"]), str(n["redop"] or "–"),
             _sci(n["oop_time_us"]), _sci(n["oop_algbw_GBps"]), _sci(n["oop_busbw_GBps"]), _sci(n["ip_time_us"]),
             _sci(n["ip_algbw_GBps"]), _sci(n["ip_busbw_GBps"]), "–" if n["wrong"] is None else str(n["wrong"]),
             r.run.relabel(n["source"])]
            for r in rep.runs for t in r.nccl_rows for n in t.rows()]
    if rows:
        out.append(Block("h3", "nccl-tests per message size"))
        out.append(Block("table", headers=["run", "collective", "ranks", "size", "count", "type", "redop",
                                           "out-of-place µs", "algbw GB/s", "busbw GB/s", "in-place µs",
                                           "algbw GB/s", "busbw GB/s", "#wrong", "source"], rows=rows))
    rows = [[r.label, str(g["comm"] or "–"), f"{g['peer_from']} → {'–' if g['peer_to'] is None else g['peer_to']}",
             str(g["kind"] or "–"), str(g["transport"]), "yes" if g["gdrdma"] else "no", str(g["channels"]),
             str(g["cuda_dev"] or "–"), str(g["hosts"] or "–"), r.run.relabel(g["source"])]
            for r in rep.runs for t in r.transports for g in t.rows()]
    if rows:
        out.append(Block("h3", "Transports (NCCL_DEBUG)"))
        out.append(Block("table", headers=["run", "communicator", "ranks", "kind", "transport", "GPUDirect RDMA",
                                           "channels", "device", "hosts", "source"], rows=rows))
    rows = [[r.label, c["comm_op"], nice_bytes(c["message_bytes"]), str(c["count"]), _num(c["total_latency_ms"]),
             _num(c["avg_latency_ms"]), _sci(c["algbw_gbps"]), _sci(c["busbw_gbps"]),
             r.run.relabel(f"{log.source}:{c['line']}")]
            for r in rep.runs for log in r.run.deepspeed for c in log.rows() if c["kind"] == "comms"]
    if rows:
        out.append(Block("h3", "DeepSpeed comms logger (deepspeed.comm.log_summary)"))
        out.append(Block("table", headers=["run", "operation", "message", "calls", "total, ms", "mean, ms",
                                           "algbw, Gbit/s", "busbw, Gbit/s", "source"], rows=rows))
    return out


def _straggler_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Stragglers")]
    rows = []
    for r in rep.runs:
        if r.stragglers is None:
            continue
        for s in r.stragglers.rows():
            rows.append([r.label, _num(s["rank"]), _num(s["steps"]), _us_ms(s["step_time_us"]),
                         _us_ms(s["comm_time_us"]), _pct(s["step_excess_pct"]), _pct(s["comm_deficit_pct"]),
                         "yes" if s["straggler"] else "no", s["reason"] or "–", r.run.relabel(s["source"])])
    if rows:
        out.append(Block("table", headers=["run", "rank", "steps", "median step, ms", "comm/step, ms", "step excess %",
                                           "comm deficit %", "straggler", "reason", "source"], rows=rows))
        out.append(Block("p", f"Rule (trace_analysis.stragglers, threshold {D.STRAGGLER_PCT:g}%): a rank is compared "
                              f"with the median of the other ranks; slower steps, or less time waiting in collectives "
                              f"than the others (it arrives last), mark it."))
    else:
        out.append(Block("p", "No per-rank traces."))
    return out


def _diff_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Kernel diff"), Block("p", rep.kernel_diff_note)]
    if rep.kernel_diff is not None and len(rep.kernel_diff):
        rows = [[d["name"][:120], d["kind"] or "–", _num(d["count_a"]), _num(d["count_b"]), _num(d["time_a_us"]),
                 _num(d["time_b_us"]), _num(d["time_delta_us"]), _pct(d["time_delta_pct"]), rep.kernel_diff.source]
                for d in rep.kernel_diff.rows()]
        out.append(Block("table", headers=["kernel", "kind", "count a", "count b", "time a, µs", "time b, µs",
                                           "Δ time, µs", "Δ %", "source"], rows=rows))
    return out


def _prediction_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Prediction vs measurement")]
    rows = []
    for r in rep.runs:
        for p in r.prediction:
            fmt = nice_bytes if p["unit"] == "bytes" else _num
            rows.append([r.label, p["quantity"], fmt(p["predicted"]), p["missing"] or fmt(p["measured"]),
                         p["unit"] if p["unit"] != "bytes" else "", _num(p["measured_over_predicted"]),
                         r.run.relabel(p["source"])])
    if rows:
        out.append(Block("table", headers=["run", "quantity", "predicted", "measured", "unit", "measured / predicted",
                                           "source"], rows=rows))
        notes = sorted({f"{r.label}: {r.run.plan.step.assumptions}" for r in rep.runs if r.run.plan is not None})
        out.append(Block("list", "The planner's assumptions", items=notes))
    else:
        out.append(Block("p", "none: no run has a plan (plan.json or resolved.json); foreign runs have none."))
    return out


def _definitions_blocks(rep: Report) -> list[Block]:
    items = [
        "Warm-up: our runs drop the steps the trainer marked warmup=true (train.warmup_steps, from the meta "
        "record); foreign logs drop the first 10% of the logged step range, at least 10 steps, but never more than "
        "half of the records. The count and rule are given per run.",
        "Step time per step: the slowest rank's record (a synchronous step ends when its last rank does).",
        "MFU: model FLOPs per token (6 x non-embedding parameters + 12·L·h·s, torchtitan's count) x tokens/s/GPU / "
        "the hardware profile's dense peak for the dtype; for Megatron logs its own TFLOP/s/GPU / peak.",
        "Time breakdown, gpu_kernels basis: HolisticTraceAnalysis's definitions (temporal breakdown, "
        "comm/comp overlap) on the GPU activity of the profiled steps (the last step dropped when there are "
        "several).",
        "Time breakdown, cpu_ops basis (CPU-only traces): " + _CPU_BASIS + ".",
        "busbw: nccl-tests' bus bandwidth = message bytes / time x factor (all_reduce 2(n-1)/n; all_gather, "
        "reduce_scatter, all_to_all (n-1)/n; broadcast, send/recv 1).",
        *[f"Doctor rule {k}: {v}" for k, v in D.RULES.items()],
    ]
    return [Block("h2", "Definitions"), Block("list", "", items=items)]


def report_blocks(rep: Report) -> list[Block]:
    labels = ", ".join(r.label for r in rep.runs) or "no runs"
    head = [Block("h2", f"{len(rep.runs)} run(s): {labels}")]
    return (head + _runs_blocks(rep) + _doctor_blocks(rep) + _speed_blocks(rep) + _curve_blocks(rep) + _memory_blocks(rep)
            + _time_blocks(rep) + _collective_blocks(rep) + _comm_file_blocks(rep) + _straggler_blocks(rep) + _diff_blocks(rep)
            + _prediction_blocks(rep) + _definitions_blocks(rep))


def _plot(name: str, *args: Any) -> bytes:
    from analysis import report_plots

    fn: Callable[..., bytes] = getattr(report_plots, name)
    return fn(*args)


# ---- Markdown

def _md_cell(text: Any) -> str:
    s = html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ").replace("\r", " ")
    # `$` too: renderers with math (GitHub) would read text between two of them as a formula
    return (s.replace("`", "\\`").replace("*", "\\*").replace("[", "\\[").replace("]", "\\]")
            .replace("$", "\\$"))


def render_markdown(rep: Report, out_path: str | os.PathLike[str]) -> list[Path]:
    """Write the report as Markdown; figures go beside it as PNG files. Returns the files written."""
    out = Path(out_path)
    plots_dir = out.with_name(out.stem + "_plots")
    written = [out]
    lines = ["# layoutlab report", ""]
    n_img = 0
    for b in report_blocks(rep):
        if b.kind in ("h2", "h3"):
            lines += [("## " if b.kind == "h2" else "### ") + _md_cell(b.text), ""]
        elif b.kind == "p":
            lines += [_md_cell(b.text), ""]
        elif b.kind in ("list", "details"):
            if b.text:
                lines += [f"**{_md_cell(b.text)}**", ""]
            lines += [f"- {_md_cell(i)}" for i in b.items] + [""]
        elif b.kind == "table":
            lines.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
            lines.append("|" + "---|" * len(b.headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            lines.append("")
        elif b.kind == "img":
            n_img += 1
            plots_dir.mkdir(parents=True, exist_ok=True)
            f = plots_dir / f"figure{n_img}.png"
            f.write_bytes(b.png)
            written.append(f)
            lines += [f"![{_md_cell(b.text)}]({plots_dir.name}/{f.name})", "", f"*{_md_cell(b.text)}*", ""]
    out.write_text("\n".join(lines))
    return written


# ---- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1400px;
color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.85em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.src{color:#666;font-size:.9em;max-width:28em;word-break:break-all}
tr.warn td{background:#fff6e5}figure{margin:1em 0}figcaption{color:#555;font-size:.85em}
details{margin:.3em 0}summary{cursor:pointer}ul{margin:.3em 0 1em}li{margin:.1em 0}
"""
_NUMERIC = set("0123456789.,–-% ")


def _is_num(cell: str) -> bool:
    return bool(cell) and all(ch in _NUMERIC for ch in cell) or cell.endswith(("GiB", "MiB", "KiB", " B"))


def render_html(rep: Report, out_path: str | os.PathLike[str]) -> list[Path]:
    """Write one self-contained HTML file: inline CSS, figures as base64 PNG, no scripts, no links out."""
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731 - one-letter escaper keeps the markup readable
    parts = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>layoutlab report</title><style>", _CSS, "</style></head><body><h1>layoutlab report</h1>"]
    for b in report_blocks(rep):
        if b.kind in ("h2", "h3"):
            parts.append(f"<{b.kind}>{e(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{e(b.text)}</p>")
        elif b.kind == "list":
            if b.text:
                parts.append(f"<p><strong>{e(b.text)}</strong></p>")
            parts.append("<ul>" + "".join(f"<li>{e(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "details":
            parts.append(f"<details><summary>{e(b.text)}</summary><ul>"
                         + "".join(f"<li>{e(i)}</li>" for i in b.items) + "</ul></details>")
        elif b.kind == "table":
            src_col = len(b.headers) - 1 if b.headers and b.headers[-1] == "source" else -1
            sev_col = list(b.headers).index("severity") if "severity" in b.headers else -1
            rows = []
            for row in b.rows:
                cls = " class='warn'" if sev_col >= 0 and row[sev_col] == "warn" else ""
                cells = []
                for i, c in enumerate(row):
                    c = str(c)
                    kind = " class='src'" if i == src_col else (" class='n'" if _is_num(c) else "")
                    title = f" title='source: {e(row[src_col])}'" if src_col >= 0 and i != src_col else ""
                    cells.append(f"<td{kind}{title}>{e(c)}</td>")
                rows.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
            parts.append("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in b.headers)
                         + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
        elif b.kind == "img":
            data = base64.b64encode(b.png).decode("ascii")
            parts.append(f"<figure><img alt='{e(b.text)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{e(b.text)}</figcaption></figure>")
    parts.append("</body></html>")
    out = Path(out_path)
    out.write_text("".join(parts), encoding="utf-8")
    return [out]


def write_report(rep: Report, outputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Write each output by its suffix: .html/.htm or .md/.markdown."""
    written: list[Path] = []
    for o in outputs:
        suffix = Path(o).suffix.lower()
        Path(o).parent.mkdir(parents=True, exist_ok=True)
        if suffix in (".html", ".htm"):
            written += render_html(rep, o)
        elif suffix in (".md", ".markdown"):
            written += render_markdown(rep, o)
        else:
            raise ValueError(f"-o {o}: the suffix decides the format; use .html or .md")
    return written
