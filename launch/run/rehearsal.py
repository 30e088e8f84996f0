"""The rehearsal's records (torch-free): what a rehearsed rank measured (written by launch/ranks/rehearse.py, read
back here), and rehearsal.json, each measured figure beside the plan's (launch/plan, imported, never recomputed).

A rehearsal directory (runs/rehearsals/<recipe>/<UTC stamp>/, or out=DIR):
  resolved.json  plan.json       what `python -m launch rehearse` resolved and planned
  measured_rank{R}.json          what rank R's rehearsal measured (one rank per distinct role of the grid)
  logs/                          the rank program's own records (its model build, as a training rank's)
  rehearsal.json                 written last: per rehearsed rank, measured beside planned, and their ratios
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from launch import inputs
from launch.errors import ConfigError
from launch.plan.layout import Plan
from launch.plan.memory import PHASES

REHEARSAL = "rehearsal.json"
# The catalogue's record of every torch-backend GPU recipe rehearsed at full size (recipes/rehearsed.json, written by
# bench/rehearse_catalogue.py, shown by the catalogue beside the plan).
CATALOGUE = "rehearsed.json"
CATALOGUE_SCHEMA = "layoutlab rehearsed catalogue 2"
SCHEMA = "layoutlab rehearsal 1"  # rehearsal.json's mark: a folder holding it is ours (launch.outputs rules)
# What a rehearsed rank runs and what it leaves out; rehearsal.json states it beside the numbers.
METHOD = ("the torch backend's TorchTrainer built as for training (model on meta, its parallelize order, "
          "train.compile off) on a fake process group, materialised under FakeTensorMode on the CPU; AdamW fused, as "
          "a GPU rank steps it, its state made by one optimizer step on zero gradients; then one step measured: the "
          "first and last micro-batches run (micro-batches 2..G-1 repeat the first's work, counted as copies of it), "
          "then the gradient norm, clipping and the optimizer step; train_step's host syncs (float(norm), "
          "GradScaler.step's overflow check) cannot run on fake tensors and are left out")
# What the plan counts that the rehearsal measures otherwise; rehearsal.json states it beside the numbers.
DDP_BUCKETS = ("DDP's buckets are assigned in the parameters' order, its first assignment (the rebuild that orders "
               "them by the gradients' arrival from the second step on reads values fake tensors do not hold): their "
               "all-reduces can number one more or fewer than the plan's, which follows the arrival order")


@dataclass(frozen=True)
class Collective:
    kind: str  # the plan's names (launch.plan.layout.Comm.collective): all_gather, reduce_scatter, all_reduce, ...
    message_bytes: int  # per call, nccl-tests' S (all_gather: the gathered output; reduce_scatter: the input)
    calls: int  # per step


@dataclass(frozen=True)
class PhasePeak:
    """The most one rank held during one of the plan's phases of the step (launch.plan.memory.PHASES)."""

    phase: str
    bytes: int
    by_kind: Mapping[str, int]  # the tracker's kinds at that instant
    at: str  # the micro-batch and the innermost module running


@dataclass(frozen=True)
class Measured:
    """What one rehearsed rank measured, per optimizer step."""

    rank: int
    role: str  # the plan's rank kind (launch.plan.layout.RankPlan.kind)
    peak_bytes: int  # torch's memory tracker, over the measured step
    peak_by_kind: Mapping[str, int]  # the tracker's kinds at that instant
    peak_at: str  # when in the step: the phase, forward or backward, the innermost module
    phase_peaks: tuple[PhasePeak, ...]  # in the order of launch.plan.memory.PHASES
    flops_counted: float  # FlopCounterMode, the rank's own tensors
    flops_attention: float  # scaled_dot_product_attention on the CPU, which FlopCounterMode does not count: the formula
    attention_note: str
    collectives: tuple[Collective, ...]
    micro_batches_run: int
    micro_batches_per_step: int
    tracker: str
    optimizer: str
    seconds: float

    @property
    def flops(self) -> float:
        return self.flops_counted + self.flops_attention

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Measured":
        d = json.loads(text)
        return cls(**{**d, "collectives": tuple(Collective(**c) for c in d["collectives"]),
                      "phase_peaks": tuple(PhasePeak(**p) for p in d["phase_peaks"])})


def measured_path(root: Path, rank: int) -> Path:
    return root / f"measured_rank{rank}.json"


def calls_by_kind(collectives) -> dict[str, int]:
    """Calls per step by collective kind, from Collective or launch.plan.layout.Comm records."""
    out: Counter = Counter()
    for c in collectives:
        out[c.kind if isinstance(c, Collective) else c.collective] += (
            c.calls if isinstance(c, Collective) else c.calls_per_step)
    return dict(sorted(out.items()))


def _planned_messages(plan: Plan) -> list[dict]:
    return [{"kind": c.collective, "message_bytes": c.message_bytes, "calls": c.calls_per_step,
             "parallelism": c.parallelism, "note": c.note} for c in plan.comm]


def _ratio(planned: float, measured: float) -> float | None:
    return planned / measured if measured else None


