"""The report's data: every run analysed and the findings across runs (`build_report` -> `Report`), computed before
anything is rendered (analysis.report.sections turns it into blocks, analysis.report.render writes them)."""
from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from analysis.analyzers import comm_tables as CT
from analysis.analyzers import curves as C
from analysis.analyzers import doctor as D
from analysis.analyzers.breakdown import kernel_totals_diff, nsys_stats_totals
from analysis.analyzers.ceilings import ceiling_curves, nccl_ceilings
from analysis.analyzers.collective_calls import collectives_vs_layout, expected_from_resolved
from analysis.analyzers.collectives import REDUCTIONS
from analysis.analyzers.distributions import rank_distributions
from analysis.analyzers.memory import memory_from_deepspeed, memory_from_megatron, memory_from_metrics, memory_vs_plan
from analysis.analyzers.rank_traces import TraceSet, of_table, read_traces
from analysis.analyzers.run_layout import RunLayout
from analysis.analyzers.steps import (
    measured_step_times,
    run_boundaries,
    step_statistics,
    steps_from_deepspeed,
    steps_from_megatron,
    steps_from_metrics,
    steps_from_tensorboard,
)
from analysis.analyzers.timers import framework_timers
from analysis.parsers.nccl_tests import parse_nccl_tests
from analysis.parsers.recognize import group_runs, recognize
from analysis.parsers.runs import ReadTraces, Run, load_runs
from analysis.table import Table
from launch.config.adapters import adapted
from launch.config.schema import PeftSection

MAX_WARNINGS_SHOWN = 30


@dataclass(frozen=True)
class Startup:
    """A run's start-up per rank (the meta records' startup_s) and its checkpoint saves (the checkpoint records)."""

    startup_s: dict[Any, float]  # by rank, where recorded (a resumed run: its last start)
    saves: int  # checkpoint records of the rank with the most
    asynchronous: bool | None  # whether its saves were asynchronous (None: no save recorded)
    blocked_s: list[float]  # every rank's blocked time of every save
    source: str

    @property
    def slowest_rank(self) -> Any:
        return max(self.startup_s, key=self.startup_s.__getitem__) if self.startup_s else None

    @property
    def median_startup_s(self) -> float | None:
        return statistics.median(self.startup_s.values()) if self.startup_s else None

    @property
    def blocked_median_s(self) -> float | None:
        return statistics.median(self.blocked_s) if self.blocked_s else None

    @property
    def blocked_max_s(self) -> float | None:
        return max(self.blocked_s, default=None)


def startup_of(run: Run) -> Startup | None:
    """None where the run has no metrics of ours recording either."""
    if run.metrics is None:
        return None
    m = run.metrics.meta
    times = {rank: meta["startup_s"] for rank, meta in m.ranks.items() if meta.get("startup_s") is not None}
    per_rank: dict[Any, int] = defaultdict(int)
    for c in m.checkpoints:
        per_rank[c["rank"]] += 1
    if not times and not m.checkpoints:
        return None
    kinds = {c["asynchronous"] for c in m.checkpoints}
    return Startup(times, max(per_rank.values(), default=0), kinds.pop() if len(kinds) == 1 else None,
                   [c["blocked_s"] for c in m.checkpoints], ", ".join(m.files[:1]) + (" …" if len(m.files) > 1 else ""))


@dataclass(frozen=True)
class Trainable:
    """What of a run's model trains: the whole model's parameters that train and that stay frozen (the metrics' meta
    records; None in runs recorded before they held them, and in foreign runs) and its [peft] section."""

    trainable_params: int | None
    frozen_params: int | None
    # resolved.json's recipe.peft (method "none": every parameter trains); None: the run has no resolved.json
    peft: PeftSection | None
    source: str  # the file the counts came from; "" where none states them (the peft section: the run's resolved.json)

    @property
    def fine_tune(self) -> bool | None:
        """Whether the run trains adapters on a frozen base; None where no resolved.json says."""
        return None if self.peft is None else adapted(self.peft)

    @property
    def trainable_pct(self) -> float | None:
        """The trainable parameters' share of the whole model, %."""
        if self.trainable_params is None or self.frozen_params is None:
            return None
        total = self.trainable_params + self.frozen_params
        return 100 * self.trainable_params / total if total else None


