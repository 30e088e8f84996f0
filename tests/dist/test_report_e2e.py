"""Two real tiny runs (ZeRO-2 vs ZeRO-3 on 2 gloo ranks, torch profiler on: the parity tests' runs) and one
collective sweep (run.mode=commbench: the commbench test's) through run.sh, then one report on both runs with the sweep as the ceiling: step
statistics agree with the metrics, memory sits beside the plan, the CPU-only traces give a breakdown
with its stated CPU-side definition, achieved busbw is set against the sweep, HTML + Markdown are
written."""
from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from analysis.report import build_report, write_report
from analysis.report.answer import answer
from launch.run.metrics import read_metrics
from tests.conftest import REPO
from tests.dist.conftest import DS_DP2, commbench, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_runs(shared_run):
    return shared_run(*DS_DP2[2]), shared_run(*DS_DP2[3]), shared_run(*commbench(2, "float32"))


def _median_measured(run) -> float:
    per_step: dict[int, float] = {}
    for rank in (0, 1):
        for s in read_metrics(run.root / "metrics" / f"rank{rank}.jsonl").steps:
            if not s.warmup:
                per_step[s.step] = max(per_step.get(s.step, 0.0), s.step_time_s)
    return statistics.median(per_step.values())


def test_report_on_two_real_runs(two_runs, tmp_path):
    z2, z3, bench = two_runs
    rep = build_report([("zero2", z2.root), ("zero3", z3.root)], ceiling=str(bench.root))
    assert [r.label for r in rep.runs] == ["zero2", "zero3"]
    for res, run in zip(rep.runs, (z2, z3)):
        s = next(res.stats.rows())
        assert s["steps_dropped"] == 2 and s["steps_measured"] == 8  # SHORT: 10 steps, 2 of warm-up
        assert s["step_time_median_s"] == pytest.approx(_median_measured(run))
        mem = list(res.memory.rows())
        assert len(mem) == 2 and all(m["predicted_bytes"] and m["predicted_what"].startswith("plan.json")
                                     for m in mem)
        assert all(m["measured_what"] == "peak RSS (CPU process)" for m in mem)
        assert {b["basis"] for b in res.breakdown.rows()} == {"cpu_ops"}
        assert any("cpu_ops basis (CPU-only trace): compute = CPU ops on the training thread" in n for n in res.notes)
        assert res.bandwidth is not None and len(res.bandwidth) > 0 and res.vs_layout is not None
    ag = [{r["collective"]: r["calls_per_step"] for r in res.bandwidth.rows()}.get("all_gather", 0.0)
          for res in rep.runs]
    assert ag[1] > ag[0]  # ZeRO-3 gathers parameters every forward and backward, ZeRO-2 once per step
    # The planner's calls (launch.plan.collectives.communication) against the traces: every collective within its range
    # (a gradient reduction may run as all-reduce or reduce-scatter), ZeRO-3's gathers exactly: each of tiny-llama's
    # 4 x 9 + 3 tensors is under the persistence threshold and is gathered once after the step.
    for res in rep.runs:
        for v in res.vs_layout.rows():
            assert v["expected_min_per_step"] <= v["observed_per_step"] <= v["expected_max_per_step"], v
    z3 = {v["collective"]: v for v in rep.runs[1].vs_layout.rows()}
    assert z3["all_gather"]["observed_per_step"] == z3["all_gather"]["expected_max_per_step"] == 4 * 9 + 3
    for res in rep.runs:
        ar = next(r for r in res.bandwidth.rows() if r["collective"] == "all_reduce")
        assert ar["ceiling_GBps"] > 0 and ar["pct_of_ceiling"] is not None
        assert ar["ceiling_source"].endswith("commbench/all_reduce.txt")
    out = write_report(rep, [tmp_path / "r.html", tmp_path / "r.md"])
    html = (tmp_path / "r.html").read_text()
    md = (tmp_path / "r.md").read_text()
    assert {p.name for p in out} >= {"r.html", "r.md"}
    assert "cpu_ops basis (CPU-only trace)" in html and "traces/rank0.json" in html
    assert "## Prediction vs measurement" in md and "plan.json" in md


def test_cli_on_a_real_run(two_runs, tmp_path):
    z2, _, _ = two_runs
    p = subprocess.run([sys.executable, "-m", "analysis", "report", str(z2.root), "-o", str(tmp_path / "r.md")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "r.md").is_file()


@pytest.mark.full
def test_a_delayed_rank_is_named_with_its_cost(runs_root):
    """A straggler of known cost: LAYOUTLAB_FAULT=slow:1:150 holds rank 1 for 150 ms at the start of every step of
    the ZeRO-2 run's layout (long beside the step, ~30 ms, so that the two runs' noise on a shared machine stays
    inside the tolerance). The answer ranks the delayed run second; its median step is slower by the split's waiting
    parts, rank 1's idle time and rank 0's exposed all-reduce (waiting for it), which add up to the delay within 25%
    (15% held on a quiet machine; a loaded one moved 25 ms of the wait into the compute's difference),
    plus or minus the two runs' compute difference, which on a machine shared with the other worker (CI's measured
    +32 ms) is bounded by the plain run's own step, doubled; and it names rank 1 from the doctor's findings."""
    # the plain run trained here, just before the delayed one, not the shared one: a run kept from an earlier session
    # (shared_run's cache) ran under another load, and its idle and waiting shares are the baseline of the split
    plain = train(runs_root / "plain", *DS_DP2[2])
    delayed = train(runs_root / "delayed", *DS_DP2[2], env_extra={"LAYOUTLAB_FAULT": "slow:1:150"})
    (group,) = answer(build_report([("plain", plain.root), ("delayed", delayed.root)])).groups
    assert [s.label for s in group.standings] == ["plain", "delayed"]
    (why,) = group.why
    waited = sum(p.delta_s for p in why.parts if p.name in ("idle", "exposed all_reduce"))
    assert waited == pytest.approx(0.150, rel=0.25), why.parts
    assert abs(why.delta_s - waited) <= 2 * group.standings[0].step_s, (why.delta_s, why.parts)
    assert "rank 1" in why.waited_for.message, why.waited_for