def _phases(measured: Measured, planned: Mapping[str, int]) -> list[dict]:
    """Each phase of the step (launch.plan.memory.PHASES) that was measured or planned: its peak both ways."""
    got = {p.phase: p for p in measured.phase_peaks}
    out = []
    for phase in PHASES:
        m, want = got.get(phase), planned.get(phase)
        out.append({"phase": phase, "bytes_measured": m.bytes if m else None, "bytes_planned": want,
                    "ratio": _ratio(want, m.bytes) if m and want is not None else None,
                    "by_kind_measured": dict(m.by_kind) if m else {}, "at": m.at if m else ""})
    return out


def compare(measured: Measured, plan: Plan, world_size: int) -> dict:
    """One rehearsed rank in rehearsal.json: each measured figure beside the plan's and planned / measured. The plan's
    FLOPs are per step for the whole job (hardware FLOPs: with recomputation), shared evenly by its ranks."""
    rp = next(r for r in plan.ranks if measured.rank in r.ranks)
    mem = rp.memory[rp.implementation]
    # The tracker sees tensors, not the CUDA context, NCCL's buffers or the allocator's fragmentation: the plan's
    # peak is compared before its allowance, which is stated beside it.
    planned = mem.before_allowance
    flops_planned = plan.step.hardware_flops_per_step / world_size
    planned_calls = calls_by_kind(plan.comm)
    measured_calls = calls_by_kind(measured.collectives)
    return {
        "rank": measured.rank, "role": measured.role,
        "peak_bytes_measured": measured.peak_bytes, "peak_bytes_planned": planned,
        "peak_ratio": _ratio(planned, measured.peak_bytes), "allowance_planned": mem.allowance,
        "peak_by_kind_measured": dict(measured.peak_by_kind),
        "peak_by_kind_planned": {**mem.kinds(), "total": mem.total, "accounting": rp.implementation},
        "peak_at": measured.peak_at, "peak_phase_planned": mem.peak_phase, "tracker": measured.tracker,
        "phases": _phases(measured, mem.phases),
        "flops_measured": measured.flops, "flops_counted": measured.flops_counted,
        "flops_attention_formula": measured.flops_attention, "attention_note": measured.attention_note,
        "flops_planned": flops_planned, "flops_ratio": _ratio(flops_planned, measured.flops),
        "collectives_measured": measured_calls, "collectives_planned": planned_calls,
        "collectives_equal": measured_calls == planned_calls,
        "collective_messages_measured": [asdict(c) for c in measured.collectives],
        "collective_messages_planned": _planned_messages(plan),
        "micro_batches_run": measured.micro_batches_run, "micro_batches_per_step": measured.micro_batches_per_step,
        "optimizer": measured.optimizer, "seconds": measured.seconds,
    }


def rehearsal_record(recipe: str, plan: Plan, world_size: int, ranks: list[Measured], seconds: float,
                     notes: list[str]) -> dict:
    """rehearsal.json: `notes`, what the plan counts that the rehearsal measures otherwise (DDP_BUCKETS)."""
    return {"schema": SCHEMA, "recipe": recipe, "backend": plan.backend, "hardware": plan.hardware,
            "grid": dict(plan.grid), "world_size": world_size, "seconds": seconds, "method": METHOD,
            "notes": notes, "ranks": [compare(m, plan, world_size) for m in ranks]}


def is_our_rehearsal(folder: Path) -> bool:
    """Whether `folder` is a rehearsal directory this project wrote: its rehearsal.json carries SCHEMA."""
    doc = inputs.load_json(folder / REHEARSAL)
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


@dataclass(frozen=True)
class RehearsedPeak:
    """A recipe's worst rank as recorded in recipes/rehearsed.json."""

    peak_bytes: int
    role: str
    measured: str  # when (UTC)
    versions: str  # torch's and transformers'


def recorded_peaks(path: Path) -> dict[str, RehearsedPeak]:
    """recipe name -> its worst rehearsed rank, from the catalogue's record (none where the file is absent); a record
    that cannot be read is refused in one line naming it and how to write it again."""
    if not path.is_file():
        return {}
    fix = "write it again: python bench/rehearse_catalogue.py (or restore it from git)"
    try:
        d = inputs.parse_json_object(path, context=str(path), field="(file)")
    except ConfigError as e:  # the record is ours: its fix is to write it again, whatever the damage
        raise ConfigError(e.file, e.field, e.value, e.problem, fix) from None
    try:
        if d.get("schema") != CATALOGUE_SCHEMA:
            raise ConfigError(str(path), "schema", d.get("schema"), f"is not a {CATALOGUE_SCHEMA!r} record", fix)
        out = {}
        for name, rec in d["recipes"].items():
            worst = max(rec["ranks"], key=lambda r: r["peak_bytes"])
            if not isinstance(worst["peak_bytes"], int) or worst["peak_bytes"] <= 0:
                raise ConfigError(str(path), f"recipes.{name}.ranks.peak_bytes", worst["peak_bytes"],
                                  "is not a positive whole number of bytes", fix)
            out[name] = RehearsedPeak(worst["peak_bytes"], worst["role"], rec["measured"], rec["versions"])
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(str(path), "(the file)", type(e).__name__, f"cannot be read: {e}", fix) from None
