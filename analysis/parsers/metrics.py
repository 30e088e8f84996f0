"""Read our own per-rank metrics JSONL (`metrics/rank{R}.jsonl`, all ranks of a run) into one table.

The schema belongs to `launch.run.metrics`, which writes these files and reads them back; this module
only stacks its records into a `Table`, one row per (rank, optimizer step). A run killed mid-write
leaves a cut last line: that line is skipped with a warning naming the file and line, and every
finished step before it is kept.

A file that is not UTF-8 (UTF-16 from an editor, stray bytes) is said to be so; a line that is not a record
(garbage, a damaged meta record) is skipped with a warning naming the file and line; a figure outside physical
sense (launch/sense.py: a FLOP rate above 100 PFLOP/s, an MFU above 1) is dropped from its row, counted.

`Table.meta` (MetricsMeta): `ranks` ({rank: the rank's meta record as a dict, plus `file`}), `files`, and the
fields every rank agrees on (recipe, backend, world_size, tp, pp, dp, zero_stage, dtype,
micro_batch_size, global_batch_size, seq_len, tokens_per_step, warmup_steps, flops_per_token,
flops_formula, peak_flops_per_device, hardware_profile, device, trainable_params, frozen_params); a field the ranks
disagree on is left out and named in a warning, and a rank without the field (a run recorded before it, or a value
dropped as senseless, said on its own) has no say. A resumed run appends a second meta record to each file; the
steps after it belong to the later one, and `resumes` counts them.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from analysis.parsers._text import SNIFF_BYTES, wide_encoding
from analysis.table import Table
from launch import sense
from launch.run.metrics import (
    SCHEMA_VERSION,
    StepRecord,
    current,
    iter_records,
    validate,
)

_DOCS: dict[str, str] = {
    "rank": "trainer rank (the meta record's rank; without one, the N of rankN in the file name)",
    "step": "1-based optimizer step",
    "warmup": "True for the run's warm-up steps (train.warmup_steps), which the trainer marks as excluded "
              "from measured statistics",
    "loss": "training loss, mean over data-parallel ranks (the same number on every rank)",
    "lr": "learning rate used for the step",
    "grad_norm": "global gradient norm before clipping; None when the backend reports none",
    "step_time_s": "wall time of the optimizer step on this rank, seconds (device synchronised before and after)",
    "tokens_per_s": "tokens of the global batch / step_time_s",
    "tokens_per_s_per_device": "tokens_per_s / world size",
    "tflops_per_device": "model TFLOP/s per device: flops_per_token × tokens / step_time_s / world / 1e12 "
                         "(meta flops_formula)",
    "mfu": "tflops_per_device × 1e12 / peak_flops_per_device (meta), a fraction",
    "mem_max_allocated_bytes": "GPU ranks: torch.cuda.max_memory_allocated() so far, bytes; None on CPU",
    "mem_max_reserved_bytes": "GPU ranks: torch.cuda.max_memory_reserved() so far, bytes; None on CPU",
    "rss_max_bytes": "CPU ranks: peak resident set size of the rank's process so far, bytes; None on GPU",
    "tokens": "tokens the step trained on over all data-parallel ranks (packed rows, no padding); None in older runs",
    "data_time_s": "this rank's seconds making its micro-batches, inside step_time_s; None in older runs",
    "valid_loss": "mean loss over the validation rows on evaluation steps (train.eval_every), else None",
    "file": "the JSONL file the row came from",
    "line": "1-based line of the record in that file",
}

# The step record's fields come from launch.run.metrics.StepRecord, their one home: a field added there is read here
# (documented by its name until _DOCS says more), never dropped.
_STEP_FIELDS = [f.name for f in fields(StepRecord) if f.name != "kind"]
COLUMNS: dict[str, str] = {"rank": _DOCS["rank"],
                           **{c: _DOCS.get(c, f"StepRecord.{c} (launch/run/metrics.py)") for c in _STEP_FIELDS},
                           "file": _DOCS["file"], "line": _DOCS["line"]}
_SHARED_META = ("recipe", "backend", "world_size", "tp", "pp", "dp", "zero_stage", "dtype", "micro_batch_size",
                "global_batch_size", "seq_len", "tokens_per_step", "warmup_steps", "flops_per_token",
                "flops_formula", "peak_flops_per_device", "hardware_profile", "device", "trainable_params",
                "frozen_params")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_SNIFF_LINES = 5
# Damaged lines named one by one in a file; the rest are counted (a binary blob where a rank's metrics belong has
# thousands).
_LINE_WARNINGS = 10


class MetricsMeta(NamedTuple):
    """Table.meta of the `metrics` table (parse_metrics). The run facts (recipe ... device) are the meta record's
    fields (launch.run.metrics.MetaRecord) that every rank agrees on; None where the ranks disagree (a warning
    says on what) or no rank has a meta record."""

    ranks: dict[Any, dict[str, Any]]  # {rank: that rank's meta record as a dict (less `kind`), plus `file`}
    files: list[str]  # the metrics files read, as displayed
    resumes: int  # meta records after each file's first: the times the run resumed
    schema_version: int  # the metrics schema this reader knows (launch.run.metrics.SCHEMA_VERSION)
    recipe: str | None = None  # the recipe name
    backend: str | None = None  # deepspeed | megatron | ...
    world_size: int | None = None  # ranks in the run
    tp: int | None = None  # tensor-parallel size
    pp: int | None = None  # pipeline-parallel size
    dp: int | None = None  # data-parallel size
    zero_stage: int | None = None  # ZeRO stage
    dtype: str | None = None  # training dtype
    micro_batch_size: int | None = None  # samples per micro-batch
    global_batch_size: int | None = None  # samples per optimizer step
    seq_len: int | None = None  # tokens per sample
    tokens_per_step: int | None = None  # tokens per optimizer step
    warmup_steps: int | None = None  # the steps the trainer marks warmup=true
    flops_per_token: float | None = None  # model FLOPs per token (flops_formula)
    flops_formula: str | None = None  # how flops_per_token was counted
    peak_flops_per_device: float | None = None  # the hardware profile's peak FLOP/s for dtype (MFU's denominator)
    hardware_profile: str | None = None  # the hardware profile's name
    device: str | None = None  # "cuda" | "cpu"
    # the whole model's parameters that train and that stay frozen ([peft]: the adapters and the base); None in runs
    # recorded before the meta record held them
    trainable_params: int | None = None
    frozen_params: int | None = None
    # every rank's checkpoint saves (launch.run.metrics.CheckpointRecord as a dict, plus its rank), in file order
    checkpoints: tuple[dict[str, Any], ...] = ()


def sniff(path: str | os.PathLike[str]) -> str | None:
    """'metrics_jsonl' when one of the file's first lines is a record of our metrics schema, else None.

    Judged by content: one of the first non-empty lines must be a JSON object that `launch.run.metrics.validate`
    accepts (a meta record, or a step record). Not only the first: a garbage line or a damaged meta record before
    the records would otherwise hide the whole file, where the reader skips that line with a warning naming it.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return None
    lines = [line for line in (raw.strip() for raw in head.split(b"\n")) if line][:_SNIFF_LINES]
    for line in lines:
        if not line.startswith(b"{"):
            continue
        try:
            validate(current(json.loads(line.decode("utf-8", "replace"))))  # an earlier schema version is ours too
        except (ValueError, RecursionError):  # not JSON (MetricsError is a ValueError too), or nested past the stack
            continue
        return "metrics_jsonl"
    return None


