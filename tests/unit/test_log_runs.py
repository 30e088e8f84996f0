"""A Megatron / DeepSpeed log that holds several runs is reported as several runs (analysis.parsers.runs.load_runs,
the parsers' `meta.run_starts`): each with its own layout, steps, timers, memory and validation, and the line it
starts at. Expectations are read from the fixtures' own text."""
from __future__ import annotations

import re
import shutil
import statistics
from pathlib import Path

import pytest

from analysis.__main__ import main
from analysis.parsers.deepspeed_log import parse_deepspeed_log
from analysis.parsers.megatron_log import parse_megatron_log
from analysis.report import build_report
from tests.unit.report_support import ALCF, LOGS

THREE = LOGS / "c_megatron_deepspeed_three_runs_appended.txt"
MDS_COLON = LOGS / "c_megatron_deepspeed_2024_colon_with_ds.txt"
ITERATION = re.compile(r" iteration\s+(\d+)/\s*(\d+) \|.*elapsed time per iteration \(ms\): ([\d.]+) \|.*"
                       r"global batch size:\s+(\d+) \|")
MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \|.*max reserved: ([\d.]+)")
VALIDATION = re.compile(r"validation loss at iteration (\d+)")
MIB = 1024 ** 2


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")


def _three_runs() -> list[dict]:
    """Each run of THREE as its text says: the next starts at its `using world size` line."""
    lines = _lines(THREE)
    starts = [1] + [n for n, line in enumerate(lines, start=1) if line.startswith("using world size:")][1:]
    assert len(starts) == 3
    runs = []
    for first, end in zip(starts, starts[1:] + [len(lines)], strict=True):
        own = [(n, lines[n - 1]) for n in range(first, end)]
        its = [(n, m) for n, line in own if (m := ITERATION.search(line))]
        runs.append({
            "first": first, "last": end - 1 if end < len(lines) else len(lines) - 1,
            "steps": [(int(m[1]), float(m[3]) / 1000, f"{THREE.name}:{n}") for n, m in its],
            "batch": {int(m[4]) for _, m in its},
            "memory": {int(m[1]): (float(m[2]) * MIB, f"{THREE.name}:{n}") for n, line in own
                       if (m := MEMORY.search(line))},
            "validation": [int(m[1]) for _, line in own if (m := VALIDATION.search(line))],
            "setup_timer": next(n for n, line in own if "model-and-optimizer-setup" in line),
        })
    return runs


def test_three_runs_appended_to_one_log_are_three_runs_each_with_its_own_batch_speed_and_start():
    want = _three_runs()
    rep = build_report([(None, THREE)])
    assert [r.label for r in rep.runs] == [f"{THREE.stem}#{k}" for k in (1, 2, 3)]
    assert [w["batch"] for w in want] == [{768}, {96}, {32}]
    for res, w in zip(rep.runs, want, strict=True):
        assert res.run.segment.startswith(f"lines {w['first']}–{w['last']} of {THREE.name}: ")
        assert res.layout.global_batch_size in w["batch"]
        # Its own iterations only: no other run's iteration 2 pooled in as another rank of the same step.
        assert [(s["step"], s["step_time_s"], s["source"]) for s in res.steps.rows()] == w["steps"]
        # Warm-up: half of the 6 records dropped (the foreign-log rule), the median of the rest.
        assert next(res.stats.rows())["step_time_median_s"] == pytest.approx(
            statistics.median(t for _, t, _ in w["steps"][3:]), rel=1e-12)
        # pytest.approx takes no nested containers (pytest >= 9 raises TypeError): bytes approx, source exact.
        memory = {m["rank"]: (m["measured_bytes"], m["source"]) for m in res.memory.rows()}
        assert memory.keys() == w["memory"].keys()
        for rank, (measured, source) in memory.items():
            assert measured == pytest.approx(w["memory"][rank][0]) and source == w["memory"][rank][1]
        assert [v.iteration for v in res.validation] == w["validation"]
        assert res.boundaries == []
        # Timers and set-up timers from the run's own lines.
        for log in [*res.run.megatron, *res.run.deepspeed]:
            assert all(w["first"] <= n <= w["last"] for n in log.columns["line"]), log.source
        (meg,) = res.run.megatron
        assert [r["line"] for r in meg.rows() if r["kind"] == "timer" and r["iteration"] is None
                and r["name"] == "model-and-optimizer-setup"] == [w["setup_timer"]]
    assert [r.layout.dp for r in rep.runs] == [16, 8, 4] and [r.layout.tp for r in rep.runs] == [1, 1, 2]
    assert [len(r.run.megatron[0].meta.run_starts) for r in rep.runs] == [0, 0, 0]


