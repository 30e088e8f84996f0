"""The report's answer, computed: among runs that can be compared, which was fastest per GPU and by how much, and
why each other one was slower, its median step minus the fastest's split into the parts its traces measure.
analysis.report.sections renders it as the report's first screen; analysis.__main__ prints it after writing.

Runs race only against runs of the same model, global batch, sequence length and hardware (the same tokens per
step on the same device: RACE_WHEN_SAME); others form groups of their own, each ranked, and the answer says so."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from analysis.analyzers import doctor as D
from analysis.report.data import Report, RunResult, bar_segments

RACE_WHEN_SAME = ("model", "global_batch_size", "seq_len", "hardware")
# Loss curves agree when, at every step both logged, they differ by at most this share of the loss (bf16 layouts of
# one recipe differ by 1e-3 at most in the tiny matrix; a different data order or seed moves it by tens of percent).
AGREE_REL = 0.02
NO_RECOMPUTE = "none: its plan recomputes nothing"
# The doctor's rules (analysis.analyzers.doctor.RULES) that name the rank the others waited for: the cause a slower
# run's split shows only as idle and exposed communication.
WAITED_FOR = ("late_rank", "straggler")


@dataclass(frozen=True)
class Standing:
    """One run in its group's ranking."""

    label: str
    step_s: float | None  # median step time
    tokens_per_s_per_device: float | None
    mfu_pct: float | None
    memory_pct: float | None  # the highest rank's peak as a share of its device
    loss_agrees: bool | None  # against its curve pair (the report's: each run against the first run with a curve,
    # which is compared with the second); None: not compared
    loss_against: str  # the run its loss was compared with ('' where none was)
    loss_gap: float | None  # the largest relative loss gap at the steps both logged; None: not compared
    loss_why_not: str  # why it was not compared ('' where it was)
    finding: D.Finding | None  # the doctor's most severe finding on this run
    source: str  # where its step times come from


@dataclass(frozen=True)
class Part:
    """One part of a step, in seconds: the run's, the fastest run's, and the difference."""

    name: str  # compute, recompute, exposed <collective>, other, idle
    run_s: float
    best_s: float

    @property
    def delta_s(self) -> float:
        return self.run_s - self.best_s


@dataclass(frozen=True)
class WhySlower:
    """A run's median step against the fastest run's of its group."""

    label: str
    best: str
    delta_s: float
    best_step_s: float
    parts: tuple[Part, ...]  # largest difference first; empty where a split is missing
    missing: str  # why there is no split ('' when there is one)
    sources: tuple[str, str]  # the traces the split comes from: the run's, the fastest's
    predicted_delta_s: float | None  # the plans' step times, the same difference
    recompute: str = ""  # how recomputation was told apart from compute: measured, planned FLOPs, not separated
    planned_parts: tuple[Part, ...] = ()  # the plans' split of the same difference (empty without both plans)
    waited_for: D.Finding | None = None  # the doctor's finding of a rank the others waited for in this run


@dataclass(frozen=True)
class Group:
    shared: str  # what its runs share ("model llama-2-7b, global batch 16, ...")
    standings: tuple[Standing, ...]  # fastest first; runs without a finite, positive speed last
    why: tuple[WhySlower, ...]
    raced: int  # how many runs have a finite, positive speed (the first `raced` standings)
    margin: float | None  # the fastest's tokens/s/GPU over the next one's, less 1 (None with fewer than two raced)


@dataclass(frozen=True)
class Answer:
    groups: tuple[Group, ...]
    differs: str  # what separates the groups ('' with one group)


def answer(rep: Report) -> Answer:
    groups: dict[tuple, list[RunResult]] = {}
    for r in rep.runs:
        groups.setdefault(tuple(getattr(r.layout, k) for k in RACE_WHEN_SAME), []).append(r)
    keys = list(groups)
    differs = ", ".join(k.replace("_", " ") for i, k in enumerate(RACE_WHEN_SAME)
                        if len({key[i] for key in keys}) > 1)
    return Answer(tuple(_group(rep, key, runs) for key, runs in groups.items()), differs)


def _group(rep: Report, key: tuple, runs: list[RunResult]) -> Group:
    shared = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in zip(RACE_WHEN_SAME, key, strict=True) if v is not None)
    ranked = sorted(runs, key=lambda r: -_speed(r))
    standings = tuple(_standing(rep, r) for r in ranked)
    raced = [r for r in ranked if _speed(r) > 0 and (_stat(r, "step_time_median_s") or 0) > 0]
    why = tuple(replace(_why(r, raced[0]), waited_for=_waited_for(rep, r)) for r in raced[1:])
    margin = _speed(raced[0]) / _speed(raced[1]) - 1 if len(raced) > 1 else None
    return Group(shared or "nothing the runs state", standings, why, len(raced), margin)


def _waited_for(rep: Report, r: RunResult) -> D.Finding | None:
    return next((f for rule in WAITED_FOR for f in rep.findings if f.run == r.label and f.rule == rule), None)


def _speed(r: RunResult) -> float:
    """tokens/s/GPU to rank by: a run whose speed is missing or not a number (a damaged log) ranks last."""
    x = _stat(r, "tokens_per_s_per_device")
    return x if x is not None and math.isfinite(x) else -1.0


