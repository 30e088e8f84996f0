"""The per-rank metrics records: the one module that writes `metrics/rank{R}.jsonl` and reads it back.

Both backends write through `MetricsWriter`; analysis reads through `read_metrics`. The first record
is `meta`; every following record is one optimizer step. Stdout is for humans: nothing parses it.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Sequence

from launch import sense

SCHEMA_VERSION = 2
# Version 1 named the meta record's world size `world`; it is read as version 2 (the only difference).
_RENAMED_SINCE = {1: {"world": "world_size"}}
FLOPS_FORMULA = ("6 × non-embedding parameters (lm_head included) + 12 · layers · heads · head_dim · seq_len "
                 "per token (torchtitan's count); model FLOPs, recomputation not counted")
FLOPS_FORMULA_ADAPTERS = ("4 × non-embedding parameters (lm_head included: the frozen matmuls' forward and input "
                          "gradient, no weight gradient) + 6 × adapter parameters + 12 · layers · heads · head_dim · "
                          "seq_len per token; the FLOPs a [peft] fine-tune does, recomputation not counted")
# Each count in a few words, where a line has no room for the whole formula
FLOPS_SHORT = {FLOPS_FORMULA: "6·N + 12·L·h·s per token, torchtitan's",
               FLOPS_FORMULA_ADAPTERS: "4·N + 6·adapters + 12·L·h·s per token, a fine-tune's"}


def flops_formula(adapted: bool) -> str:
    """The count a run's FLOPs per token follow: a fine-tune's ([peft] adapters) or full training's."""
    return FLOPS_FORMULA_ADAPTERS if adapted else FLOPS_FORMULA


@dataclass(frozen=True)
class MetaRecord:
    schema_version: int
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    recipe: str
    backend: str
    hardware_profile: str
    device: str  # "cuda" | "cpu"
    peak_flops_per_device: float
    flops_per_token: float
    flops_formula: str
    tokens_per_step: int
    warmup_steps: int
    zero_stage: int
    dtype: str
    micro_batch_size: int
    global_batch_size: int
    seq_len: int
    param_numel_local: int  # parameter elements this rank holds (its TP shard; under ZeRO-3 its partition)
    start_step: int  # > 0 when the run resumed from a checkpoint
    resumed_from: str | None
    # seconds from the rank's start (its logs opened) to its first step: process group, model build, checkpoint load;
    # None in runs recorded before it was
    startup_s: float | None = None
    # the whole model's parameters that train and that stay frozen ([peft]: the adapters and the base; otherwise every
    # parameter trains); None in runs recorded before they were
    trainable_params: int | None = None
    frozen_params: int | None = None
    kind: str = "meta"


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based optimizer step
    warmup: bool  # excluded from measured statistics
    loss: float  # mean over data-parallel ranks: the same number on every rank
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float
    mem_max_allocated_bytes: int | None = None  # GPU
    mem_max_reserved_bytes: int | None = None  # GPU
    rss_max_bytes: int | None = None  # CPU ranks: peak resident set of the process
    tokens: int | None = None  # tokens the step trained on, over all data-parallel ranks (packed rows: no padding)
    data_time_s: float | None = None  # this rank's time making its micro-batches, inside step_time_s
    valid_loss: float | None = None  # mean loss over the validation rows, on evaluation steps (train.eval_every)
    # fp16 with dynamic loss scaling (backend "torch"): the scale the step's loss was multiplied by, and whether its
    # scaled gradients overflowed, so that the optimizer step was skipped (parameters unchanged) and the scale halved;
    # None otherwise
    loss_scale: float | None = None
    skipped_step: bool | None = None
    kind: str = "step"


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint save, written after the record of the step it follows."""

    step: int  # the optimizer steps the checkpoint holds
    asynchronous: bool  # run.checkpoint_async: the files were written behind training
    # Seconds training stood still for it on this rank: the whole save and its completion marker, or asynchronously
    # only the copy of the state to host memory (and the wait for the previous save, when it had not finished)
    blocked_s: float
    kind: str = "checkpoint"


_META_FIELDS = {f.name for f in fields(MetaRecord)}
_REQUIRED_META = {f.name for f in fields(MetaRecord) if f.default is MISSING}
_STEP_FIELDS = {f.name for f in fields(StepRecord)}
_REQUIRED_STEP = {f.name for f in fields(StepRecord) if f.default is MISSING}
_CHECKPOINT_FIELDS = {f.name for f in fields(CheckpointRecord)}


class MetricsWriter:
    """Appends one JSON line per record and flushes it, so a killed run leaves every finished step readable."""

    def __init__(self, path: Path, meta: MetaRecord) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self._write(asdict(meta))

    def step(self, record: StepRecord) -> None:
        self._write(asdict(record))

    def checkpoint(self, record: CheckpointRecord) -> None:
        self._write(asdict(record))

    def _write(self, d: dict[str, Any]) -> None:
        self._f.write(json.dumps(d, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricsError(ValueError):
    pass


def _field_types(cls) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Field -> (accepted JSON types, whether null is allowed), from the record's annotations: the schema's one
    statement of its types."""
    out = {}
    for f in fields(cls):
        names = [t.strip() for t in str(f.type).split("|")]
        types: tuple[type, ...] = ()
        for n in names:
            types += {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}.get(n, ())
        out[f.name] = (types, "None" in names)
    return out


