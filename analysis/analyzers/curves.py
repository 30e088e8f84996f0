"""Training curves: loss, gradient norm, learning rate and loss scale per step, from whichever source a run has,
and how closely two runs' loss curves agree.

`curves_from_*` bring each source to one table (CURVE_COLUMNS): our metrics JSONL, Megatron iteration lines,
TensorBoard scalars (ours `train/*`, Megatron's `lm loss` / `learning-rate` / `grad-norm` / `loss-scale`), and
DeepSpeed's own lines (the pipeline engine's averaged loss, the learning rate of `step=` lines). `summarise`
and `compare` compute what the report shows; nothing here renders.

Comparing layouts is comparing curves: two layouts of one model at the same global batch, sequence length and
seed see the same data, so their losses should agree step by step up to floating-point reordering; a gap says
that one of them trains differently. `comparable` checks what the layouts state (global batch and sequence
length); the model and seed are the user's to hold equal (our sweep refuses a set where they differ).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from analysis.analyzers._numbers import finite
from analysis.analyzers.run_layout import RunLayout
from analysis.table import Table

CURVE_COLUMNS = {
    "step": "optimizer step / iteration number as recorded",
    "loss": "training loss (ours: the mean over data-parallel ranks; Megatron: `lm loss`, averaged over its "
            "logging interval; DeepSpeed pipeline: its averaged loss)",
    "grad_norm": "gradient norm before clipping (None where the source has none)",
    "lr": "learning rate",
    "loss_scale": "fp16 loss scale (None where the source has none)",
    "valid_loss": "validation loss on evaluation steps (ours: data.valid_fraction / data.valid_path; Megatron's "
                  "TensorBoard `lm loss validation`), else None",
    "skipped": "iterations skipped in the logging interval (Megatron), 1 or 0 per step (our fp16 metrics), else None",
    "source": "file:line (or TensorBoard run/file) of the record",
}

# TensorBoard tags (ours and Megatron's) and the column each holds.
TB_TAGS = {"train/loss": "loss", "lm loss": "loss", "train/lr": "lr", "learning-rate": "lr",
           "train/grad_norm": "grad_norm", "grad-norm": "grad_norm", "loss-scale": "loss_scale",
           "valid/loss": "valid_loss", "lm loss validation": "valid_loss"}


class CurvesMeta(NamedTuple):
    """Table.meta of a `curves` table."""

    not_finite_loss: int  # steps whose loss was NaN or infinite in the source (left out of the curve)


def _row(step: Any, source: str, **values: Any) -> dict[str, Any]:
    row = {c: None for c in CURVE_COLUMNS}
    row.update({k: finite(v) if k != "skipped" else v for k, v in values.items()}, step=step, source=source)
    row["_bad_loss"] = isinstance(values.get("loss"), float) and not math.isfinite(values["loss"])
    return row


def _table(rows: Iterable[dict[str, Any]], source: str, warnings: Iterable[str] = ()) -> Table:
    """Rows with an integer step, in step order; a NaN or infinite loss is kept as None and counted
    (meta.not_finite_loss, and a warning)."""
    kept = sorted((r for r in rows if isinstance(r["step"], int) and not isinstance(r["step"], bool)),
                  key=lambda r: r["step"])
    bad = [r["step"] for r in kept if r["_bad_loss"]]
    warnings = list(warnings)
    if bad:
        warnings.append(f"{source}: {len(bad)} step(s) with a NaN or infinite loss (first at step {bad[0]}), "
                        "left out of the curve")
    return Table.from_rows("curves", CURVE_COLUMNS, kept, source=source, warnings=warnings,
                           meta=CurvesMeta(not_finite_loss=len(bad)))


def curves_from_metrics(metrics: Table) -> Table:
    """Our metrics: one row per step from the lowest rank (every rank records the same data-parallel mean)."""
    rows = list(metrics.rows())
    low = min((r["rank"] for r in rows if isinstance(r["rank"], int)), default=None)
    return _table((_row(r["step"], f"{r['file']}:{r['line']}", loss=r["loss"], grad_norm=r["grad_norm"], lr=r["lr"],
                        valid_loss=r["valid_loss"], loss_scale=r["loss_scale"],
                        skipped=int(r["skipped_step"]) if isinstance(r["skipped_step"], bool) else None)
                   for r in rows if r["rank"] == low), metrics.source, metrics.warnings)


def curves_from_megatron(log: Table) -> Table:
    return _table((_row(r["iteration"], f"{log.source}:{r['line']}", loss=r["lm_loss"], grad_norm=r["grad_norm"],
                        lr=r["learning_rate"], loss_scale=r["loss_scale"], skipped=r["skipped_iterations"])
                   for r in log.rows() if r["kind"] == "iteration"), log.source, log.warnings)


def curves_from_tensorboard(tb: Table) -> Table:
    by_step: dict[int, dict[str, Any]] = {}
    for r in tb.rows():
        col = TB_TAGS.get(r["tag"])
        if col is None or r["step"] is None:  # a step dropped as senseless places the value nowhere
            continue
        row = by_step.setdefault(r["step"], _row(r["step"], f"{tb.source}: {r['run']}/{r['file']}"))
        row[col] = finite(r["value"])
        if col == "loss" and isinstance(r["value"], float) and not math.isfinite(r["value"]):
            row["_bad_loss"] = True
    return _table(by_step.values(), tb.source, tb.warnings)


def curves_from_deepspeed(log: Table) -> Table:
    by_step: dict[int, dict[str, Any]] = {}
    for r in log.rows():
        if r["kind"] == "pipe_step" and r["step"] is not None:
            row = by_step.setdefault(r["step"], _row(r["step"], f"{log.source}:{r['line']}"))
            row["loss"] = finite(r["loss"])
            row["_bad_loss"] = isinstance(r["loss"], float) and not math.isfinite(r["loss"])
        elif r["kind"] == "step" and r["step"] is not None and r.get("lr") is not None:
            by_step.setdefault(r["step"], _row(r["step"], f"{log.source}:{r['line']}"))["lr"] = finite(r["lr"])
    return _table(by_step.values(), log.source, log.warnings)


@dataclass(frozen=True)
class ValidationPoint:
    iteration: int | None
    what: str | None  # e.g. "on 122880-sample draw from validation set"; None when the line says no more
    loss: float | None  # `lm loss value`
    ppl: float | None  # `lm loss PPL` as printed
    source: str


def validation_points(log: Table) -> list[ValidationPoint]:
    """Megatron's validation / test lines: `validation loss at iteration N | lm loss value: x | lm loss PPL: y |`."""
    out = []
    for r in log.rows():
        if r["kind"] != "validation":
            continue
        ppl = next((v for k, v in (r["extra"] or {}).items() if " ".join(k.lower().split()) == "lm loss ppl"), None)
        out.append(ValidationPoint(r["iteration"], r["name"], finite(r["lm_loss"]), finite(ppl),
                                   f"{log.source}:{r['line']}"))
    return out


