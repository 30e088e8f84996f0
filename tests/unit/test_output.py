"""Output for people: a run's plan summary in at most 15 lines, dry-run tables within 100 columns (piped text is not
wrapped), sizes and counts in
adaptive units, every predicted time labelled with where its figures come from."""
import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from launch.commands.render import summary
from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from launch.run import launcher
from launch.units import GiB, KiB, MiB, human_bytes, human_count
from tests.conftest import RECIPES, REPO


@pytest.mark.parametrize("n, shown", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (512 * KiB, "512 KiB"),
                                      (int(0.51 * GiB), "522 MiB"), (80 * GiB, "80 GiB"), (3 * MiB + 1, "3 MiB")])
def test_sizes_take_the_largest_unit_that_keeps_the_number_at_least_one(n, shown):
    assert human_bytes(n) == shown


@pytest.mark.parametrize("n, shown", [(999, "999"), (214_000, "214K"), (494_032_768, "494M"), (6_738_415_616, "6.74B")])
def test_counts_say_thousands_millions_billions(n, shown):
    assert human_count(n) == shown


@pytest.mark.parametrize("recipe", ["tiny_zero2", "tiny_tp2_pp2", "7b_tp2_zero3", "8b_tp8_sp_zero1"])
def test_a_run_prints_at_most_15_plan_lines(recipe):
    resolved = resolve_path(RECIPES / recipe)
    plan = plan_resolved(resolved)
    cmd = launcher.build(resolved, "runs/x/1")
    out = io.StringIO()
    summary(resolved, plan, cmd, "runs/x/1", Console(file=out, width=100))
    lines = out.getvalue().splitlines()
    assert 4 <= len(lines) <= 15, out.getvalue()
    assert "params)" in lines[1] and "0.000B" not in out.getvalue()
    assert "predicted step" in out.getvalue() and "nominal: the " in out.getvalue()  # labelled beside the number


def test_a_nominal_cpu_prediction_says_what_runs_measured_and_how_long_calibrate_takes():
    """A newcomer's first predicted step (15.9 ms) read as a measurement and the run took 44-75 ms (34 ms quiet): the line says what
    tiny CPU runs measured against the nominal figures, and how long measuring this machine takes (calibrate's own
    count of its launches, at the rates it was measured at: launch/config/calibration.py)."""
    import re

    from launch.config import calibration as cal

    resolved = resolve_path(RECIPES / "tiny_zero2")
    out = io.StringIO()
    summary(resolved, plan_resolved(resolved), launcher.build(resolved, "runs/x/1"), "runs/x/1",
            Console(file=out, width=400))
    line = next(ln for ln in out.getvalue().splitlines() if "predicted step" in ln)
    assert "have measured tiny_zero2 at 34 ms a step quiet" in line, line
    # 2 ranks: one group size (2) swept twice, one probe, three backends × TP 1 and 2
    minutes = (2 + 1 + 6) * cal.LAUNCH_S / 60 + 6 * cal.ITERS * cal.PASS_ITER_S / 60
    assert re.search(rf"`python -m launch calibrate` \(about {minutes:.0f} min\) measures this machine", line), line
    gpu = resolve_path(RECIPES / "7b_tp2_zero3")
    out = io.StringIO()
    summary(gpu, plan_resolved(gpu), launcher.build(gpu, "runs/x/1"), "runs/x/1", Console(file=out, width=400))
    assert "calibrate` (about" not in out.getvalue() and "have measured tiny_zero2" not in out.getvalue()


@pytest.mark.parametrize("recipe", ["tiny_zero2", "tiny_tp2_pp2", "7b_tp2_zero3", "8b_tp8_sp_zero1"])
def test_the_dry_run_fits_100_columns_but_for_the_commands_to_copy(recipe):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run([sys.executable, "-m", "launch", "run", str(RECIPES / recipe), "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    commands = [ln for ln in p.stdout.splitlines() if "-m torch.distributed.run" in ln or "-m launch.ranks" in ln
                or ln.startswith(("deepspeed ", "  node "))]
    # piped, a message line is left whole (below); every other line (tables, rules) fits 100 columns
    messages = ("  note: ", "predicted step (", "  model FLOPs/step ", "  accounting: ", "  overrides: ", "  chain: ",
                "  backend=", "  batch: ")
    wide = [ln for ln in p.stdout.splitlines() if len(ln) > 100 and ln not in commands and not ln.startswith(messages)]
    assert not wide, wide
    assert "memory per rank (" in p.stdout and "communication per step" in p.stdout
    # piped, a message is not wrapped mid-phrase: each of the plan's notes is one whole line
    plan = plan_resolved(resolve_path(RECIPES / recipe, []))
    lines = p.stdout.splitlines()
    assert plan.notes and all(f"  note: {n}" in lines for n in plan.notes), (plan.notes, p.stdout)
