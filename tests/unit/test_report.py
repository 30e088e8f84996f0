"""The comparative report (analysis.report, python -m analysis): foreign folders side by side, our run
directory with its plan, truncated inputs, a self-contained HTML file with escaped log strings, the CLI."""
from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import sys

import pytest

from analysis.__main__ import COMMANDS, main, read_args
from analysis.report import build_report, render_markdown, write_report
from tests.unit.report_support import (
    ALCF,
    ALLREDUCE_8XH100,
    BIGSCIENCE,
    GLOO,
    HTA,
    NCCL,
    NSYS,
    REPO,
    build_nsys_exports,
    make_run_dir,
)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """bigscience Megatron log vs ALCF Megatron-DeepSpeed log vs HTA Kineto traces, each in its own folder."""
    root = tmp_path_factory.mktemp("foreign")
    for name, files in (("bigscience", [BIGSCIENCE]), ("alcf", [ALCF]),
                        ("traces", [*HTA, NCCL / "c_debug_v2_19_roce_listed_socket_used.txt"])):
        (root / name).mkdir()
        for f in files:
            shutil.copy(f, root / name / f"file{files.index(f)}.log")  # names say nothing: content decides
    # nccl-tests output without a command line names its collective only in the file name (kept here)
    shutil.copy(ALLREDUCE_8XH100, root / "traces" / "all_reduce_perf.txt")
    rep = build_report([(None, root / "bigscience"), ("ALCF", root / "alcf"), (None, root / "traces")])
    out = root / "out"
    written = write_report(rep, [out / "r.html", out / "r.md"])
    return rep, out, written


def test_foreign_folders_side_by_side(foreign):
    rep, out, written = foreign
    # The ALCF excerpt holds three runs (test_log_runs): its set-up block, its iterations, a later run's validation.
    assert [r.label for r in rep.runs] == ["bigscience", "ALCF#1", "ALCF#2", "ALCF#3", "traces"]
    big, _, alcf, _, tr = rep.runs
    s = next(big.stats.rows())
    assert s["steps_measured"] == 18 and s["steps_dropped"] == 2
    assert big.layout.tp == 4 and big.layout.pp == 8 and big.layout.world_size == 32
    assert next(alcf.stats.rows())["tokens_per_s_per_device"] is not None
    assert len(big.memory) == 32 and big.memory.column("predicted_what")[0].startswith("none")
    assert big.timers and alcf.timers  # Megatron timers; ALCF also DeepSpeed's
    assert tr.breakdown is not None and {r["basis"] for r in tr.breakdown.rows()} == {"gpu_kernels"}
    bw = {r["collective"]: r for r in tr.bandwidth.rows()}
    assert bw["all_reduce"]["ceiling_source"] == "all_reduce_perf.txt" and bw["all_reduce"]["pct_of_ceiling"] < 50
    rules = {(f.run, f.rule) for f in rep.findings}
    assert {("traces", "low_busbw"), ("traces", "slow_transport"),
            ("bigscience, ALCF#2", "mismatched_runs")} <= rules
    assert {p.name for p in written} >= {"r.html", "r.md", "figure1.png"}
    md = (out / "r.md").read_text()
    for section in ("## Runs", "## Doctor", "## How fast", "## Memory", "## Where the time went", "## Collectives",
                    "## Stragglers", "## Kernel diff", "## Prediction vs measurement", "## Definitions"):
        assert section in md
    assert "none: no run has a plan" in md
    assert "foreign log: first 10% of the logged step range 10-200" in md
    # rank 0's "max reserved: 26732.0" MB, and the line it came from
    assert "| bigscience | 0 | 26.11 GiB | max_reserved (GPU) |" in md
    assert big.steps.column("source")[2] == "file0.log:412"


def test_every_table_names_its_source(foreign):
    _, out, _ = foreign
    html = (out / "r.html").read_text()
    headers = re.findall(r"<table><thead><tr>(.*?)</tr></thead>", html)
    assert len(headers) > 8
    for h in headers:  # the doctor's table names its files in the evidence column
        assert "<th>source</th>" in h or "<th>evidence (file: numbers)</th>" in h, h