def metrics_files(path: str | os.PathLike[str]) -> list[Path]:
    """The metrics files of a run directory, a metrics/ folder or a single file, chosen by content."""
    p = Path(path)
    if p.is_file():
        return [p]
    folder = p / "metrics" if (p / "metrics").is_dir() else p
    return sorted(f for f in folder.iterdir() if f.is_file() and sniff(f))


def parse_metrics(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
                  relative_to: str | os.PathLike[str] | None = None) -> Table:
    """Stack the metrics JSONL of every rank into the `metrics` table (COLUMNS).

    `paths`: a run directory, its metrics/ folder, one file, or a list of files. `relative_to`
    shortens the file names written in the `file` column and in warnings. Never raises on content.
    """
    if isinstance(paths, (str, os.PathLike)):
        files = metrics_files(paths)
    else:
        files = [Path(p) for p in paths]
    base = Path(relative_to) if relative_to is not None else None
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    ranks: dict[Any, dict[str, Any]] = {}
    resumes = 0
    saves: list[dict[str, Any]] = []
    for f in files:
        name = _display(f, base)
        records = _records(f, name, warnings)
        if records is None:
            continue
        read = _file_rows(f, name, records, warnings)
        rows.extend(read.rows)
        saves.extend(read.checkpoints)
        meta = read.meta
        if meta is None:
            warnings.append(f"{name}: no meta record; rank taken from the file name, run facts unknown")
            continue
        resumes += max(0, read.metas - 1)
        rank = meta["rank"]
        if rank in ranks:
            warnings.append(f"{name}: rank {rank} also in {ranks[rank]['file']}; their steps are pooled")
        facts = {k: v for k, v in meta.items() if k != "kind"}
        warnings.extend(sense.clean([facts], f"{name} meta record", flop_per_s=("peak_flops_per_device",)))
        ranks[rank] = {**facts, "file": name}
    if not files:
        warnings.append(f"{_display(Path(paths), base) if isinstance(paths, (str, os.PathLike)) else 'metrics'}: "
                        f"no metrics JSONL found")
    shared = _shared_meta(ranks, warnings)
    rows.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["step"] or 0))
    meta_out = MetricsMeta(**shared, ranks=ranks, files=[_display(f, base) for f in files], resumes=resumes,
                           schema_version=SCHEMA_VERSION, checkpoints=tuple(saves))
    return Table.from_rows("metrics", COLUMNS, rows, source=", ".join(meta_out.files), warnings=warnings,
                           meta=meta_out)


