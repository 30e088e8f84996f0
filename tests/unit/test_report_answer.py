"""The report's first screen (analysis.report.answer, rendered by analysis.report.sections): runs ranked by
tokens/s/GPU within groups that share model, global batch, sequence and hardware; the fastest named with its margin;
each slower run's step difference split into the parts its traces measure. The runs here are built with a known
cause (an all-reduce made longer in every step of one run's traces) and the sentence must name it and its size."""
import json
from pathlib import Path

import pytest

from analysis.__main__ import main
from analysis.report.sections import CONSOLE_LINES
from launch.run.rundir import RECOMPUTE_REGION
from tests.unit.report_support import make_run_dir

COMPUTE_US = 10_000


def _trace(path: Path, rank: int, comm_us: int, steps: int = 4, recompute_us: int = 0) -> None:
    """A CPU rank's Kineto trace: each ProfilerStep is COMPUTE_US of a matmul, then recompute_us of another inside the
    trainer's recompute range (RECOMPUTE_REGION, as the torch backend marks it), then a gloo all-reduce of comm_us on
    the same thread (nothing overlaps it: all of it is exposed)."""
    events, t = [], 0
    for s in range(1, steps + 1):
        compute = COMPUTE_US + recompute_us
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t,
                    "dur": compute + comm_us},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": COMPUTE_US},
                   {"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": 1, "tid": 1, "ts": t + compute,
                    "dur": comm_us, "args": {"Input Dims": [[1024]], "Input type": ["float"]}}]
        if recompute_us:
            events += [{"ph": "X", "cat": "user_annotation", "name": RECOMPUTE_REGION, "pid": 1, "tid": 1,
                        "ts": t + COMPUTE_US, "dur": recompute_us},
                       {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + COMPUTE_US,
                        "dur": recompute_us}]
        t += compute + comm_us
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {
        "backend": "gloo", "rank": rank, "world_size": 2, "pg_config": [{"pg_name": "0", "pg_size": 2}]}}))


def _run(root: Path, name: str, comm_us: int | None, *overrides: str, recompute_us: int = 0) -> Path:
    """tiny_zero2's run whose metrics say each step took COMPUTE_US + recompute_us + comm_us; with its traces unless
    comm_us is None."""
    step_s = (COMPUTE_US + recompute_us + (comm_us or 2_000)) / 1e6
    d = make_run_dir(root, name, step_times=[step_s] * 12, traces=False, overrides=overrides)
    if comm_us is not None:
        (d / "traces").mkdir()
        for rank in range(2):
            _trace(d / "traces" / f"rank{rank}.json", rank, comm_us, recompute_us=recompute_us)
    return d


def _report(tmp_path: Path, capsys, *runs: Path) -> tuple[str, list[str]]:
    out = tmp_path / "report.md"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("wrote ")]
    return out.read_text(), printed


def test_the_slower_run_is_explained_by_the_cause_put_there(tmp_path, capsys):
    fast = _run(tmp_path, "20260101-000000", 2_000)
    slow = _run(tmp_path, "20260101-000001", 8_000)  # +6 ms of exposed all-reduce in every step
    md, printed = _report(tmp_path, capsys, slow, fast)
    answer = md[md.index("## The answer"):md.index("## Runs")]
    assert md.index("## The answer") < md.index("## Runs")  # the answer before any inventory
    assert "Fastest: tiny_zero2/20260101-000000, 21,333 tokens/s/GPU, 50.0% ahead of tiny_zero2/20260101-000001" \
        in answer  # 8 sequences × 64 tokens / 12 ms / 2 ranks; 18 ms for the other
    line = next(x for x in answer.splitlines() if x.startswith("- tiny_zero2/20260101-000001 is"))
    assert "6.0 ms a step slower" in line and "most of it exposed all_reduce" in line, line
    named = float(line.split("most of it exposed all_reduce ")[1].split(" ms")[0])
    assert named == pytest.approx(6.0, rel=0.15)
    # the console says the same after writing, on one screen
    assert any("most of it exposed all_reduce" in x for x in printed) and len(printed) <= CONSOLE_LINES
    assert printed[1].split()[:2] == ["1", "tiny_zero2/20260101-000000"]