def test_html_is_self_contained(foreign):
    _, out, _ = foreign
    html = (out / "r.html").read_text()
    assert "<script" not in html.lower() and "<link" not in html.lower()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert not re.search(r"url\(\s*['\"]?https?:", html, re.I)
    imgs = re.findall(r"<img [^>]*src='([^']*)'", html)
    assert len(imgs) >= 3 and all(i.startswith("data:image/png;base64,") for i in imgs)


def test_log_strings_are_escaped(tmp_path):
    text = BIGSCIENCE.read_text().replace("forward-compute:", "<script>alert(1)</script>:", 3)
    d = tmp_path / "evil <img onerror=x>"
    d.mkdir()
    (d / "train.log").write_text(text)
    rep = build_report([("<b>label</b>", d)])
    write_report(rep, [tmp_path / "r.html", tmp_path / "r.md"])
    html = (tmp_path / "r.html").read_text()
    md = (tmp_path / "r.md").read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>label</b>" not in html and "&lt;b&gt;label&lt;/b&gt;" in html
    assert "<script>" not in md and "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    assert "<script" not in html.lower() and "<img onerror" not in html and "&lt;img onerror=x&gt;" in html


def test_our_run_directory_with_plan_and_traces(tmp_path):
    run = make_run_dir(tmp_path / "runs")
    rep = build_report([(None, run)])
    (r,) = rep.runs
    assert r.label == "tiny_zero2/20260101-000000" and r.run.run_dir
    s = next(r.stats.rows())
    assert s["steps_dropped"] == 5 and "warmup_steps=5" in s["drop_rule"]
    assert "torchtitan" in s["mfu_formula"]
    mem = next(r.memory.rows())
    assert mem["predicted_bytes"] and mem["predicted_what"].startswith("plan.json")
    assert {b["basis"] for b in r.breakdown.rows()} == {"cpu_ops"}
    assert any("cpu_ops basis" in n for n in r.notes)
    assert r.vs_layout is not None and {v["collective"] for v in r.vs_layout.rows()} >= {"all_reduce"}
    assert {p["quantity"] for p in r.prediction} >= {"step time", "tokens/s/device", "MFU"}
    ours = dict(r.run.ours)  # our own files that are no evidence: listed as ours, not as skipped (issue 34)
    assert "checkpoints" in ours and "launch_cmd.txt" in ours and not r.run.skipped


def test_prediction_compares_the_gradient_reduction_either_way_it_runs(tmp_path):
    from analysis.report.data import prediction_rows as _prediction
    from analysis.table import Table

    run = make_run_dir(tmp_path / "runs")  # ZeRO-2: the plan reduce-scatters, DeepSpeed on gloo all-reduces
    (r,) = build_report([(None, run)]).runs
    # plus the two one-value all-reduces of every step: DeepSpeed's gradient norm and the loop's loss mean
    assert {c.collective for c in r.run.plan.comm} == {"reduce_scatter", "all_gather", "all_reduce"}
    assert "reduce_scatter" not in {b["collective"] for b in r.bandwidth.rows()}
    comm = {p["quantity"].split(" time per step")[0]: p for p in r.prediction if "time per step" in p["quantity"]}
    assert set(comm) == {"all_gather", "all_reduce + reduce_scatter"}
    red = comm["all_reduce + reduce_scatter"]
    assert red["measured"] == next(b["time_per_step_ms"] for b in r.bandwidth.rows() if b["collective"] == "all_reduce")
    # a planned collective the traces do not show is listed as such, not left out
    r.bandwidth = Table.from_rows(r.bandwidth.name, r.bandwidth.doc,
                                  [b for b in r.bandwidth.rows() if b["collective"] != "all_gather"],
                                  source=r.bandwidth.source)
    (gone,) = [p for p in _prediction(r.run, r) if p["quantity"].startswith("all_gather")]
    assert (gone["measured"], gone["missing"]) == (None, "not observed")


def test_run_without_plan_json_recomputes_it(tmp_path):
    run = make_run_dir(tmp_path / "runs", plan=False, traces=False)
    (r,) = build_report([(None, run)]).runs
    assert "recomputed from resolved.json" in next(r.memory.rows())["predicted_what"]


