"""The hostile corpus: real inputs damaged the ways users' files get damaged, and bad recipe values, each with one
property. A damaged input gives a report (exit 0, what could be read, and warnings), never a traceback; a bad
recipe value is one line and exit 2, or a dry run that works; nothing outside the output path changes.

The inputs are a run directory written by our own code with the committed gloo traces (tests/unit/report_support),
and real foreign files from tests/fixtures: a Megatron-LM log, a DeepSpeed log, nccl-tests output and an NCCL_DEBUG
log. Damage: a cut at any byte (a job killed mid-write), flipped bytes, garbage spliced in (NUL filler a crashed
node's file system leaves, binary, terminal escapes, JSON that is not a record, deep nesting, a 5,000-digit number),
numbers turned NaN, infinite, negative or huge, and for the gzip traces the same on the compressed bytes (a stream
that fails its check) or on the JSON inside.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.unit.report_support import LOGS, NCCL, make_run_dir

RUN = Path("runs/tiny_zero2/20260101-000000")
FOREIGN = {"megatron/megatron.log": LOGS / "c_megatron_lm_2025_minmax_moe.txt",
           "deepspeed/ds.log": LOGS / "c_ds_v0_14_pipe_engine.txt",
           "nccl/nccl_tests.txt": NCCL / "c_allreduce_v2_13_8xh100.txt",
           "nccl/nccl_debug.txt": NCCL / "c_debug_v2_21_2node_ib_gdrdma.txt"}
INPUTS = (str(RUN), "megatron", "deepspeed", "nccl")
TARGETS = ("resolved.json", "plan.json", "metrics/rank0.jsonl", "traces/rank0.json.gz")

NUMBER = re.compile(rb"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
BAD_NUMBERS = (b"NaN", b"nan", b"Infinity", b"-inf", b"-1", b"-1e30", b"1e30", b"1e308", b"0", b"9" * 25, b"9" * 5000,
               b"null", b'"x"', b"[1,2]")
JUNK = (b"\0" * 8192, b"\x1b[31m\x1b]0;t\x07", b"null\n", b"5\n", b"[1,2]\n", b'{"kind": "step", "step": "x"}\n',
        b'{"kind": "meta", "rank": [1]}\n', b"[" * 3000, b"9" * 5000 + b"\n", b"\xff\xfe\xfd\n", b"\r\r\n\n")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    make_run_dir(root / "runs")
    for rel, src in FOREIGN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / rel)
    return root


@st.composite
def damages(draw):
    """(what, function of the file's bytes): one damage, drawn."""
    kind = draw(st.sampled_from(("cut", "flip", "splice", "numbers")))
    at = draw(st.floats(0, 1))
    if kind == "cut":
        return f"cut at {at:.3f}", lambda b: b[:int(len(b) * at)]
    if kind == "flip":
        offsets = draw(st.lists(st.floats(0, 1), min_size=1, max_size=8))
        return f"flip {len(offsets)} byte(s)", lambda b: _flip(b, offsets)
    if kind == "splice":
        junk = draw(st.one_of(st.sampled_from(JUNK), st.binary(min_size=1, max_size=200)))
        return f"splice {junk[:20]!r} at {at:.3f}", lambda b: b[:int(len(b) * at)] + junk + b[int(len(b) * at):]
    every = draw(st.integers(1, 7))
    bad = draw(st.sampled_from(BAD_NUMBERS))
    return f"every {every}th number -> {bad[:20]!r}", lambda b: _numbers(b, every, bad)


def _flip(data: bytes, offsets) -> bytes:
    out = bytearray(data)
    for o in offsets:
        if out:
            out[min(len(out) - 1, int(o * len(out)))] ^= 0xFF
    return bytes(out)


def _numbers(data: bytes, every: int, bad: bytes) -> bytes:
    count = iter(range(1 << 62))
    return NUMBER.sub(lambda m: bad if next(count) % every == 0 else m[0], data)


def _damage(path: Path, fn, inside_gzip: bool) -> None:
    data = path.read_bytes()
    if inside_gzip:  # the JSON inside the trace, compressed again
        path.write_bytes(gzip.compress(fn(gzip.decompress(data))))
    else:
        path.write_bytes(fn(data))


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _damaged_copy(pristine: Path, tmp: Path, target: str, fn, inside_gzip: bool) -> Path:
    work = tmp / "in"
    shutil.copytree(pristine, work)
    path = work / RUN / target if not target.startswith(tuple(INPUTS[1:])) else work / target
    _damage(path, fn, inside_gzip)
    return work


ALL_TARGETS = TARGETS + tuple(FOREIGN)
# Each example reads (and renders) a whole report: shrinking a failure would take minutes, and the example as drawn
# names its file and damage already.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
# CI runs the counts below; HOSTILE_HUNT=20 runs twenty times as many, to hunt for a new defect class.
HUNT = int(os.environ.get("HOSTILE_HUNT", "1"))
# A cell that no measurement can be: NaN, infinite, or past float32's range (3.4e38), which every training figure
# (a loss, a norm, a scale) is computed in.
ABSURD = re.compile(r"\|\s*-?(?:nan|inf|infinity)\s*\||(?<![\w.])\d+(?:\.\d+)?[eE]\+?(?:39|[4-9]\d|\d{3,})\b",
                    re.IGNORECASE)


@settings(max_examples=150 * HUNT, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(ALL_TARGETS), damage=damages(), inside_gzip=st.booleans())
def test_any_damage_to_any_input_gives_a_report_and_changes_no_input(pristine, target, damage, inside_gzip):
    """The report's content (every table cell; figures are drawn by the command-line test below) from inputs with
    one file damaged."""
    from unittest import mock

    from analysis.report import build_report, sections

    what, fn = damage
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(sections, "_plot", lambda *a: b""):
        work = _damaged_copy(pristine, Path(tmp), target, fn, inside_gzip and target.endswith(".gz"))
        before = _snapshot(work)
        rep = build_report([(None, str(work / i)) for i in INPUTS])
        # every input is a run, or (a log whose damage reads as a restart: an iteration falling back to 0) several,
        # each labelled after its input (`megatron#2`); nothing else
        labels = [r.label.split("#")[0] for r in rep.runs]
        ours = f"{RUN.parent.name}/{RUN.name}"  # our run directory's label: <recipe>/<stamp>
        assert set(labels) == {ours, "megatron", "deepspeed", "nccl"}, (target, what, labels)
        assert labels.count(ours) == labels.count("nccl") == 1, (target, what, labels)
        cells = [c for b in sections.report_blocks(rep) if b.kind == "table" for row in b.rows for c in row]
        absurd = [c for c in cells if ABSURD.search(f"| {c} |")]
        # Values outside physical sense are dropped, never shown as results.
        assert not absurd, (target, what, absurd)
        assert _snapshot(work) == before, (target, what)


@settings(max_examples=3 * HUNT, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(ALL_TARGETS), damage=damages())
def test_the_command_line_renders_damaged_inputs_and_writes_only_its_outputs(pristine, target, damage):
    from analysis.__main__ import main

    what, fn = damage
    with tempfile.TemporaryDirectory() as tmp:
        work = _damaged_copy(pristine, Path(tmp), target, fn, False)
        before = _snapshot(work)
        out = Path(tmp) / "out"
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(["report", *(str(work / i) for i in INPUTS), "-o", str(out / "r.md"), "-o", str(out / "r.html")])
        assert rc == 0, (target, what, err.getvalue())
        assert _snapshot(work) == before, (target, what)
        made = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        assert made[:2] == ["r.html", "r.md"] and all(m.startswith("r_plots/figure") for m in made[2:]), made
        text = (out / "r.md").read_text()
        assert "\x1b" not in text + (out / "r.html").read_text()
        absurd = [line for line in text.splitlines() if line.startswith("|") and ABSURD.search(line)]
        assert not absurd, (target, what, absurd)  # a warning (not a table) may quote a value it refused


# One test per defect class, each of which failed before its fix.

def test_a_coloured_log_reads_as_the_plain_one(tmp_path):
    """Every line wrapped in colour escapes (a logger writing to a terminal, then tee'd): it was not recognised."""
    from analysis.parsers.megatron_log import parse_megatron_log
    from analysis.parsers.recognize import classify

    plain = FOREIGN["megatron/megatron.log"].read_bytes()
    coloured = tmp_path / "coloured.log"
    coloured.write_bytes(b"".join(b"\x1b[1;32m" + line + b"\x1b[0m\x1b]8;;\x07\n" for line in plain.splitlines()))
    assert classify(coloured).kinds == ("megatron_log",)
    a, b = parse_megatron_log(FOREIGN["megatron/megatron.log"]), parse_megatron_log(coloured)
    assert len(a) > 10
    assert _shown(a.rows()) == _shown(b.rows())


def _shown(rows, kind: str | None = None) -> list[str]:
    """Rows as comparable text (a NaN grad norm equals itself), without line numbers (garbage adds lines)."""
    return [repr({k: v for k, v in r.items() if k != "line"}) for r in rows if kind is None or r["kind"] == kind]


@pytest.mark.parametrize("head", [b"\0" * 8192, bytes(range(256)) * 12 + b"\n"], ids=["nul-filler", "binary-garbage"])
def test_a_log_behind_nul_filler_or_garbage_is_read_with_a_warning(tmp_path, head):
    """A crashed node's file system leaves NUL blocks; a log with them (or garbage) at its start was skipped whole
    as binary."""
    from analysis.parsers.megatron_log import parse_megatron_log
    from analysis.parsers.recognize import classify

    damaged = tmp_path / "train.log"
    damaged.write_bytes(head + FOREIGN["megatron/megatron.log"].read_bytes())
    assert classify(damaged).kinds == ("megatron_log",)
    table = parse_megatron_log(damaged)
    plain = parse_megatron_log(FOREIGN["megatron/megatron.log"])
    assert _shown(table.rows(), "iteration") == _shown(plain.rows(), "iteration") != []
    said = " ".join(table.warnings)
    assert f"{head.count(0)} NUL bytes ignored" in said, table.warnings
    assert ("not UTF-8" in said) == (max(head) > 127), table.warnings


def test_nccl_tests_figures_without_physical_sense_are_dropped_and_counted(tmp_path):
    """A negative or NaN time and a busbw of 1e308 were listed, and 1e308 became the ceiling of every comparison."""
    from analysis.parsers.nccl_tests import (
        large_message_busbw,
        parse_nccl_tests,
        peak_busbw,
    )

    lines = FOREIGN["nccl/nccl_tests.txt"].read_text().splitlines()
    row = re.compile(r"^\s+(\d+)\s+\d+\s+\w+\s+\w+\s+-?\d+\s+(\S+)\s+(\S+)\s+(\S+)\s+\d+\s+(\S+)\s+(\S+)\s+(\S+)")
    rows = [i for i, line in enumerate(lines) if row.match(line)]
    for i, (col, bad) in zip(rows[-6:-3], [(1, "-335.6"), (1, "nan"), (3, "1e308")], strict=True):
        fields = lines[i].split()
        fields[4 + col] = bad
        lines[i] = "  ".join(fields)
    path = tmp_path / "ar.txt"
    path.write_text("\n".join(lines) + "\n")
    table = parse_nccl_tests(path)
    assert [w.split(": ", 1)[1] for w in table.warnings] == [
        "2 value(s) of time_us dropped as physically impossible (negative, not finite or longer than a week)",
        "1 value(s) of busbw_GBps dropped as physically impossible (negative, not finite or above 100 TB/s)"]
    busbw = [float(m[g]) for line in lines if (m := row.match(line)) for g in (4, 7) if m[g] != "1e308"]
    assert peak_busbw(table) == max(busbw)
    assert large_message_busbw(table) < 1e3
    assert sum(r["time_us"] is None for r in table.rows()) == 2


def test_a_step_longer_than_a_week_is_no_measurement(tmp_path):
    from analysis.report import build_report

    run = make_run_dir(tmp_path / "runs", traces=False, step_times=[0.1] * 11 + [8 * 24 * 3600.0])
    rep = build_report([(None, str(run))])
    warned = [w for w in rep.runs[0].run.warnings if "step_time_s=691200.0 is longer than a week" in w]
    assert len(warned) == 2  # the last record of both ranks


def test_an_infinite_loss_is_a_diverged_step_not_a_senseless_number(tmp_path):
    """inf and NaN are what a diverging run prints: counted by the curves, never dropped as impossible; a finite loss
    past float32's range is dropped."""
    from analysis.analyzers import curves as C
    from analysis.parsers.megatron_log import parse_megatron_log

    text = FOREIGN["megatron/megatron.log"].read_text()
    first = re.search(r"lm loss: ([0-9.E+-]+)", text)
    assert first
    for value, diverged, dropped in (("inf", 1, 0), ("nan", 1, 0), ("1E+300", 0, 1)):
        log = parse_megatron_log(text[:first.start(1)] + value + text[first.end(1):])
        assert C.curves_from_megatron(log).meta.not_finite_loss == diverged, value
        assert sum("physically impossible" in w for w in log.warnings) == dropped, (value, log.warnings)


def test_a_calibrated_plan_with_an_infinite_bandwidth_is_read(tmp_path):
    """A calibrated link whose time showed no size dependence has an infinite bandwidth, in resolved.json and in
    plan.json: both are read, not called damaged; NaN is."""
    import json

    from analysis.report import build_report

    run = make_run_dir(tmp_path / "runs")
    plan = json.loads((run / "plan.json").read_text())
    assert plan["comm"]
    plan["comm"][0]["busbw_GBps"] = float("inf")
    (run / "plan.json").write_text(json.dumps(plan))
    rep = build_report([(None, str(run))])
    assert rep.runs[0].run.plan is not None and not any("plan.json" in w for w in rep.runs[0].run.warnings)
    plan["comm"][0]["busbw_GBps"] = float("nan")
    (run / "plan.json").write_text(json.dumps(plan))
    rep = build_report([(None, str(run))])
    assert any("plan.json: cannot be read as a plan (comm[0].busbw_GBps=nan" in w for w in rep.runs[0].run.warnings)


def test_short_escapes_and_mostly_nul_binaries(tmp_path):
    from analysis.parsers._text import clean_text
    from analysis.parsers.recognize import classify

    assert clean_text("\x1b(B\x1b[mtext\x1b7\x1b=\x1b[1;31m red\x1b[0m\n")[0] == "text red\n"  # tput sgr0, ESC 7, ESC =
    db = tmp_path / "cache.db"
    db.write_bytes(b"SQLite format 3\0" + b"\0" * 40_000 + b"\x05\x00\x00\x00\x01\x0f\xfb" + b"\0" * 20_000)
    assert classify(db).reason == "binary file of no supported format"


def test_our_metrics_figures_beyond_sense_are_dropped_and_counted(tmp_path):
    """tflops_per_device=1e290 and mfu=1e290 pass the schema (non-negative, finite) and reached the tables."""
    import json

    from analysis.report import build_report

    run = make_run_dir(tmp_path / "runs", traces=False, steps=6)
    for rank in (0, 1):
        f = run / "metrics" / f"rank{rank}.jsonl"
        records = [json.loads(line) for line in f.read_text().splitlines()]
        for rec in records[1:]:
            rec.update(tflops_per_device=1e290, mfu=1e290 if rank == 0 else 11.0)
        records[0]["peak_flops_per_device"] = 1e290 if rank == 1 else records[0]["peak_flops_per_device"]
        f.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    (r,) = build_report([(None, str(run))]).runs
    warned = r.run.warnings
    for rank in (0, 1):
        assert (f"metrics/rank{rank}.jsonl: 6 value(s) of tflops_per_device dropped as physically impossible "
                f"(negative, not finite or above 100 PFLOP/s)") in warned, warned
        assert any(w.startswith(f"metrics/rank{rank}.jsonl: 6 value(s) of mfu dropped as physically impossible")
                   for w in warned), warned
    assert ("metrics/rank1.jsonl meta record: 1 value(s) of peak_flops_per_device dropped as physically impossible "
            "(negative, not finite or above 100 PFLOP/s)") in warned, warned
    assert r.run.metrics.meta.ranks[1]["peak_flops_per_device"] is None
    assert set(r.run.metrics.column("tflops_per_device")) == {None} == set(r.run.metrics.column("mfu"))
    stats = next(r.stats.rows())
    assert stats["tflops_per_device"] is None and stats["mfu_pct"] is None
    assert stats["step_time_median_s"] is not None  # the records themselves are kept