def test_the_report_of_a_log_holding_three_runs_compares_them_and_names_where_each_starts(tmp_path, capsys):
    want = _three_runs()
    out = tmp_path / "x.md"
    assert main(["report", str(THREE), "-o", str(out)]) == 0
    md = out.read_text()
    runs = md[md.index("## Runs"):]
    assert "## The answer: 3 run(s)" in md and all(f"| {THREE.stem}#{k} |" in runs for k in (1, 2, 3))
    listed = md.split("**Several runs in one file, each reported as a run of its own**")[1].split("\n\n")[1]
    assert [line.split(": ")[1].split(" of ")[0] for line in listed.splitlines()] == [
        f"lines {w['first']}–{w['last']}" for w in want]
    speed = md.split("## How fast")[1].split("\n\n")[1].splitlines()[2:]
    medians = [float(row.split("|")[2].replace(",", "")) for row in speed]
    assert medians == pytest.approx([statistics.median(t for _, t, _ in w["steps"][3:]) * 1e3 for w in want],
                                    abs=0.05)
    assert "mismatched_runs" in md  # the doctor compares them like any runs: global batch 768, 96, 32


def test_a_log_with_one_run_stays_one_run_under_its_own_label():
    singles = sorted(p for p in LOGS.iterdir() if p.suffix in (".txt", ".out") and p not in (THREE, ALCF))
    assert len(singles) >= 8
    for path in singles:
        (res,) = build_report([(None, path)]).runs
        assert res.label == path.stem.split(".")[0] and res.run.segment is None
        parsed = {"megatron_log": parse_megatron_log, "deepspeed_log": parse_deepspeed_log}
        for log in [*res.run.megatron, *res.run.deepspeed]:
            whole = parsed[log.name](path, source=path.name)
            assert (log.columns["line"], log.meta, log.warnings) == (whole.columns["line"], whole.meta, whole.warnings)


def test_the_alcf_excerpt_is_three_runs_where_the_time_falls_back_and_a_validation_passes_the_run_total():
    lines = _lines(ALCF)
    back = next(n for n, line in enumerate(lines, start=1) if "[2025-11-10 09:43:" in line)
    valid = next(n for n, line in enumerate(lines, start=1) if "validation loss at iteration 137650" in line)
    total = {int(m[1]) for line in lines if (m := re.search(r"iteration=\s*\d+/\s*(\d+)", line))}
    assert total == {136100}
    set_up, training, later = build_report([("alcf", ALCF)]).runs
    assert [r.label for r in (set_up, training, later)] == ["alcf#1", "alcf#2", "alcf#3"]
    assert set_up.run.segment.startswith(f"lines 1–{back - 1} ") and "line" in set_up.run.segment
    assert training.run.segment.startswith(f"lines {back}–{valid - 1} ") and "time falls back" in training.run.segment
    assert later.run.segment.startswith(f"lines {valid}–") and "past the 136100 iterations" in later.run.segment
    # The set-up block (another run's, timestamped after the iterations): its memory reports, no steps.
    assert set_up.steps is None and {m["source"] for m in set_up.memory.rows()} == {f"{ALCF.name}:10"}
    assert [s["step"] for s in training.steps.rows()] == list(range(136004, 136011))
    assert training.validation == [] and [v.iteration for v in later.validation] == [137650]
    assert later.steps is None and any(r["kind"] == "comms" for r in later.run.deepspeed[0].rows())