@dataclass(frozen=True)
class CurveSummary:
    steps: int  # rows with a step
    first_step: int | None
    last_step: int | None
    loss_first: float | None
    loss_last: float | None
    loss_min: float | None
    grad_norm_last: float | None
    grad_norm_max: float | None
    lr_first: float | None
    lr_last: float | None
    lr_max: float | None
    loss_scale_last: float | None
    skipped: int | None  # iterations skipped, summed over the logging intervals
    not_finite: int  # steps whose loss was NaN or infinite in the source (left out of the curve)


def _values(curves: Table, col: str) -> list[float]:
    return [v for v in curves.columns[col] if v is not None]


def summarise(curves: Table) -> CurveSummary:
    steps = list(curves.columns["step"])
    loss, gn, lr, ls = (_values(curves, c) for c in ("loss", "grad_norm", "lr", "loss_scale"))
    skipped = [v for v in curves.columns["skipped"] if isinstance(v, int)]
    bad = int(curves.meta.not_finite_loss)
    return CurveSummary(len(steps), steps[0] if steps else None, steps[-1] if steps else None,
                        loss[0] if loss else None, loss[-1] if loss else None, min(loss) if loss else None,
                        gn[-1] if gn else None, max(gn) if gn else None, lr[0] if lr else None,
                        lr[-1] if lr else None, max(lr) if lr else None, ls[-1] if ls else None, sum(skipped) if skipped else None, bad)