_META_TYPES = _field_types(MetaRecord)
_STEP_TYPES = _field_types(StepRecord)
_TYPES = {"meta": _META_TYPES, "step": _STEP_TYPES, "checkpoint": _field_types(CheckpointRecord)}
# Physical sense: a step is counted from 1 and takes time; a rank, a size or a count is never negative.
_POSITIVE = {"step": ("step", "step_time_s"), "meta": ("world_size", "tp", "dp", "tokens_per_step", "micro_batch_size",
                                                     "global_batch_size", "seq_len"), "checkpoint": ("step",)}
_NON_NEGATIVE = {"step": ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu",
                          "mem_max_allocated_bytes", "mem_max_reserved_bytes", "rss_max_bytes", "tokens", "data_time_s",
                          "loss_scale"),
                 "meta": ("rank", "pp", "start_step", "warmup_steps", "zero_stage", "param_numel_local",
                          "peak_flops_per_device", "flops_per_token", "startup_s", "trainable_params",
                          "frozen_params"),
                 "checkpoint": ("blocked_s",)}

_DURATIONS = {"step": ("step_time_s",), "checkpoint": ("blocked_s",), "meta": ("startup_s",)}  # a week at most
_FIGURES = {"step": ("loss", "lr", "grad_norm", "valid_loss"), "meta": (), "checkpoint": ()}


def current(record: Any) -> Any:
    """A meta record of an earlier schema version in this version's names (in place); anything else as it is."""
    if not (isinstance(record, dict) and record.get("kind") == "meta"):
        return record
    # an int only: a damaged record's list would raise TypeError in the lookup (unhashable); validate() then names it
    if type(record.get("schema_version")) is int and record["schema_version"] in _RENAMED_SINCE:
        for old, new in _RENAMED_SINCE[record["schema_version"]].items():
            if old in record and new not in record:
                record[new] = record.pop(old)
        record["schema_version"] = SCHEMA_VERSION
    return record