def test_a_resolved_grid_the_run_contradicts_is_not_believed(tmp_path):
    """A resolved.json edited to pp=3 on a 2-rank run (the traces' distributedInfo and the metrics say 2 ranks, dp=2):
    a warning names the file, the grid and who says otherwise, and the layout comes from the metrics instead."""
    import json

    run = make_run_dir(tmp_path / "runs", plan=False)
    doc = json.loads((run / "resolved.json").read_text())
    doc["grid"].update(pp=3, dp=1)
    doc["recipe"]["parallel"]["pp"] = 3  # edited consistently within the file: only the run's other files disagree
    (run / "resolved.json").write_text(json.dumps(doc))
    (r,) = build_report([(None, run)]).runs
    (w,) = [w for w in r.run.warnings if "grid tp×pp×dp" in w]
    assert w.startswith("resolved.json: grid tp×pp×dp = 1×3×1 = 3 ranks, but ")
    traces_world = {json.loads(gzip.decompress(f.read_bytes()))["distributedInfo"]["world_size"]
                    for f in (run / "traces").iterdir()}
    assert traces_world == {2} and "distributedInfo" in w and "says world_size 2" in w
    assert "metrics' meta record" in w and "world_size=2, tp=1, pp=1, dp=2" in w
    assert r.run.resolved is None and r.run.plan is None and r.vs_layout is None and r.run.hardware is None
    assert (r.layout.pp, r.layout.dp, r.layout.world_size) == (1, 2, 2)
    # the file as written is left alone, and an unedited run gets no such warning
    assert json.loads((run / "resolved.json").read_text())["grid"]["pp"] == 3
    (clean,) = build_report([(None, make_run_dir(tmp_path / "other", plan=False))]).runs
    assert not [w for w in clean.run.warnings if "grid tp×pp×dp" in w] and clean.run.resolved is not None