def trainable_of(run: Run) -> Trainable:
    """The run's parameter counts (its metrics' meta records) and [peft] section (its resolved.json)."""
    m = run.metrics.meta if run.metrics is not None else None
    counted = bool(m and m.files) and (m.trainable_params is not None or m.frozen_params is not None)
    return Trainable(m.trainable_params if m else None, m.frozen_params if m else None,
                     run.resolved.recipe.peft if run.resolved is not None else None,
                     f"meta of {m.files[0]}" if counted else "")


def flops_formulas(rep: Report) -> dict[str, list[str]]:
    """The runs by how their MFU counts FLOPs per token (the meta records' flops_formula: a [peft] fine-tune counts
    the FLOPs it does, launch.run.metrics.FLOPS_FORMULA_ADAPTERS), where our metrics say."""
    out: dict[str, list[str]] = {}
    for r in rep.runs:
        formula = r.run.metrics.meta.flops_formula if r.run.metrics is not None else None
        if formula:
            out.setdefault(formula, []).append(r.label)
    return out


@dataclass
class RunResult:
    run: Run
    layout: RunLayout
    trainable: Trainable  # the parameters that train and that stay frozen, and the [peft] section
    steps: Table | None = None
    stats: Table | None = None
    step_times: list[tuple[int, float, str]] = field(default_factory=list)
    memory: Table | None = None
    breakdown: Table | None = None
    exposed: Table | None = None
    traces: TraceSet | None = None  # the run's traces as the report reads them (analysis.analyzers.rank_traces)
    busbw_points: list[tuple[Any, float]] = field(default_factory=list)  # (message bytes, busbw GB/s) per call
    # (ranks whose calls busbw_points holds, rank_traces.PLOTTED_RANKS at most; ranks with such calls)
    busbw_ranks: tuple[int, int] = (0, 0)
    bandwidth: Table | None = None
    ceilings: Table | None = None
    # (op, file, busbw-vs-size curve) of each nccl-tests sweep (analysis.analyzers.ceilings.ceiling_curves)
    ceiling_curves: list[tuple[str, str, list[tuple[float, float]]]] = field(default_factory=list)
    vs_layout: Table | None = None
    stragglers: Table | None = None
    arrivals: Table | None = None  # where each collective waited, per collective type (analysis.analyzers.arrivals)
    rank_arrivals: Table | None = None  # the same per rank
    # runs of several ranks: each per-rank table (breakdown, exposed, kernel_types, stragglers,
    # rank_arrivals, memory) as rank_distributions, shown in place of its rows
    distributions: dict[str, Table] = field(default_factory=dict)
    timers: list[Table] = field(default_factory=list)
    nsys_totals: list[Table] = field(default_factory=list)
    prediction: list[dict[str, Any]] = field(default_factory=list)
    curves: Table | None = None  # loss, grad norm, lr, loss scale per step (analysis.analyzers.curves)
    validation: list[C.ValidationPoint] = field(default_factory=list)
    boundaries: list[str] = field(default_factory=list)  # where a log holds several runs (steps.run_boundaries)
    nccl_rows: list[Table] = field(default_factory=list)  # each nccl-tests file, per size (comm_tables)
    transports: list[Table] = field(default_factory=list)  # each NCCL_DEBUG log, per rank pair
    kernel_types: Table | None = None  # HTA's kernel-type breakdown, per rank (GPU traces)
    notes: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # logs whose steps, memory or layout another log gave
    startup: Startup | None = None  # start-up per rank and checkpoint saves, from our metrics

    @property
    def label(self) -> str:
        return self.run.label