@dataclass(frozen=True)
class CurveComparison:
    common_steps: int
    max_abs_diff: float | None  # largest |loss_a - loss_b| over the steps both logged
    max_rel_diff: float | None  # that difference over |loss_a| at the same step, the largest over steps
    at_step: int | None  # where the largest absolute difference is
    mean_abs_diff: float | None


def compare(a: Table, b: Table) -> CurveComparison:
    """Loss against loss at the steps both curves logged."""
    la = {s: v for s, v in zip(a.columns["step"], a.columns["loss"], strict=True) if v is not None}
    lb = {s: v for s, v in zip(b.columns["step"], b.columns["loss"], strict=True) if v is not None}
    common = sorted(set(la) & set(lb))
    if not common:
        return CurveComparison(0, None, None, None, None)
    diffs = [(abs(la[s] - lb[s]), s) for s in common]
    worst, at = max(diffs)
    rel = max((d / abs(la[s]) for d, s in diffs if la[s]), default=None)
    return CurveComparison(len(common), worst, rel, at, sum(d for d, _ in diffs) / len(diffs))


# What two runs must share for their curves to agree step by step, each with the word the report says it in.
AGREE_WHEN_SAME = {"model": "model", "dtype": "precision", "global_batch_size": "batch", "seq_len": "sequence",
                   "steps": "steps", "lr": "schedule", "lr_warmup_steps": "schedule", "lr_schedule": "schedule",
                   "seed": "seed", "data": "data", "corpus": "corpus", "tokenizer": "tokenizer"}
_WORDS = list(dict.fromkeys(AGREE_WHEN_SAME.values()))
AGREE_SUMMARY = f"same {', '.join(_WORDS[:-1])} and {_WORDS[-1]}"  # said when none of them differs


def comparable(layout_a: RunLayout, layout_b: RunLayout) -> str:
    """Why two runs' curves should not be expected to agree ('' when they should: the same model, precision, global
    batch, sequence length, step count (the schedule's length), learning rate, warm-up, schedule, seed, data source,
    corpus content and tokenizer, as far as the layouts say; a fact one of them does not state is a reason too). Two
    corpora differ by content, not by path; the reason names both paths."""
    why = []
    for key in AGREE_WHEN_SAME:
        x, y = getattr(layout_a, key), getattr(layout_b, key)
        if x is None or y is None:
            why.append(f"{key} unknown")
        elif x != y and key == "corpus" and "synthetic" in (x, y):
            continue  # the source differs, and synthetic rows have no corpus: `data` says it
        elif x != y and key == "corpus":
            why.append(f"corpus {layout_a.data_path or x} ({x}) vs {layout_b.data_path or y} ({y})")
        elif x != y:
            why.append(f"{key} {x} vs {y}")
    return "; ".join(why)


SEGMENT_GAP_MIN = 100  # steps: a jump shorter than this is a logging interval, not another run
MAX_SEGMENTS = 4  # more than this reads as a noisy log, not as runs: drawn on one axis


def segments(steps: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of `steps` that read as one run each: a new one starts where the step falls back or
    jumps by more than ten times the usual interval (and SEGMENT_GAP_MIN), e.g. a log holding steps 10-200 and then
    136,004-136,010 of another job, which one axis would squeeze into two dots. A repeated step (a restarted job's
    records sorted beside the first's) is no cut; more than MAX_SEGMENTS cuts give one segment."""
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]) if b > a)
    usual = gaps[len(gaps) // 2] if gaps else 1
    cuts = [i for i in range(1, len(steps))
            if steps[i] < steps[i - 1] or steps[i] - steps[i - 1] > max(SEGMENT_GAP_MIN, 10 * usual)]
    if len(cuts) >= MAX_SEGMENTS:
        cuts = []
    edges = [0, *cuts, len(steps)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
