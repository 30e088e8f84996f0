"""The per-rank metrics records: the one module that writes `metrics/rank{R}.jsonl` and reads it back.

Both backends write through `MetricsWriter`; analysis reads through `read_metrics`. The first record
is `meta`; every following record is one optimizer step. Stdout is for humans: nothing parses it.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1
FLOPS_FORMULA = ("6 × non-embedding parameters (lm_head included) + 12 · layers · heads · head_dim · seq_len "
                 "per token (torchtitan's count); model FLOPs, recomputation not counted")


@dataclass(frozen=True)
class MetaRecord:
    schema_version: int
    rank: int
    world: int
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
    kind: str = "step"


_META_FIELDS = {f.name for f in fields(MetaRecord)}
_STEP_FIELDS = {f.name for f in fields(StepRecord)}
_REQUIRED_STEP = {f.name for f in fields(StepRecord) if f.default is MISSING}


class MetricsWriter:
    """Appends one JSON line per record and flushes it, so a killed run leaves every finished step readable."""

    def __init__(self, path: Path, meta: MetaRecord) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self._write(asdict(meta))

    def step(self, record: StepRecord) -> None:
        self._write(asdict(record))

    def _write(self, d: dict[str, Any]) -> None:
        self._f.write(json.dumps(d, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricsError(ValueError):
    pass


def validate(record: dict[str, Any]) -> None:
    """Raise MetricsError when a record does not follow this schema version."""
    kind = record.get("kind")
    if kind == "meta":
        missing = _META_FIELDS - set(record)
        extra = set(record) - _META_FIELDS
        if record.get("schema_version") != SCHEMA_VERSION:
            raise MetricsError(f"meta.schema_version={record.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    elif kind == "step":
        missing = _REQUIRED_STEP - set(record)
        extra = set(record) - _STEP_FIELDS
    else:
        raise MetricsError(f"kind={kind!r} is neither 'meta' nor 'step'")
    if missing or extra:
        raise MetricsError(f"{kind} record: missing {sorted(missing)}, unknown {sorted(extra)}")
    numeric = ("loss", "lr", "step_time_s", "tokens_per_s", "mfu") if kind == "step" else ("world", "tp", "dp")
    for k in numeric:
        if not isinstance(record[k], (int, float)) or isinstance(record[k], bool):
            raise MetricsError(f"{kind}.{k}={record[k]!r} is not a number")


@dataclass(frozen=True)
class Metrics:
    path: str
    meta: MetaRecord | None
    steps: tuple[StepRecord, ...]
    warnings: tuple[str, ...]


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
            try:
                validate(rec)
            except MetricsError as e:
                yield n, None, f"{path}:{n}: {e}"
                continue
            yield n, rec, None


def read_metrics(path: str | Path) -> Metrics:
    path = Path(path)
    meta = None
    steps: list[StepRecord] = []
    warnings: list[str] = []
    for _, rec, problem in iter_records(path):
        if problem:
            warnings.append(problem)
        elif rec["kind"] == "meta":
            # A resumed run (or a group restarted by torchrun) appends a new meta record: the later steps belong
            # to it, and steps recorded after its checkpoint were trained again, so the new records replace them.
            meta = MetaRecord(**rec)
            if isinstance(meta.start_step, int):
                steps = [s for s in steps if s.step <= meta.start_step]
        else:
            steps.append(StepRecord(**rec))
    if meta is None:
        warnings.append(f"{path}: no meta record")
    return Metrics(str(path), meta, tuple(steps), tuple(warnings))