@dataclass(frozen=True)
class CurvePair:
    """The loss curve of `other` against that of `first` (the report's first run with a curve)."""

    first: str
    other: str
    not_comparable: str  # why the curves need not agree ('': same global batch, sequence, steps, schedule, seed)
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


def layout_of(run: Run) -> RunLayout:
    """The run's layout facts and where they came from (resolved.json, metrics meta, or the logs)."""
    if run.resolved is not None:
        rc, g = run.resolved.recipe, run.resolved.grid
        return RunLayout(backend=rc.backend, tp=g.tp, pp=g.pp, dp=g.dp, zero_stage=rc.parallel.zero_stage,
                         sp=rc.parallel.sp, micro_batch_size=rc.batch.micro_batch_size,
                         global_batch_size=rc.batch.global_batch_size, seq_len=rc.batch.seq_len,
                         dtype=rc.precision.dtype, world_size=g.world, hardware=run.resolved.hardware.name,
                         model=run.resolved.model.name, steps=rc.train.steps, lr=rc.train.lr,
                         lr_warmup_steps=rc.train.lr_warmup_steps, lr_schedule=rc.train.lr_schedule,
                         seed=rc.train.seed, **_data_identity(run.resolved), source=run.resolved_source)
    if run.metrics is not None and run.metrics.meta.ranks:
        m = run.metrics.meta
        return RunLayout(backend=m.backend, tp=m.tp, pp=m.pp, dp=m.dp, zero_stage=m.zero_stage,
                         micro_batch_size=m.micro_batch_size, global_batch_size=m.global_batch_size,
                         seq_len=m.seq_len, dtype=m.dtype, world_size=m.world_size, hardware=m.hardware_profile,
                         source=f"meta record of {m.files[0]}" if m.files else "metrics meta")
    out = _log_layout(run)
    if out.world_size is None and run.trace is not None:
        out = replace(out, world_size=run.trace.meta.world_size)
        if out.source is None and out.world_size:
            out = replace(out, source="trace distributedInfo")
    if run.hardware is not None:
        out = replace(out, hardware=run.hardware.name)
    return out


def _data_identity(resolved) -> dict[str, str | None]:
    """What a run read, for the curves' comparison: the source, the corpus by path and by content (the data check's
    digest of the token streams, in resolved.json; an older run without one: unknown), and the tokenizer."""
    d = resolved.recipe.data
    if d.source == "synthetic":
        return {"data": "synthetic", "data_path": None, "corpus": "synthetic", "tokenizer": "none"}
    fingerprint = resolved.data_fingerprint if isinstance(resolved.data_fingerprint, str) else None
    tokenizer = f"model ({resolved.recipe.model.weights})" if d.tokenizer == "model" else d.tokenizer
    return {"data": d.source, "data_path": d.path, "corpus": fingerprint[:12] if fingerprint else None,
            "tokenizer": tokenizer}


def _log_layout(run: Run) -> RunLayout:
    """The layout a foreign run's logs state: a Megatron log's arguments dump or iteration lines, else a DeepSpeed
    Flops Profiler summary; an empty RunLayout when none does."""
    for log in _megatron_first(run):
        if _layout_records(log):
            lay = log.meta.layout or {}
            iters = [r for r in log.rows() if r["kind"] == "iteration"]
            gbs = lay.get("global_batch_size") or next(
                (r["global_batch_size"] for r in iters if r["global_batch_size"]), None)
            seq = lay.get("seq_length") or next((r["seq_length"] for r in iters if r["seq_length"]), None)
            args = log.meta.args or {}
            return RunLayout(backend="megatron", tp=lay.get("tp"), pp=lay.get("pp"), dp=lay.get("dp"),
                             zero_stage=lay.get("zero_stage"), sp=lay.get("sp"),
                             micro_batch_size=lay.get("micro_batch_size"), global_batch_size=gbs, seq_len=seq,
                             dtype=_dtype(lay.get("params_dtype")), world_size=lay.get("world_size"),
                             steps=args.get("train_iters"), lr=args.get("lr"),
                             lr_warmup_steps=args.get("lr_warmup_iters"), lr_schedule=args.get("lr_decay_style"),
                             seed=args.get("seed"), source=log.source)
    for log in run.deepspeed:
        prof = _layout_records(log)
        if prof:
            p = prof[0]
            return RunLayout(backend="deepspeed", dp=p["dp"], world_size=p["world_size"],
                             micro_batch_size=p["micro_batch_size"], source=f"{log.source}:{p['line']}")
    return RunLayout()