def _stat(r: RunResult, column: str) -> float | None:
    if r.stats is None or not len(r.stats):
        return None
    return next(r.stats.rows()).get(column)


def _standing(rep: Report, r: RunResult) -> Standing:
    memory = max((m["pct_of_device"] for m in r.memory.rows() if m["pct_of_device"] is not None), default=None) \
        if r.memory is not None else None
    other, gap, why_not = "", None, "no loss curve"
    pair = next((p for p in rep.curve_pairs if r.label in (p.first, p.other)), None)
    if pair is not None:
        other = pair.other if r.label == pair.first else pair.first
        gap = None if pair.not_comparable else pair.comparison.max_rel_diff
        why_not = (f"not expected to agree: {pair.not_comparable}" if pair.not_comparable
                   else "no step in common" if gap is None else "")
    finding = next((f for sev in ("warn", "info") for f in rep.findings if f.run == r.label and f.severity == sev), None)
    return Standing(r.label, _stat(r, "step_time_median_s"), _stat(r, "tokens_per_s_per_device"), _stat(r, "mfu_pct"),
                    memory, None if gap is None else gap <= AGREE_REL, other, gap, why_not, finding,
                    r.run.relabel(next(r.stats.rows())["source"]) if r.stats is not None and len(r.stats) else "–")


def _parts(r: RunResult, step_s: float) -> tuple[dict[str, float], str]:
    """The run's median step split by its traces' shares (compute, exposed collectives, other, idle), with
    recomputation named apart from compute, and how it was: measured inside the trainer's recompute ranges where the
    traces mark them (the torch backend), else the compute share the plan attributes to it (hardware minus model
    FLOPs), else not at all."""
    out = {name: pct / 100 * step_s for name, pct in bar_segments(r).items()}
    marked = [b["recompute_pct"] for b in r.breakdown.rows() if b.get("recompute_pct") is not None]
    plan = r.run.plan
    if marked:
        out["recompute"], how = sum(marked) / len(r.breakdown) / 100 * step_s, "measured"
    elif plan is not None and plan.step.hardware_flops_per_step:
        share = 1 - plan.step.model_flops_per_step / plan.step.hardware_flops_per_step
        out["recompute"], how = out.get("compute", 0.0) * share, "planned FLOPs" if share else NO_RECOMPUTE
    else:
        return out, "not separated"
    out["compute"] = out.get("compute", 0.0) - out["recompute"]
    return out, how


def _planned_parts(plan) -> dict[str, float]:
    """A plan's step time in the split's parts: compute and recompute (the compute model's own recompute time; a
    calibrated plan's measured passes are split by their FLOPs' shares), the collectives on the critical path, the
    pipeline bubble (idle in traces), offload traffic."""
    t = plan.step
    if t.gemm_s:  # the compute model timed the recomputation itself (launch/plan/compute.py)
        recompute = t.recompute_s
    else:
        share = 1 - t.model_flops_per_step / t.hardware_flops_per_step if t.hardware_flops_per_step else 0.0
        recompute = t.compute_s * share
    return {"compute": t.compute_s - recompute, "recompute": recompute,
            "exposed communication": t.tp_comm_s + t.pp_comm_s + t.dp_exposed_s, "bubble": t.bubble_s,
            "offload": t.offload_s}


def _why(r: RunResult, best: RunResult) -> WhySlower:
    step, best_step = _stat(r, "step_time_median_s"), _stat(best, "step_time_median_s")
    predicted = (r.run.plan.step.total_s - best.run.plan.step.total_s
                 if r.run.plan is not None and best.run.plan is not None else None)
    if r.layout.world_size != best.layout.world_size:
        # per-GPU speeds race; steps of different rank counts do not split into parts of one another
        return WhySlower(r.label, best.label, step - best_step, best_step, (), f"on {r.layout.world_size} ranks against "
                         f"{best.layout.world_size}: its speed per GPU is compared, its step is not split", ("", ""),
                         predicted)
    missing = [x.label for x in (r, best) if x.breakdown is None or not len(x.breakdown)]
    if missing:
        return WhySlower(r.label, best.label, step - best_step, best_step, (), f"no traces for {' and '.join(missing)}: "
                         "the step time is measured, its split is not", ("", ""), predicted)
    (mine, how), (theirs, how_best) = _parts(r, step), _parts(best, best_step)
    parts = sorted((Part(n, mine.get(n, 0.0), theirs.get(n, 0.0)) for n in {*mine, *theirs}),
                   key=lambda p: -p.delta_s)
    planned = ()
    if r.run.plan is not None and best.run.plan is not None:
        a, b = _planned_parts(r.run.plan), _planned_parts(best.run.plan)
        planned = tuple(Part(n, a[n], b[n]) for n in a)
    return WhySlower(r.label, best.label, step - best_step, best_step, tuple(parts), "",
                     (r.breakdown.source, best.breakdown.source), predicted,
                     how if how_best in (how, NO_RECOMPUTE) else f"{how} ({r.label}), {how_best} ({best.label})",
                     planned)