def validate(record: Any) -> None:
    """Raise MetricsError when a record does not follow this schema version: a JSON object of the record's
    fields, each of its type, with figures that make physical sense (a step takes a positive, finite time)."""
    if not isinstance(record, dict):
        raise MetricsError(f"a {type(record).__name__} where a record (a JSON object) belongs")
    kind = record.get("kind")
    if kind == "meta":
        missing = _REQUIRED_META - set(record)
        extra = set(record) - _META_FIELDS
        if record.get("schema_version") != SCHEMA_VERSION:
            raise MetricsError(f"meta.schema_version={record.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    elif kind == "step":
        missing = _REQUIRED_STEP - set(record)
        extra = set(record) - _STEP_FIELDS
    elif kind == "checkpoint":
        missing = _CHECKPOINT_FIELDS - set(record)
        extra = set(record) - _CHECKPOINT_FIELDS
    else:
        raise MetricsError(f"kind={kind!r} is none of 'meta', 'step', 'checkpoint'")
    if missing or extra:
        raise MetricsError(f"{kind} record: missing {sorted(missing)}, unknown {sorted(extra)}")
    for k, (types, nullable) in _TYPES[kind].items():
        v = record.get(k)
        if k == "kind" or (v is None and nullable):
            continue
        if not types or not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise MetricsError(f"{kind}.{k}={_short(v)} is not {' or '.join(t.__name__ for t in types) or 'known'}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= sense.COUNT_LIMIT:
            raise MetricsError(f"{kind}.{k}={_short(v)} is out of range")
    for k in _POSITIVE[kind]:
        v = record[k]
        if not (v > 0 and math.isfinite(v)):
            raise MetricsError(f"{kind}.{k}={_short(v)} is not a positive, finite number")
    for k in _DURATIONS[kind]:  # a negative or NaN one is the non-negative check's, below
        v = record.get(k)
        if v is not None and v >= 0 and not sense.is_duration_s(v):
            raise MetricsError(f"{kind}.{k}={_short(v)} is longer than a week")
    for k in _FIGURES[kind]:
        v = record.get(k)
        if isinstance(v, float) and not sense.is_figure(v):
            raise MetricsError(f"{kind}.{k}={_short(v)} is finite but past float32's range")
    for k in _NON_NEGATIVE[kind]:
        v = record.get(k)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise MetricsError(f"{kind}.{k}={_short(v)} is negative or not finite")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Metrics:
    path: str
    meta: MetaRecord | None
    steps: tuple[StepRecord, ...]
    warnings: tuple[str, ...]
    checkpoints: tuple[CheckpointRecord, ...] = ()


def iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, record or None, problem or None) for each line; never raises on bad content."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, None, f"{path}:{n}: not JSON ({e.msg}); a run killed mid-write leaves a cut last line"
                continue
            except (ValueError, RecursionError) as e:  # an integer past 4,300 digits, nesting past the stack
                yield n, None, f"{path}:{n}: not a record ({type(e).__name__}: {str(e)[:80]})"
                continue
            try:
                validate(current(rec))
            except MetricsError as e:
                yield n, None, f"{path}:{n}: {e}"
                continue
            yield n, rec, None


def read_metrics(path: str | Path) -> Metrics:
    path = Path(path)
    meta = None
    steps: list[StepRecord] = []
    saves: list[CheckpointRecord] = []
    warnings: list[str] = []
    for _, rec, problem in iter_records(path):
        if problem:
            warnings.append(problem)
        elif rec["kind"] == "checkpoint":
            saves.append(CheckpointRecord(**rec))
        elif rec["kind"] == "meta":
            # A resumed run (or a group restarted by torchrun) appends a new meta record: the later steps belong
            # to it, and steps recorded after its checkpoint were trained again, so the new records replace them.
            meta = MetaRecord(**rec)
            if isinstance(meta.start_step, int):
                steps = [s for s in steps if s.step <= meta.start_step]
                saves = [c for c in saves if c.step <= meta.start_step]  # saved again after the restart
        else:
            steps.append(StepRecord(**rec))
    if meta is None:
        warnings.append(f"{path}: no meta record")
    return Metrics(str(path), meta, tuple(steps), tuple(warnings), tuple(saves))


def measured_step_times(ranks: Sequence[Metrics]) -> list[float]:
    """Each measured step's time, in step order, as the report counts it: warm-up steps left out, and a step taking
    as long as its slowest rank (a synchronous step ends when its last rank does)."""
    slowest: dict[int, float] = {}
    for m in ranks:
        for s in m.steps:
            if not s.warmup:
                slowest[s.step] = max(slowest.get(s.step, 0.0), s.step_time_s)
    return [slowest[k] for k in sorted(slowest)]