def _megatron_first(run: Run) -> list[Table]:
    """The run's Megatron logs, those with the arguments dump first: such a log states the layout
    (iteration lines give only batch and sequence), so layout, steps and memory come from one log
    when it has them all."""
    return sorted(run.megatron, key=lambda t: not t.meta.layout)


def _layout_records(log: Table) -> list[Any]:
    """What a log tells of the layout: Megatron's arguments dump or iteration lines, DeepSpeed's Flops
    Profiler summaries; empty when it tells nothing."""
    if log.name == "megatron_log":
        return [log.meta.layout] if log.meta.layout else [r for r in log.rows() if r["kind"] == "iteration"]
    return [r for r in log.rows() if r["kind"] == "flops_profile"]


def _steps(run: Run, layout: RunLayout) -> tuple[Table | None, str, str]:
    """(steps table, MFU formula, where the warm-up count came from) from the best source present."""
    if run.metrics is not None and len(run.metrics):
        m = run.metrics.meta
        first = m.files[0] if m.files else "metrics"
        peak, fpt = m.peak_flops_per_device, m.flops_per_token
        formula = (f"MFU = tokens/s/device x {fpt:,.0f} FLOP/token / {peak / 1e12:g} TFLOP/s ({m.hardware_profile} "
                   f"{m.dtype} peak, meta of {first}); FLOP/token: {m.flops_formula}"
                   if peak and fpt else "unknown: the meta record lacks flops_per_token or the peak")
        return steps_from_metrics(run.metrics), formula, f"meta of {first}: warmup_steps={m.warmup_steps}"
    peak, dtype_note = None, ""
    if run.hardware is not None:
        dtype = layout.dtype
        if dtype is None:
            dtype, dtype_note = "bf16", "; the log names no dtype, bf16 assumed"
        peak = run.hardware.peak_flops(dtype)
    for log in _megatron_first(run):
        t = steps_from_megatron(log, peak_flops=peak)
        if _timed(t):
            if peak:
                formula = (f"MFU = the log's TFLOP/s/GPU / {peak / 1e12:g} TFLOP/s ({run.hardware.name} "
                           f"{layout.dtype or 'bf16'} peak, {run.hardware_source}{dtype_note}); the TFLOP count "
                           f"is Megatron's own (it may include recomputation)")
            else:
                formula = ("unknown: the peak FLOP/s is not known for a foreign log; pass hardware=PROFILE "
                           "(and the log must print TFLOP/s/GPU)")
            return t, formula, ""
    for log in run.deepspeed:
        t = steps_from_deepspeed(log)
        if _timed(t):
            return t, "unknown: DeepSpeed's step lines carry no FLOP count", ""
    for tb in run.tensorboard:
        t = steps_from_tensorboard(tb)
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
        "layout": (res.layout.source if run.resolved is None else None,
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
    "megatron_log": steps_from_megatron, "deepspeed_log": steps_from_deepspeed,
    "tensorboard": steps_from_tensorboard}
_MEMORY_FROM: dict[str, Callable[[Table], Table]] = {
    "megatron_log": memory_from_megatron, "deepspeed_log": memory_from_deepspeed}