def _records(f: Path, name: str, warnings: list[str]) -> list[tuple[int, Any, str | None]] | None:
    """The records of one metrics file as launch.run.metrics.iter_records reads them (line, record, problem), the
    ones before a read error kept; None when nothing of the file can be read. Appends what went wrong to
    `warnings`."""
    try:
        text_problem, unreadable = _text_problem(f, name)
    except OSError as exc:
        warnings.append(f"{name}: cannot read ({exc.strerror or exc})")
        return None
    if text_problem:
        warnings.append(text_problem)
    if unreadable:
        return None
    records: list[tuple[int, Any, str | None]] = []
    try:
        for record in iter_records(f):
            records.append(record)
    except OSError as exc:
        warnings.append(f"{name}: cannot be read past line {records[-1][0] if records else 0} "
                        f"({exc.strerror or exc})")
    except (TypeError, AttributeError) as exc:
        # launch.run.metrics' reader raised on a record instead of naming it (a list for a meta record's
        # schema_version is unhashable in its `current`): the records before it are kept, and it is said.
        warnings.append(f"{name}: a record after line {records[-1][0] if records else 0} cannot be read "
                        f"({type(exc).__name__}: {exc}); the rest of the file is left out")
    return records


@dataclass(frozen=True)
class _FileRows:
    """One metrics file's step rows and its meta records."""

    rows: list[dict[str, Any]]
    meta: dict[str, Any] | None  # its last meta record (the run the later steps belong to); None: it has none
    metas: int  # its meta records: 1 + the times the run resumed
    checkpoints: list[dict[str, Any]]  # its checkpoint records (launch.run.metrics.CheckpointRecord), with the rank