def test_truncated_inputs_give_a_partial_report_with_warnings(tmp_path):
    d = tmp_path / "cut"
    d.mkdir()
    text = BIGSCIENCE.read_bytes()
    (d / "a.out").write_bytes(text[: int(len(text) * 0.6)])
    raw = gzip.decompress(GLOO[0].read_bytes())
    (d / "t0.json").write_bytes(raw[: len(raw) // 2])
    shutil.copy(GLOO[1], d / "t1.json.gz")
    shutil.copy(NCCL / "c_allreduce_v2_13_truncated_midrow.txt", d / "n.txt")
    run = make_run_dir(tmp_path / "runs", traces=False, cut_last_line=True)
    rep = build_report([(None, d), (None, run)])
    cut, ours = rep.runs
    assert cut.stats is not None and next(cut.stats.rows())["steps_measured"] > 0
    assert cut.breakdown is not None and len(cut.breakdown) == 2
    warn = "\n".join(cut.run.warnings)
    assert "t0.json" in warn and "byte" in warn
    assert "n.txt" in warn
    assert any(w.startswith("metrics/rank0.jsonl:13: not JSON") for w in ours.run.warnings)
    write_report(rep, [tmp_path / "r.html"])
    html = (tmp_path / "r.html").read_text()
    assert "Warnings (partial inputs)" in html and "t0.json" in html


def test_unknown_files_are_listed_as_skipped(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    shutil.copy(BIGSCIENCE, d / "run.out")
    (d / "notes.txt").write_text("hello\n")
    rep = build_report([(None, d)])
    write_report(rep, [tmp_path / "r.md"])
    md = (tmp_path / "r.md").read_text()
    assert "notes.txt — skipped: text without lines from any supported tool" in md


def test_kernel_diff_between_two_gpu_trace_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(HTA[0], a / "x.gz")
    shutil.copy(HTA[1], b / "y.gz")
    rep = build_report([(None, a), (None, b)])
    assert rep.kernel_diff is not None and len(rep.kernel_diff) > 0
    assert "b minus a" in rep.kernel_diff_note


def test_nsys_folder_gets_the_trace_breakdown(tmp_path):
    exports = build_nsys_exports(tmp_path / "build")
    d = tmp_path / "profile"
    d.mkdir()
    shutil.copy(exports["modern"], d / "report1")
    shutil.copy(NSYS / "stats" / "bundle_banners_2024.csv", d / "stats.out")
    (r,) = build_report([(None, d)]).runs
    assert r.run.trace_from == "nsys"
    (b,) = list(r.breakdown.rows())  # rank 1 has no GPU work in its window: left out, and said so
    assert b["rank"] == 0 and b["basis"] == "gpu_kernels" and b["source"] == "report1"
    assert any("no GPU activity" in n for n in r.notes)
    assert r.nsys_totals and next(r.nsys_totals[0].rows())["source"] == "stats.out"


def test_steps_come_from_the_first_log_with_step_times(tmp_path):
    d = tmp_path / "two"
    d.mkdir()
    # Sorted first, with an arguments dump like the complete log beside it, but iteration lines without a time
    text = BIGSCIENCE.read_text()
    dump = text[text.index("------------------------ arguments"):text.index("end of arguments")]
    (d / "a.log").write_text(dump + "end of arguments ---\n" + "".join(
        f" iteration {i:8d}/     100 | consumed samples: {32 * i:10d} | lm loss: 1.0 |\n" for i in range(1, 30)))
    shutil.copy(BIGSCIENCE, d / "b.log")
    (r,) = build_report([(None, d)]).runs
    assert r.steps.source == "b.log" and next(r.stats.rows())["steps_measured"] == 18


def test_logs_not_used_are_named(tmp_path):
    d = tmp_path / "folder"
    d.mkdir()
    shutil.copy(BIGSCIENCE, d / "a.out")
    shutil.copy(REPO / "tests" / "fixtures" / "logs" / "c_megatron_lm_2025_minmax_moe.txt", d / "b.out")
    rep = build_report([(None, d)])
    (r,) = rep.runs
    assert r.steps.source == "a.out"
    assert {u.split(";")[0] for u in r.unused} == {"steps from a.out", "memory from a.out", "layout from a.out"}
    assert all("not used for" in u and "b.out" in u for u in r.unused)
    write_report(rep, [tmp_path / "r.md"])
    md = (tmp_path / "r.md").read_text()
    assert "**Logs not used**" in md and "steps from a.out; not used for steps: b.out" in md
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(BIGSCIENCE, one / "a.out")
    assert build_report([(None, one)]).runs[0].unused == []


def test_dollar_signs_in_labels_and_paths_are_drawn_as_written(tmp_path):
    d = tmp_path / "cost_$5_vs_$10"
    d.mkdir()
    shutil.copy(BIGSCIENCE, d / "a.log")
    shutil.copy(GLOO[0], d / "t$0$.json.gz")
    shutil.copy(GLOO[1], d / "t1.json.gz")
    shutil.copy(NCCL / "c_allreduce_v2_13_8xh100.txt", d / "sweep_$x^$.txt")
    rep = build_report([(None, d), ("price $1 $\\frac{", d)])
    written = write_report(rep, [tmp_path / "r.md", tmp_path / "r.html"])
    assert len([p for p in written if p.suffix == ".png"]) >= 4
    assert "cost_\\$5_vs_\\$10" in (tmp_path / "r.md").read_text()  # Markdown with math would read $5_vs_$


def test_memory_plot_numbers_runs_whose_labels_share_a_prefix(tmp_path, monkeypatch):
    from analysis.report import plots, report_blocks

    a = make_run_dir(tmp_path / "runs", "20260101-000000", traces=False)
    b = make_run_dir(tmp_path / "runs", "20260101-000001", traces=False)
    rep = build_report([(None, a), (None, b)])
    assert [r.label for r in rep.runs] == ["tiny_zero2/20260101-000000", "tiny_zero2/20260101-000001"]
    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    report_blocks(rep)
    (mem,) = [f for f in figures if f.axes[0].get_ylabel() == "peak memory, GiB"]
    ax = mem.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1:0", "1:1", "2:0", "2:1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"1: tiny_zero2/20260101-000000", "2: tiny_zero2/20260101-000001"} <= set(legend)


# ---------------------------------------------------------------------------------------- CLI

def test_read_args_labels_options_and_outputs(tmp_path):
    p = tmp_path / "x=y"
    p.mkdir()
    args = read_args(COMMANDS["report"], ["zero2=/some/where", str(p), "ceiling=/c", "-o", "a.html", "-ob.md",
                                          "--jobs=3"])
    assert args.inputs == (("zero2", "/some/where"), (None, str(p)))
    assert args.options == {"ceiling": "/c"} and args.flags == {"output": ("a.html", "b.md"), "jobs": 3}


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "error: give -o OUT.html or -o OUT.md" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing"), "-o", "x.html"]) == 2
    assert main(["report", str(tmp_path), "-o", "x.pdf"]) == 2
    assert main(["report", str(tmp_path), "hardware=nope", "-o", str(tmp_path / "x.md")]) == 2
    err = capsys.readouterr().err
    assert "hardware" in err and "Traceback" not in err


def test_cli_report_and_doctor(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    shutil.copy(BIGSCIENCE, d / "log")
    out = tmp_path / "rep.html"
    p = subprocess.run([sys.executable, "-m", "analysis", "report", f"bs={d}", "hardware=a100-80gb",
                        "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.is_file() and "wrote" in p.stdout
    html = out.read_text()
    assert "a100-80gb" in html
    assert main(["doctor", str(d)]) == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "0", "-2", "1e300", "1e-30"])
def test_device_memory_must_be_a_plausible_number(tmp_path, capsys, value):
    assert main(["report", str(tmp_path), f"device_memory_gib={value}", "-o", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert f"error: device_memory_gib={value}: must be a finite number from 0.001 to 1,000,000" in err
    assert "Traceback" not in err


def test_recognize_of_a_missing_path_is_an_error(tmp_path, capsys):
    assert main(["recognize", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such file or folder"
    assert main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such file or folder"


def test_an_empty_folder_is_said_to_hold_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["recognize", str(empty)]) == 0
    assert f"warning: {empty}: nothing recognised (it is empty)" in capsys.readouterr().out
    (r,) = build_report([(None, empty)]).runs
    assert any("nothing recognised" in w for w in r.run.warnings)


def test_step_times_without_physical_sense_are_dropped_with_a_warning(tmp_path):
    """A NaN step time is no measurement: each such record is dropped (the first ten of a file named, the rest
    counted), never averaged in, and the speed table shows no percentile rather than a number."""
    from analysis.report import report_blocks

    run = make_run_dir(tmp_path / "runs", traces=False, step_times=[float("nan")] * 12)  # no finite step time
    rep = build_report([(None, run)])
    warned = [w for w in rep.runs[0].run.warnings if "step_time_s=nan is not a positive, finite number" in w]
    assert len(warned) == 10 * 2
    for rank in (0, 1):
        assert (f"metrics/rank{rank}.jsonl: 2 more damaged line(s) skipped, not named one by one"
                in rep.runs[0].run.warnings)
    (speed,) = [b for b in report_blocks(rep) if "p10–p90, ms" in b.headers]
    assert speed.rows[0][2] == "–"


def test_our_own_non_evidence_files_are_listed_as_ours_not_skipped(tmp_path):
    """logs/rank*.err, state_bytes_*, layout_*, an earlier report inside the run, the corpus the run tokenized into
    data/ (a newcomer's finding: it read as skipped): ours, so not 'skipped'."""
    import numpy as np

    d = make_run_dir(tmp_path, traces=False)
    (d / "data").mkdir()
    for name in ("train.npy", "valid.npy"):
        np.save(d / "data" / name, np.arange(64, dtype=np.uint16))
    (d / "logs").mkdir(exist_ok=True)
    for name in ("rank0.err", "rank0.out", "state_bytes_rank0.json", "layout_rank0.json"):
        (d / "logs" / name).write_text("{}\n" if name.endswith(".json") else "warning: something\n")
    (d / "report.md").write_text("# layoutlab report\n")
    (d / "notes.txt").write_text("my own notes\n")  # not ours: still skipped, with its reason
    rep = build_report([("run", d)])
    run = rep.runs[0].run
    assert {p for p, _ in run.ours} >= {"logs/rank0.err", "logs/rank0.out", "logs/state_bytes_rank0.json",
                                        "logs/layout_rank0.json", "report.md", "launch_cmd.txt", "checkpoints",
                                        "data/train.npy", "data/valid.npy"}
    assert [p for p, _ in run.skipped] == ["notes.txt"]
    render_markdown(rep, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "logs/rank0.err — ours, not evidence: a rank's stderr" in md and "notes.txt — skipped" in md


def test_empty_trace_sections_say_how_to_fill_them(tmp_path):
    d = make_run_dir(tmp_path, traces=False)
    rep = build_report([("run", d)])
    render_markdown(rep, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    said = [line for line in md.splitlines() if "run with run.profile=torch" in line]
    assert len(said) >= 3 and all(line.startswith("No ") for line in said), said


def test_a_run_written_before_the_world_size_rename_is_still_read(tmp_path):
    """Metrics of schema version 1 (world, not world_size) are ours: recognised, read, their layout shown."""
    import json

    d = make_run_dir(tmp_path, traces=False)
    for f in (d / "metrics").glob("rank*.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        for r in lines:
            if r["kind"] == "meta":
                r["schema_version"], r["world"] = 1, r.pop("world_size")
        f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    (d / "resolved.json").unlink()  # the layout must come from the metrics' meta record
    rep = build_report([("run", d)])
    run = rep.runs[0]
    assert "metrics/rank0.jsonl" in {p for p, _ in run.run.files} and run.run.metrics is not None
    assert run.layout.world_size == 2 and run.stats is not None


_LORA = ["peft.method=lora", "peft.rank=4", 'peft.target_modules=["q_proj", "v_proj"]']


def _runs_row(md: str, label: str) -> str:
    """The Runs table's row of `label` in the rendered Markdown (the table whose header names the parameters)."""
    table = md.split("| run | path | kind | layout |", 1)[1].split("\n\n", 1)[0]
    return next(line for line in table.splitlines() if line.startswith(f"| {label} | "))


def test_a_fine_tune_shows_what_trains_and_how_its_mfu_is_counted(tmp_path):
    """12,345 trainable and 1,000,000 frozen parameters: 12,345 / 1,012,345 = 1.22% train; a run recorded before the
    meta record held the counts shows none, and the two runs' MFU count different FLOPs per token."""
    tuned = make_run_dir(tmp_path / "a", traces=False, overrides=_LORA, params=(12_345, 1_000_000))
    old = make_run_dir(tmp_path / "b", traces=False)
    rep = build_report([("tuned", tuned), ("old", old)])
    assert not [w for r in rep.runs for w in r.run.warnings if "params" in w]
    render_markdown(rep, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert re.search(r"\| 12\.3K trainable / 1M frozen \(1\.22%\) \| lora, rank 4, on q_proj, v_proj \| .*"
                     r"parameters: meta of metrics/rank0\.jsonl \|$", _runs_row(md, "tuned"))
    assert re.search(r"\| – \| none \(every parameter trains\) \| \d+ \| \d+ \| resolved\.json \|$", _runs_row(md, "old"))
    assert len(re.findall(r"\| MFU % \(FLOP/token differs: MFU formula\) \|", md)) == 2  # the answer and How fast
    assert re.search(r"runs count FLOP/token differently.*\(tuned: a \\\[peft\\\] fine-tune's own FLOPs, 4·N \+ "
                     r"6·adapters \+ 12·L·h·s per token, a fine-tune's; old: full training, 6·N \+ 12·L·h·s per "
                     r"token, torchtitan's\)", md)


@pytest.mark.parametrize("damage", [-5, float("nan"), "12k"], ids=["negative", "nan", "string"])
def test_a_damaged_trainable_count_is_one_warning_and_the_other_ranks_count_stands(tmp_path, damage):
    """A negative count passes the schema and is dropped as senseless; NaN or text makes the schema refuse rank 0's
    meta record. Either way rank 0's steps stay, one warning names the field, and rank 1's count is the run's."""
    import json

    run = make_run_dir(tmp_path, traces=False, overrides=_LORA, params=(12_345, 1_000_000))
    f = run / "metrics" / "rank0.jsonl"
    records = [json.loads(line) for line in f.read_text().splitlines()]
    records[0]["trainable_params"] = damage
    f.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    rep = build_report([("tuned", run)])
    (r,) = rep.runs
    named = [w for w in r.run.warnings if "trainable_params" in w]
    assert len(named) == 1 and named[0].startswith("metrics/rank0.jsonl"), r.run.warnings
    assert len(r.run.metrics) == 24 and r.run.metrics.meta.trainable_params == 12_345
    render_markdown(rep, tmp_path / "r.md")
    assert "| 12.3K trainable / 1M frozen (1.22%) |" in _runs_row((tmp_path / "r.md").read_text(), "tuned")