def _memory(run: Run, device_memory_bytes: int | None) -> Table | None:
    mem = None
    if run.metrics is not None and len(run.metrics):
        mem = memory_from_metrics(run.metrics)
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
    return memory_vs_plan(mem, run.plan, plan_source=run.plan_source or "", device_memory_bytes=dev,
                            device_source=dev_src, no_plan_reason=reason)


def prediction_rows(run: Run, res: RunResult) -> list[dict[str, Any]]:
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
    if res.startup is not None and res.startup.blocked_s and plan.checkpoint is not None and plan.checkpoint.blocked_s:
        add("checkpoint blocked time per save (median over saves and ranks)", plan.checkpoint.blocked_s,
            res.startup.blocked_median_s, "s", res.startup.source)
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


def analyze_run(run: Run, *, ceilings: Sequence[Table] | None = None, ceiling_source: str = "",
                device_memory_bytes: int | None = None) -> RunResult:
    """Every analyzer that the run's files allow."""
    layout = layout_of(run)
    res = RunResult(run, layout, trainable_of(run), startup=startup_of(run))
    steps, formula, warm_from = _steps(run, layout)
    if steps is not None:
        res.steps = steps
        res.stats = step_statistics(steps, mfu_formula=formula, warmup_from=warm_from)
        res.step_times = measured_step_times(steps, res.stats)
    res.memory = _memory(run, device_memory_bytes)
    ceil_tables = list(ceilings) if ceilings is not None else run.nccl_tests
    if ceil_tables:
        res.ceilings = nccl_ceilings(ceil_tables)
        res.ceiling_curves = ceiling_curves(ceil_tables)
    if run.trace is not None and len(run.trace):
        tr = run.trace
        traces = res.traces = tr if isinstance(tr, TraceSet) else of_table(tr, layout.dims())
        traces.settle(layout.dims())  # the layout may be known better than when the traces were read
        res.breakdown = traces.breakdown()
        res.exposed = traces.exposed()
        res.kernel_types = traces.kernel_types()
        res.stragglers = traces.stragglers(threshold_pct=D.STRAGGLER_PCT)
        res.bandwidth = traces.bandwidth(
            res.ceilings, no_ceiling_reason="no nccl-tests output in the run (commbench/) and no ceiling= given")
        res.busbw_points, res.busbw_ranks = traces.busbw_points()
        res.arrivals, res.rank_arrivals = traces.arrivals()
        if run.resolved is not None:
            res.vs_layout = collectives_vs_layout(res.bandwidth, expected_from_resolved(run.resolved),
                                                    expected_source=run.resolved_source or "resolved.json")
        if run.trace_from == "nsys":
            res.notes.append(f"time breakdown from Nsight Systems exports via analysis.parsers.nsys_adapter; ranks: "
                             f"{tr.meta.rank_from}")
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
            res.notes.append("cpu_ops basis (CPU-only trace): " + CPU_BASIS)
    measured = set(res.stats.meta.measured_steps) if res.stats is not None else None
    for log in [*run.megatron, *run.deepspeed]:
        if any(r["kind"] == "timer" for r in log.rows()):
            own = res.steps is not None and res.steps.source == log.source
            t = framework_timers(log, measured if own else None)
            if len(t):
                res.timers.append(t)
    res.nsys_totals = [t for t in (nsys_stats_totals(s) for s in run.nsys_stats) if len(t)]
    res.prediction = prediction_rows(run, res)
    res.curves = _curves(run)
    res.validation = [v for log in run.megatron for v in C.validation_points(log)]
    res.boundaries = [b for log in [*run.megatron, *run.deepspeed] for b in run_boundaries(log)]
    res.nccl_rows = [t for t in (CT.nccl_tests_rows(n) for n in run.nccl_tests) if len(t)]
    res.transports = [t for t in (CT.transports(d) for d in nccl_logs(run)) if len(t)]
    res.unused = _unused_logs(run, res)
    res.distributions = _distributions(res)
    return res