def test_a_restarted_job_without_set_up_lines_starts_at_the_first_line_of_its_first_step(tmp_path):
    text = MDS_COLON.read_text()
    n = len(text.split("\n"))  # the file has no final newline: the copy's first line joins its last
    (tmp_path / "train.log").write_text(text + "\n" + text)
    first_ds = n + next(k for k, line in enumerate(text.split("\n")) if "time (ms)" in line)
    one, two = build_report([(None, tmp_path / "train.log")]).runs
    # Megatron sees `iteration 1` after `iteration 2`, DeepSpeed `step=1` after `step=2` a few lines earlier: one run
    # start, at the first line of DeepSpeed's step.
    assert two.run.segment.startswith(f"lines {first_ds + 1}–") and "DeepSpeed's step=1" in two.run.segment
    assert "iteration 1 (line" in two.run.segment
    for log in [*two.run.megatron, *two.run.deepspeed]:
        assert min(log.columns["line"]) > n
    assert [s["step"] for s in one.steps.rows()] == [s["step"] for s in two.steps.rows()] == [1, 2]


def test_a_folder_keeps_its_other_files_as_one_run_beside_the_runs_of_its_log(tmp_path):
    shutil.copy(THREE, tmp_path / "appended.log")
    shutil.copy(LOGS / "c_megatron_lm_2025_minmax_moe.txt", tmp_path / "other.log")
    rep = build_report([("exp", tmp_path)])
    assert [r.label for r in rep.runs] == ["exp", "exp/appended.log#1", "exp/appended.log#2", "exp/appended.log#3"]
    assert [f for f, _ in rep.runs[0].run.files] == ["other.log"]
    assert [r.layout.global_batch_size for r in rep.runs] == [256, 768, 96, 32]


# ---------------------------------------------------------------------------------------------
# What the parsers take for the start of another run


def _iteration(n: int, total: int = 500, batch: int = 32, stamp: str = "") -> str:
    """A Megatron-DeepSpeed colon-form iteration line, as MDS_COLON's."""
    line = next(line for line in _lines(MDS_COLON) if ITERATION.search(line))
    line = re.sub(r"iteration\s+\d+/\s*\d+", f"iteration {n:8d}/{total:8d}", line)
    line = re.sub(r"global batch size:\s+\d+", f"global batch size: {batch:5d}", line)
    return f"[{stamp}]{line}" if stamp else line


def _starts(text: str) -> list[int]:
    return [s.line for s in parse_megatron_log(text).meta.run_starts]


def test_a_new_wandb_run_name_starts_a_run_and_the_same_name_at_its_end_does_not():
    lines = ["wandb: Syncing run alpha-1", _iteration(1), _iteration(2),
             "wandb: 🚀 View run alpha-1 at: https://wandb.ai/team/project/runs/a1b2c3",
             "wandb: Syncing run beta-2", _iteration(3), _iteration(4)]
    assert _starts("\n".join(lines) + "\n") == [5]
    assert _starts("\n".join(lines[:4]) + "\n") == []


def test_another_total_of_iterations_or_a_falling_iteration_starts_a_run():
    assert _starts("\n".join([_iteration(1), _iteration(2), _iteration(3, total=800)]) + "\n") == [3]
    assert _starts("\n".join([_iteration(5), _iteration(6), _iteration(6)]) + "\n") == [3]


@pytest.mark.parametrize("ramp_up, batches, starts", [
    (None, (64, 32), [2]),               # a batch never shrinks within a run
    (None, (32, 64), []),                # growing may be a ramp-up: no dump says otherwise (still flagged)
    ("None", (32, 64), [5]),             # the arguments declare no ramp-up
    ("['32', '32', '1000']", (32, 64), []),
])
def test_a_changed_global_batch_starts_a_run_unless_it_may_be_ramping_up(ramp_up, batches, starts):
    dump = [] if ramp_up is None else ["------------------------ arguments ------------------------",
                                       f"  rampup_batch_size {'.' * 31} {ramp_up}",
                                       "-------------------- end of arguments ---------------------"]
    lines = dump + [_iteration(k, batch=b) for k, b in enumerate(batches, start=1)]
    assert _starts("\n".join(lines) + "\n") == starts


