"""Training curves in the report: read from real logs and our own runs, checked against the files' own numbers
read here with this test's regexes, and compared run against run."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from analysis.analyzers import curves as C
from analysis.parsers.megatron_log import parse_megatron_log
from analysis.parsers.metrics import parse_metrics
from analysis.report import build_report, render_markdown
from tests.unit.report_support import BIGSCIENCE, make_run_dir

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
LOSS = re.compile(r"\| lm loss: ([0-9.E+-]+) \|")
NORM = re.compile(r"\| grad norm: ([0-9.]+) \|")


def test_megatron_curve_is_every_iteration_line_of_the_log():
    want = []
    for line in BIGSCIENCE.read_text(errors="replace").splitlines():
        if m := ITER.search(line):
            loss, norm = LOSS.search(line), NORM.search(line)
            want.append((int(m[1]), float(loss[1]) if loss else None, float(norm[1]) if norm else None))
    assert len(want) >= 10 and any(w[1] is None for w in want)  # iterations that were all skipped print no loss
    curve = C.curves_from_megatron(parse_megatron_log(BIGSCIENCE))
    got = list(zip(curve.columns["step"], curve.columns["loss"], curve.columns["grad_norm"], strict=True))
    for (ws, wl, wg), (gs, gl, gg) in zip(want, got, strict=True):
        assert (gs, gg) == (ws, wg) and (gl == wl is None or gl == pytest.approx(wl, rel=1e-12))
    s = C.summarise(curve)
    # Loss scale and skipped iterations come from the same lines (`number of skipped iterations: N`).
    skipped = sum(int(x) for x in re.findall(r"number of skipped iterations:\s+(\d+)", BIGSCIENCE.read_text()))
    assert s.skipped == skipped and s.loss_scale_last is not None


def _report(tmp_path, *dirs):
    rep = build_report([(None, d) for d in dirs])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    return rep, out.read_text()


def test_two_of_our_runs_overlay_and_the_gap_is_the_largest_loss_difference(tmp_path):
    a = make_run_dir(tmp_path / "a", "20260101-000000", steps=10)
    bumped = [6.0 - 0.05 * s + (0.125 if s == 6 else 0.0) for s in range(10)]
    b = make_run_dir(tmp_path / "b", "20260101-000001", steps=10, losses=bumped)
    rep, md = _report(tmp_path, a, b)
    # The oracle: rank 0's metrics files, read line by line here.
    la, lb = ([json.loads(line)["loss"] for line in (d / "metrics" / "rank0.jsonl").read_text().splitlines()
               if json.loads(line).get("kind") == "step"] for d in (a, b))
    diffs = [abs(x - y) for x, y in zip(la, lb, strict=True)]
    (pair,) = rep.curve_pairs
    assert pair.comparison.common_steps == 10 and pair.not_comparable == ""
    assert pair.comparison.max_abs_diff == pytest.approx(max(diffs), rel=1e-12) == pytest.approx(0.125)
    assert pair.comparison.at_step == 7  # the bump was put on the seventh step (s = 6)
    assert "## Training curves" in md and "yes: same model, precision, batch, sequence, steps, schedule, seed, data, corpus and tokenizer" in md
    assert "0.125" in md and "figure" in md


def test_runs_with_another_global_batch_are_compared_but_not_expected_to_agree(tmp_path):
    a = make_run_dir(tmp_path / "a", "20260101-000000", steps=6)
    b = make_run_dir(tmp_path / "b", "20260101-000001", steps=6, overrides=["batch.global_batch_size=16"])
    rep, md = _report(tmp_path, a, b)
    (pair,) = rep.curve_pairs
    assert pair.not_comparable == "global_batch_size 8 vs 16"
    assert "no: global_batch_size 8 vs 16" in md


@pytest.mark.parametrize("override, why", [("train.steps=8", "steps 6 vs 8"), ("train.seed=7", "seed 1234 vs 7"),
                                           ("train.lr_schedule=constant", "lr_schedule cosine vs constant")])
def test_runs_with_another_length_schedule_or_seed_are_not_expected_to_agree(tmp_path, override, why):
    """Two runs agree step by step only when they see the same data with the same schedule: not so across step
    counts (a cosine schedule's length), schedules or seeds."""
    a = make_run_dir(tmp_path / "a", "20260101-000000", steps=6)
    steps = 8 if override == "train.steps=8" else 6
    b = make_run_dir(tmp_path / "b", "20260101-000001", steps=steps, overrides=[override])
    rep, md = _report(tmp_path, a, b)
    (pair,) = rep.curve_pairs
    assert pair.not_comparable == why and f"no: {why}" in md


def _text_run(root: Path, name: str, fingerprint: str) -> Path:
    """A run of text rows whose data check read a corpus of this digest (resolved.json's data_fingerprint, which the
    launcher writes before any rank starts)."""
    d = make_run_dir(root, name, steps=6, overrides=['data.source="text"', 'data.path="corpus.txt"'])
    resolved = json.loads((d / "resolved.json").read_text())
    resolved["data_fingerprint"] = fingerprint
    (d / "resolved.json").write_text(json.dumps(resolved))
    return d


@pytest.mark.parametrize("second, why", [
    ("synthetic", "data text vs synthetic; tokenizer byte vs none"),
    ("other corpus", f"corpus {{path}} ({'a' * 12}) vs {{path}} ({'b' * 12})"),
    ("same corpus", "")])
def test_runs_that_read_other_data_are_not_expected_to_agree(tmp_path, second, why):
    """A newcomer's synthetic-data run beside a text-corpus run showed 'expected to agree: yes' and a 127% loss gap:
    what the rows are (source, corpus content, tokenizer) decides the loss as much as the schedule. Two corpora at one
    path differ by content; synthetic rows have no corpus to name beside the source."""
    a = _text_run(tmp_path / "a", "20260101-000000", "a" * 64)
    b = (make_run_dir(tmp_path / "b", "20260101-000001", steps=6) if second == "synthetic" else
         _text_run(tmp_path / "b", "20260101-000001", ("b" if second == "other corpus" else "a") * 64))
    why = why.format(path=json.loads((a / "resolved.json").read_text())["recipe"]["data"]["path"])
    rep, md = _report(tmp_path, a, b)
    (pair,) = rep.curve_pairs
    assert pair.not_comparable == why
    assert (f"no: {why}" if why else "yes: same model") in md


def test_a_nan_loss_is_left_out_of_the_curve_and_counted(tmp_path):
    losses = [5.0, 4.9, math.nan, 4.7, 4.6, 4.5]
    d = make_run_dir(tmp_path / "a", steps=6, losses=losses)
    curve = C.curves_from_metrics(parse_metrics(d / "metrics"))
    assert curve.columns["step"] == [1, 2, 3, 4, 5, 6]
    kept = curve.columns["loss"]
    assert kept[2] is None and [x for i, x in enumerate(kept) if i != 2] == [5.0, 4.9, 4.7, 4.6, 4.5]
    s = C.summarise(curve)
    assert s.not_finite == 1 and s.loss_min == 4.5 and s.loss_last == 4.5
    assert any("NaN or infinite loss (first at step 3)" in w for w in curve.warnings)


def test_megatron_deepspeed_bracketed_tflops_and_the_hyphenated_loss_are_read():
    # The iteration line of Megatron-DeepSpeed forks that print both FLOP counts (reproduced in their format).
    line = (" iteration       12/     100 | consumed samples:          384 | elapsed time per iteration (ms): 2345.6 | "
            "learning rate: 1.500E-04 | global batch size:    32 | lm-loss: 7.123456E+00 | loss scale: 1.0 | "
            "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 | "
            "samples per second: 13.642 | [LM]-TFLOPs: 151.23 | [DS]-TFLOPs: 147.02 |\n")
    log = parse_megatron_log(line.replace(" 12/", " 11/") + line)
    rows = [r for r in log.rows() if r["kind"] == "iteration"]
    assert [(r["iteration"], r["lm_loss"], r["throughput_tflops_per_gpu"], r["ds_tflops_per_gpu"]) for r in rows] == [
        (11, 7.123456, 151.23, 147.02), (12, 7.123456, 151.23, 147.02)]
    assert all(r["extra"] == {} for r in rows) and log.warnings == ()
    assert C.curves_from_megatron(log).columns["loss"] == [7.123456, 7.123456]


def test_every_flops_profiler_block_is_read_at_its_own_header_and_shown(tmp_path):
    from analysis.parsers.deepspeed_log import parse_deepspeed_log
    from tests.unit.report_support import LOGS

    text = (LOGS / "c_ds_v0_17_flops_profiler.txt").read_text()
    block = text[text.index("-" * 26 + " DeepSpeed Flops Profiler"):text.index("----------------------------- Aggregated")]
    second = block.replace("Profile Summary at step 3:", "Profile Summary at step 9:").replace("402.5 ms", "380.0 ms")
    log = ("We turned on the DeepSpeed Flops Profiler for this run (prose, not a block).\n" + block + second)
    path = tmp_path / "ds.log"
    path.write_text(log)
    header_lines = [i for i, line in enumerate(log.splitlines(), start=1)
                    if re.fullmatch(r"-+ DeepSpeed Flops Profiler -+", line.strip())]
    rows = [r for r in parse_deepspeed_log(path).rows() if r["kind"] == "flops_profile"]
    assert [(r["line"], r["step"], r["fwd_latency_ms"]) for r in rows] == [
        (header_lines[0], 3, 402.5), (header_lines[1], 9, 380.0)]
    rep = build_report([(None, tmp_path)])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text()
    section = md.split("### DeepSpeed Flops Profiler")[1].split("\n\n")[1].splitlines()[2:]
    # step, fwd ms (3 significant figures), bwd ms of each block
    assert [(c[2], c[5], c[6]) for c in ([x.strip() for x in line.split("|")] for line in section)] == [
        ("3", "402", "1,050"), ("9", "380", "1,050")]


def test_a_deepspeed_log_without_step_lines_keeps_its_timer_blocks_in_order():
    from analysis.analyzers.steps import steps_from_deepspeed
    from analysis.analyzers.timers import framework_timers
    from analysis.parsers.deepspeed_log import parse_deepspeed_log
    from tests.unit.report_support import LOGS

    # DeepSpeed 0.19 with steps_per_print beyond the run prints no `step=` lines: the same log with them removed.
    text = (LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt").read_text()
    kept = "\n".join(line for line in text.splitlines() if "step=" not in line and "global_step" not in line) + "\n"
    totals = [sum(float(m[k]) for k in (1, 2, 3)) / 1000 for m in
              (re.search(r"\| forward: ([\d.]+) \| backward: ([\d.]+) \|.*\| step: ([\d.]+)", line)
               for line in kept.splitlines()) if m]
    assert len(totals) >= 3
    log = parse_deepspeed_log(kept)
    steps = steps_from_deepspeed(log)
    assert steps.columns["step"] == list(range(1, len(totals) + 1))
    for got, want in zip(steps.columns["step_time_s"], totals, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert all("no step= lines" in s for s in steps.columns["step_source"])
    assert len(framework_timers(log)) > 0 and any("no step= lines" in w for w in log.warnings)


def test_validation_losses_and_perplexities_are_listed_as_printed(tmp_path):
    from tests.unit.report_support import ALCF

    want = [(int(m[1]), float(m[2]), float(m[3])) for m in re.finditer(
        r"validation loss at iteration (\d+)[^|]*\| lm loss value[:=]\s*([0-9.E+-]+?)\s*\|?\s*lm loss PPL[:=]\s*([0-9.E+-]+)",
        BIGSCIENCE.read_text() + ALCF.read_text())]
    assert len(want) >= 3
    got = [(v.iteration, v.loss, v.ppl) for path in (BIGSCIENCE, ALCF) for v in C.validation_points(parse_megatron_log(path))]
    for (wi, wl, wp), (gi, gl, gp) in zip(want, got, strict=True):
        assert gi == wi and gl == pytest.approx(wl, rel=1e-12) and gp == pytest.approx(wp, rel=1e-12)
    d = tmp_path / "bigscience"
    d.mkdir()
    (d / "train.out").write_text(BIGSCIENCE.read_text())
    _, md = _report(tmp_path, d)
    assert "### Validation" in md and "3.28e+03" in md


def test_deepspeeds_own_samples_per_second_are_shown(tmp_path):
    from tests.unit.report_support import LOGS

    src = LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt"
    found = re.findall(r"RunningAvgSamplesPerSec=([-\w.]+), CurrSamplesPerSec=([\d.]+)", src.read_text())
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.log").write_text(src.read_text())
    _, md = _report(tmp_path, d)
    section = md.split("### DeepSpeed's own throughput")[1].split("\n\n")[1].splitlines()[2]
    cells = [c.strip() for c in section.strip("|").split("|")]
    avg, curr = found[-1]
    assert cells[1] == str(len(found)) and float(cells[2]) == pytest.approx(float(curr), rel=1e-2)
    assert float(cells[3]) == pytest.approx(float(avg), rel=1e-2)


def test_a_log_holding_two_runs_is_two_runs_named_with_the_line_where_the_second_starts(tmp_path):
    from tests.unit.report_support import LOGS

    for src, first in ((BIGSCIENCE, ITER), (LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt", re.compile(r"step=\d+"))):
        text = src.read_text(errors="replace")
        twice = text + text  # a restarted job appending to the same file
        n = len(text.splitlines())
        restart = n + next(i for i, line in enumerate(text.splitlines(), start=1) if first.search(line))
        d = tmp_path / src.stem
        d.mkdir()
        (d / "train.log").write_text(twice)
        rep, md = _report(tmp_path, d)
        first, second = rep.runs
        # The second starts in the second copy, at its first record or at the set-up lines before it.
        start = int(re.match(r"lines (\d+)–", second.run.segment)[1])
        assert n < start <= restart, second.run.segment
        assert f"{src.stem}#2: lines {start}–" in md and "Several runs in one file" in md
        assert [s["step"] for s in first.steps.rows()] == [s["step"] for s in second.steps.rows()]
        assert first.boundaries == second.boundaries == []
        once = tmp_path / f"{src.stem}_once"
        once.mkdir()
        (once / "train.log").write_text(text)
        rep1, _ = _report(tmp_path, once)
        assert rep1.runs[0].boundaries == []


def test_every_field_our_trainer_writes_is_read_back(tmp_path):
    # The parser once kept its own column list: a field added to launch.run.metrics.StepRecord was dropped silently.
    # Round trip: a record with a distinct value in every field, written by our writer, read by the parser.
    from dataclasses import fields

    from launch.run.metrics import (
        FLOPS_FORMULA,
        SCHEMA_VERSION,
        MetaRecord,
        MetricsWriter,
        StepRecord,
    )

    meta = MetaRecord(schema_version=SCHEMA_VERSION, rank=0, world_size=1, tp=1, pp=1, dp=1, recipe="r", backend="deepspeed",
                      hardware_profile="cpu", device="cpu", peak_flops_per_device=1e12, flops_per_token=1e6,
                      flops_formula=FLOPS_FORMULA, tokens_per_step=64, warmup_steps=0, zero_stage=0, dtype="fp32",
                      micro_batch_size=1, global_batch_size=1, seq_len=64, param_numel_local=10, start_step=0,
                      resumed_from=None)
    values = {}
    for k, f in enumerate(fields(StepRecord)):
        if f.name != "kind":
            values[f.name] = (k + 1 if f.name in ("step", "tokens") or "bytes" in f.name else False if f.type in ("bool", "bool | None")
                              else 0.5 + k)
    w = MetricsWriter(tmp_path / "metrics" / "rank0.jsonl", meta)
    w.step(StepRecord(**values))
    w.close()
    (row,) = list(parse_metrics(tmp_path / "metrics").rows())
    assert {k: row[k] for k in values} == values


def test_a_run_without_a_curve_gets_a_row_as_wide_as_the_table(tmp_path):
    from tests.unit.report_support import ALLREDUCE_8XH100

    a = make_run_dir(tmp_path / "a", steps=8)
    _, md = _report(tmp_path, a, ALLREDUCE_8XH100)
    table = md.split("## Training curves")[1].split("\n\n")[1].splitlines()
    widths = [line.count("|") for line in table]
    assert len(table) == 4 and len(set(widths)) == 1, table  # header, rule, two runs
    assert "no loss per step" in table[-1]


def test_steps_of_another_run_in_the_same_file_get_their_own_axes():
    """A foreign log holding steps 10-200 and then 136,004-136,010: two segments, drawn as two rows of panels."""
    from analysis.report.plots import training_curves

    steps = [*range(10, 201, 10), *range(136_004, 136_011)]
    assert C.segments(steps) == [(0, 20), (20, 27)]
    assert C.segments([*range(1, 6), *range(1, 4)]) == [(0, 5), (5, 8)]  # the step falls back: a restart
    assert C.segments([*range(0, 1000, 50)]) == [(0, 20)]  # a coarse logging interval is one run
    assert C.segments(sorted([*range(1, 301), *range(1, 301)])) == [(0, 600)]  # a restart, sorted: no cut per step
    assert C.segments([1, 2] * 5) == [(0, 10)]  # four fall-backs: a noisy log, drawn on one axis
    values = {"loss": [5.0] * len(steps), "grad_norm": [None] * len(steps), "lr": [1e-3] * len(steps)}
    one, two = (training_curves([("run", s, {k: v[:len(s)] for k, v in values.items()})]) for s in (steps[:20], steps))
    height = [int.from_bytes(png[20:24], "big") for png in (one, two)]  # PNG IHDR height
    assert height[1] > 1.6 * height[0]  # a second row of panels (the saved figure is cropped to its content)


def test_the_validation_loss_is_listed_and_drawn_beside_the_training_loss(tmp_path):
    d = make_run_dir(tmp_path / "a", steps=6, valid_losses={3: 5.25, 6: 5.125})
    curve = C.curves_from_metrics(parse_metrics(d / "metrics"))
    assert curve.columns["valid_loss"] == [None, None, 5.25, None, None, 5.125]
    rep, md = _report(tmp_path, d)
    row = next(line for line in md.split("## Training curves")[1].splitlines() if line.startswith("| tiny_zero2/"))
    assert "| 5.125 (step 6, 2 evaluations) |" in row, row
    from analysis.report.plots import training_curves

    steps = curve.columns["step"]
    plain, both = (training_curves([("run", steps, {"loss": curve.columns["loss"], "valid_loss": v,
                                                    "grad_norm": curve.columns["grad_norm"], "lr": curve.columns["lr"]})])
                   for v in ([None] * 6, curve.columns["valid_loss"]))
    assert plain != both  # the validation points are drawn


def test_tensorboard_validation_tags_fill_the_validation_column():
    from analysis.table import Table

    rows = [{"run": "r", "file": "f", "tag": tag, "step": 4, "value": 3.5} for tag in ("valid/loss", "lm loss validation")]
    tb = Table.from_rows("tensorboard", {"run": "", "file": "", "tag": "", "step": "", "value": ""}, rows, source="tb")
    assert C.curves_from_tensorboard(tb).columns["valid_loss"] == [3.5]


def test_no_tick_label_of_the_curves_is_drawn_over_another_or_over_the_next_panel():
    """The learning-rate panel's labels (0.00005 … 0.00030) ran into the gradient-norm panel: matplotlib's own
    extents of every drawn label, after layout, are the oracle."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from analysis.report.plots import training_curves_figure

    steps = list(range(1, 61))
    lr = [3e-4 * s / 5 if s < 5 else 3e-5 + 2.7e-4 * 0.5 * (1 + math.cos(math.pi * (s - 5) / 55)) for s in steps]
    fig = training_curves_figure([("tiny_zero2/20261206-000000", steps,
                                   {"loss": [6 - 0.05 * s for s in steps], "grad_norm": [1 / s for s in steps],
                                    "lr": lr})])
    FigureCanvasAgg(fig).draw()
    r = fig.canvas.get_renderer()

    def drawn(axis, limits):  # the labels of the ticks inside the view (matplotlib keeps one past each end)
        lo, hi = sorted(limits)
        return [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_visible()]

    labels = [(i, t.get_text(), t.get_window_extent(r)) for i, ax in enumerate(fig.axes)
              for t in (*drawn(ax.xaxis, ax.get_xlim()), *drawn(ax.yaxis, ax.get_ylim()), ax.yaxis.get_offset_text())
              if t.get_text()]
    assert any(i == 2 for i, _, _ in labels)
    for n, (i, a, box) in enumerate(labels):
        assert not [b for _, b, other in labels[n + 1:] if box.overlaps(other)], (i, a)
        assert not [j for j, ax in enumerate(fig.axes) if j != i and box.overlaps(ax.get_window_extent(r))], (i, a)


def test_a_data_fingerprint_that_is_no_digest_reads_as_unknown(tmp_path):
    """resolved.json is a file the user may hand us damaged: a number where the digest belongs broke the report."""
    a = _text_run(tmp_path / "a", "20260101-000000", "a" * 64)
    b = _text_run(tmp_path / "b", "20260101-000001", 5)
    rep, _ = _report(tmp_path, a, b)
    (pair,) = rep.curve_pairs
    assert pair.not_comparable == "corpus unknown"