# Each per-rank table's quantities, with the side that is bad, as distributions (rank_distributions) and by what the
# table is split.
SPREAD: dict[str, tuple[str | None, tuple[tuple[str, str], ...]]] = {
    "breakdown": (None, (("span_us", "high"), ("compute_pct", "low"), ("exposed_comm_pct", "high"),
                         ("other_pct", "high"), ("idle_pct", "high"), ("overlap_pct", "low"))),
    "exposed": ("collective", (("comm_time_us", "high"), ("exposed_us", "high"), ("exposed_pct_of_span", "high"))),
    "kernel_types": ("kernel_type", (("time_us", "high"), ("share_pct", "high"))),
    "stragglers": (None, (("step_time_us", "high"), ("comm_time_us", "low"), ("step_excess_pct", "high"),
                          ("comm_deficit_pct", "high"))),
    "rank_arrivals": (None, (("last_pct", "high"), ("late_us", "high"), ("wait_us", "high"))),
    "memory": (None, (("measured_bytes", "high"), ("pct_of_device", "high"))),
}


def _distributions(res: RunResult) -> dict[str, Table]:
    """The run's per-rank tables as distributions over its ranks, for a run of several ranks: the report's row per run
    (each table counted on its own: the memory records may cover other ranks than the traces)."""
    out = {}
    for key, (by, quantities) in SPREAD.items():
        t = getattr(res, key)
        if t is not None and len(set(t.columns["rank"])) > 1:
            out[key] = rank_distributions(t, quantities, by=by)
    return out


def nccl_logs(run: Run) -> list[Table]:
    """Every NCCL_DEBUG log of a run, each file once: the logs of their own, and the NCCL lines an nccl-tests output
    printed among its rows (nccl-tests run with NCCL_DEBUG=INFO), one table per section, unless that file was read as
    a log of its own as well (enough NCCL lines make it one)."""
    logs = {t.source for t in run.nccl_debug}
    return [*run.nccl_debug, *(sec.nccl_debug for t in run.nccl_tests if t.source not in logs for sec in t.meta.sections
                               if sec.nccl_debug is not None and len(sec.nccl_debug))]


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


CPU_BASIS = ("compute = CPU ops on the training thread(s) (those holding the ProfilerStep annotations), less "
              "the time inside collective calls; communication = collective calls (c10d::*, record_param_comms, "
              "nccl:*/gloo:*) on any thread; idle = ProfilerStep window with neither; overlap = communication "
              "time during which the training thread computes (analysis.analyzers.trace_analysis)")


def _overlap_allowed(layout: RunLayout) -> tuple[bool | None, str]:
    if layout.dp is None and layout.zero_stage is None and layout.pp is None:
        return None, "the layout is unknown (foreign trace) and data-parallel communication usually can overlap"
    reasons = []
    if (layout.dp or 1) > 1:
        reasons.append(f"dp={layout.dp} (gradient reduction can overlap the backward pass)")
    if layout.zero_stage == 3:
        reasons.append("ZeRO-3 (parameter gathers can be prefetched)")
    if (layout.pp or 1) > 1:
        reasons.append(f"pp={layout.pp} (sends overlap other micro-batches)")
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
        out += D.slow_transport(r.label, nccl_logs(r.run), expect_net=_expect_net(r.run))
        out += D.extra_collectives(r.label, r.vs_layout)
        allows, why = _overlap_allowed(r.layout)
        out += D.no_overlap(r.label, r.breakdown, allows=allows, why=why)
        out += D.straggler(r.label, r.stragglers)
        out += D.late_rank(r.label, r.rank_arrivals, r.arrivals)
        out += D.idle_device(r.label, r.breakdown)
        out += D.memory_near_limit(r.label, r.memory)
        out += D.low_busbw(r.label, r.bandwidth)
    if len(results) > 1:
        out += D.mismatched_runs([(r.label, r.layout.global_batch_size, r.layout.seq_len, r.layout.source or "?")
                                  for r in results])
    return out