def test_runs_of_another_batch_race_in_their_own_group_and_runs_without_traces_get_no_split(tmp_path, capsys):
    a = _run(tmp_path, "20260101-000000", 2_000)
    b = _run(tmp_path, "20260101-000001", None)  # no traces
    c = _run(tmp_path, "20260101-000002", 2_000, "batch.global_batch_size=16")
    md, _ = _report(tmp_path, capsys, a, b, c)
    answer = md[md.index("## The answer"):md.index("## Runs")]
    assert "The runs differ in global batch size" in answer and "(2 groups)" in answer
    assert "no traces for tiny_zero2/20260101-000001: the step time is measured, its split is not" in answer
    assert "tiny_zero2/20260101-000002 among runs of model tiny-llama, global batch size 16" in answer


def test_one_run_alone_gets_its_own_line(tmp_path, capsys):
    md, printed = _report(tmp_path, capsys, _run(tmp_path, "20260101-000000", 2_000))
    assert "- tiny_zero2/20260101-000000: 21,333 tokens/s/GPU, the only run with step records." in md
    assert "Fastest" not in md and len(printed) == 3  # the ranking's header, its row, the sentence


def test_recomputation_the_traces_mark_is_measured_not_estimated(tmp_path, capsys):
    """The torch backend marks each recomputation (RECOMPUTE_REGION): a run that recomputes 4 ms a step is slower by
    its recomputation, measured from the marked ranges, not from the plan's FLOPs."""
    fast = _run(tmp_path, "20260101-000000", 2_000)
    slow = _run(tmp_path, "20260101-000001", 2_000, recompute_us=4_000)
    md, _ = _report(tmp_path, capsys, fast, slow)
    line = next(x for x in md.splitlines() if x.startswith("- tiny_zero2/20260101-000001 is"))
    assert "4.0 ms a step slower" in line and "most of it recompute" in line, line
    named = float(line.split("most of it recompute ")[1].split(" ms")[0])
    assert named == pytest.approx(4.0, rel=0.15)
    split = md[md.index("| run | fastest |"):].split("\n")[2]
    assert "| measured |" in split, split


def test_the_plans_split_the_same_difference(tmp_path, capsys):
    """Beside the measured split, the plans': a run planned with full checkpointing (DeepSpeed here: one more forward
    of the layers, the recompute time its plan's compute model gives) against one without, read from each run's
    plan.json."""
    fast = _run(tmp_path, "20260101-000000", 2_000)
    slow = _run(tmp_path, "20260101-000001", 2_000, "train.activation_checkpointing=full", recompute_us=4_000)
    md, _ = _report(tmp_path, capsys, fast, slow)
    plans = [json.loads((d / "plan.json").read_text())["step"] for d in (fast, slow)]
    header, row = [line for line in md[md.index("| run | fastest | plan +ms | compute |"):].splitlines()[:3]
                   if not line.startswith("|---")]
    cells = dict(zip(header.strip("|").split(" | "), row.strip("|").split(" | "), strict=True))
    assert plans[0]["recompute_s"] == 0 < plans[1]["recompute_s"]
    assert float(cells["recompute"]) == pytest.approx(plans[1]["recompute_s"] * 1e3, abs=0.05)
    assert float(cells["compute"]) == pytest.approx((plans[1]["compute_s"] - plans[1]["recompute_s"]
                                                     - plans[0]["compute_s"]) * 1e3, abs=0.05)
    assert float(cells["plan +ms"]) == pytest.approx((plans[1]["total_s"] - plans[0]["total_s"]) * 1e3, abs=0.05)