def _file_rows(f: Path, name: str, records: list[tuple[int, Any, str | None]], warnings: list[str]) -> _FileRows:
    """The step rows of one file's records (`name`: the file as displayed), damaged lines and figures outside
    physical sense left out, each said in `warnings`."""
    meta: dict[str, Any] | None = None
    metas = 0
    mine: list[dict[str, Any]] = []  # this file's rows: a restart replaces only its own
    saves: list[dict[str, Any]] = []
    damaged = 0
    for lineno, rec, problem in records:
        if problem:
            damaged += 1
            if damaged <= _LINE_WARNINGS:
                warnings.append(problem.replace(str(f), name, 1))
            continue
        if rec["kind"] == "meta":
            meta = rec
            metas += 1
            # A resume or a torchrun restart continues from its checkpoint: the steps this file recorded after
            # it were trained again, and the new records replace them.
            start = rec["start_step"]
            saves = [c for c in saves if c["step"] <= start]  # saved again after the restart, recorded again
            redone = [r for r in mine if r["step"] > start]
            if redone:
                mine = [r for r in mine if r["step"] <= start]
                warnings.append(f"{name}:{lineno}: a resumed run continues from step {start}; the "
                                f"{len(redone)} step(s) recorded after it before the restart are replaced")
            continue
        rank = meta["rank"] if meta is not None else _rank_from_name(f)
        if rec["kind"] == "checkpoint":
            saves.append({**{k: v for k, v in rec.items() if k != "kind"}, "rank": rank})
            continue
        row = {c: rec.get(c) for c in _STEP_FIELDS}
        row.update(rank=rank, file=name, line=lineno)
        mine.append(row)
    if damaged > _LINE_WARNINGS:
        warnings.append(f"{name}: {damaged - _LINE_WARNINGS} more damaged line(s) skipped, not named one by one")
    # The schema (launch.run.metrics.validate) refuses a record whose figure is of the wrong type, negative or not
    # finite, whose count passes 64 bits, whose step lasts over a week or whose loss passes float32; the sense
    # of the other figures' size is launch.sense's, by their units.
    warnings.extend(sense.clean(mine, name, durations_s=("data_time_s",),
                                rates_per_s=("tokens_per_s", "tokens_per_s_per_device"),
                                tflops=("tflops_per_device",), utilisations=("mfu",)))
    return _FileRows(mine, meta, metas, saves)


def _shared_meta(ranks: dict[Any, dict[str, Any]], warnings: list[str]) -> dict[str, Any]:
    """The run facts (_SHARED_META) every rank's meta record that has them agrees on; a warning names each they
    disagree on. A rank without the fact has no say: a run recorded before the field, or a value sense.clean dropped,
    which its own warning names (counting it as a disagreement would say the same thing twice and lose the fact)."""
    shared: dict[str, Any] = {}
    for key in _SHARED_META:
        stated = [m[key] for m in ranks.values() if m.get(key) is not None]
        values = {json.dumps(v) for v in stated}
        if len(values) == 1:
            shared[key] = stated[0]
        elif len(values) > 1:
            warnings.append(f"metrics: ranks disagree on {key} ({', '.join(sorted(values))}); left out of meta")
    return shared


def _text_problem(path: Path, name: str) -> tuple[str | None, bool]:
    """(warning, whether nothing of the file can be read) when `path` is not the UTF-8 launch.run.metrics writes: an
    empty file; UTF-16 or UTF-32 (a byte-order mark: every line would read as garbage, so the file is left out with
    one warning instead of one per line); bytes that are not UTF-8 (the first such line is named: iter_records reads
    them as U+FFFD, silently). (None, False) when the file is UTF-8."""
    with open(path, "rb") as fh:
        head = fh.read(4)
        if not head:
            return f"{name}: empty file: the rank recorded nothing", True
        wide = wide_encoding(head)
        if wide:
            return (f"{name}: {wide} text (it starts with a byte-order mark), not the UTF-8 our trainer writes: not "
                    f"read; convert it back with `iconv -f {wide} -t UTF-8`"), True
        fh.seek(0)
        for lineno, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return (f"{name}:{lineno}: bytes that are not UTF-8 (0x{raw[exc.start]:02x} at column "
                        f"{exc.start + 1}, perhaps more after it), read as U+FFFD"), False
    return None, False


def _rank_from_name(path: Path) -> int | None:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _display(path: Path, base: Path | None) -> str:
    if base is not None:
        try:
            return str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            pass
    return str(path)