def _trace_reader(jobs: int | None, progress: Callable[[str, int, int], None] | None, kernels: bool) -> ReadTraces:
    """analysis.parsers.runs' read_traces: a run's Kineto traces rank by rank, on `jobs` worker processes
    (analysis.analyzers.rank_traces.read_traces); `progress(run label, ranks done, ranks)`; `kernels`: keep what the
    kernel diff needs."""
    def read(run: Run, files: list[Path]) -> TraceSet:
        tell = (lambda done, total: progress(run.label, done, total)) if progress is not None else None
        return read_traces(files, layout=layout_of(run).dims(), jobs=jobs, progress=tell, rel=run.rel,
                           relabel=run.relabel, kernels=kernels)
    return read


def build_report(inputs: Sequence[tuple[str | None, str | os.PathLike[str]]], *, ceiling: str | None = None,
                 hardware: Any = None, hardware_source: str = "", device_memory_bytes: int | None = None,
                 jobs: int | None = None, progress: Callable[[str, int, int], None] | None = None) -> Report:
    """Recognise, load and analyse every input path (with an optional label each) into one Report. Each run's traces
    are read on `jobs` worker processes (default: every core; 1: in this process), `progress(run, done, total)` after
    each trace file."""
    ceilings = parse_ceiling(ceiling) if ceiling else None
    ceiling_note = (f"ceiling: nccl-tests output given as ceiling={ceiling}" if ceiling else
                    "ceiling: each run's own nccl-tests output (commbench/ or nccl-tests files among its files)")
    if ceiling and not ceilings:
        ceiling_note += " (no nccl-tests tables found there)"
    found = []
    missing = []
    for label, path in inputs:
        if not Path(path).exists():
            missing.append(f"{path}: does not exist")
            continue
        found += group_runs(recognize(path), label)
    # The kernel diff compares the first two runs with GPU traces: without two runs of traces no totals are kept.
    diffable = sum(1 for rf in found if rf.of("kineto_trace") or rf.of("nsys_sqlite")) >= 2
    runs: list[Run] = []
    for rf in found:
        runs += load_runs(rf, hardware=hardware, hardware_source=hardware_source,
                          read_traces=_trace_reader(jobs, progress, diffable))
    seen: dict[str, int] = {}
    for r in runs:  # labels must tell runs apart
        n = seen.get(r.label, 0)
        seen[r.label] = n + 1
        if n:
            r.label = f"{r.label}#{n + 1}"
    results = [analyze_run(r, ceilings=ceilings, device_memory_bytes=device_memory_bytes) for r in runs]
    diff, note = None, "needs two runs whose traces hold GPU kernels"
    gpu_runs = [r for r in results if r.traces is not None and r.traces.has_gpu]
    if len(gpu_runs) >= 2:
        a, b = gpu_runs[:2]
        diff = kernel_totals_diff(a.traces.kernel_totals(), b.traces.kernel_totals(),
                                  source=f"{a.traces.source} -> {b.traces.source}")
        note = f"{b.label} minus {a.label}, per profiled rank-step (trace_analysis.kernel_diff normalize='per_step')"
    elif gpu_runs:
        note = f"needs two runs whose traces hold GPU kernels; only {gpu_runs[0].label}'s do: no kernel-level diff"
    elif any(r.run.trace is not None for r in results):
        note = "the traces hold no GPU kernels (CPU-only runs): no kernel-level diff"
    return Report(results, diagnose(results), diff, note, missing, ceiling_note, curve_pairs(results))


def bar_segments(r: RunResult) -> dict[str, float]:
    """Shares of a run's span (mean over its ranks, %) for the time bar: compute, each collective's exposed time
    (scaled to the merged exposed total, since collectives can run at once), other, idle."""
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