def test_time_falling_back_by_minutes_starts_a_run_and_by_seconds_does_not():
    def stamps(*times: str) -> str:
        return "\n".join(_iteration(k, stamp=f"2024-06-03 {t}") for k, t in enumerate(times, start=1)) + "\n"

    assert _starts(stamps("10:00:00", "10:06:00", "10:01:01")) == []  # within TIME_FALLBACK_S
    assert _starts(stamps("10:00:00", "10:06:00", "10:00:59")) == [3]
    ds = parse_deepspeed_log("\n".join(
        f"[2024-06-03 {t},000] [INFO] [logging.py:96:log_dist] [Rank 0] step={k}, skipped=0, lr=[0.1], mom=[0.9]"
        for k, t in enumerate(("10:06:00", "10:00:59"), start=1)) + "\n")
    assert [s.line for s in ds.meta.run_starts] == [2]


def test_deepspeed_ranks_counting_their_own_steps_are_one_run_and_a_step_falling_back_starts_at_its_first_line():
    def step(rank: int, n: int) -> str:
        return (f"[2024-06-03 10:00:0{n},000] [INFO] [logging.py:96:log_dist] [Rank {rank}] step={n}, skipped=0, "
                f"lr=[0.1], mom=[0.9]")

    timer = "[2024-06-03 10:00:05,000] [INFO] [logging.py:96:log_dist] [Rank 0] time (ms) | optimizer_step: 1.00"
    close = "[2024-06-03 10:00:05,000] [INFO] [logging.py:96:log_dist] [Rank 0] time (ms) | fwd: 1.00 | step: 2.00"
    ranks = [step(0, 1), step(1, 1), close, step(0, 2), step(1, 2), close]
    assert parse_deepspeed_log("\n".join(ranks) + "\n").meta.run_starts == ()
    restarted = ranks + [timer, step(0, 1), close]
    (start,) = parse_deepspeed_log("\n".join(restarted) + "\n").meta.run_starts
    assert (start.line, start.after) == (7, 6) and "step=1 (line 8) after step=2 (line 4)" in start.why


def test_deepspeed_starting_again_takes_the_set_up_records_since_the_last_step_into_the_new_run():
    def line(msg: str, at: str = "10:00:00", where: str = "logging.py:96:log_dist] [Rank 0") -> str:
        return f"[2024-06-03 {at},000] [INFO] [{where}] {msg}"

    # Timers off: `step=` lines alone delimit the steps, so the set-up after the last one is not that step's.
    text = [line("step=1, skipped=0, lr=[0.1], mom=[0.9]"), line("step=2, skipped=0, lr=[0.1], mom=[0.9]"),
            line("After Building Model", where="utils.py:800:see_memory_usage"),
            line("MA 1.0 GB         Max_MA 1.0 GB         CA 1.0 GB         Max_CA 1 GB ",
                 where="utils.py:801:see_memory_usage"),
            line("DeepSpeed info: version=0.14.0, git-hash=unknown, git-branch=unknown"),
            line("step=1, skipped=0, lr=[0.1], mom=[0.9]")]
    (start,) = parse_deepspeed_log("\n".join(text) + "\n").meta.run_starts
    assert (start.line, start.after) == (4, 2) and "version line, line 5" in start.why


def test_a_files_own_read_warning_is_said_once_not_per_run(tmp_path):
    """A log that holds three runs and NUL filler (what a crashed node's file system leaves): the NUL warning belongs
    to the file, said with its first run only (it was counted three times)."""
    damaged = tmp_path / THREE.name
    damaged.write_bytes(THREE.read_bytes().replace(b"\n", b"\n" + b"\0" * 64, 1))
    runs = build_report([(None, damaged)]).runs
    assert len(runs) == 3
    said = [w for r in runs for w in r.run.warnings if "NUL" in w]
    assert len(said) == 1, said


def test_splitting_a_log_reads_each_line_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Each run of a split log is parsed from its own lines, numbered from where it starts: the lines fed to the
    parsers grow with the file, not with the file times its runs (padding each run with the lines before it did:
    240 runs of one file took 30 s)."""
    from analysis.parsers import _text

    many = tmp_path / "many.log"
    many.write_text(THREE.read_text() * 40)
    fed = []
    feed = _text.LineParser.feed
    monkeypatch.setattr(_text.LineParser, "feed",
                        lambda self, text, *a: fed.append(text.count("\n")) or feed(self, text, *a))
    runs = build_report([(None, many)]).runs
    assert len(runs) == 120
    lines = many.read_text().count("\n")
    assert sum(fed) <= 4 * lines, (sum(fed), lines)  # the whole file by each parser, then each run once by each
