"""README's first command works after the other documented commands have run in the same runs folder: a run of
another layout, recommend, a sweep's dry run and export-accelerate leave nothing that makes it refuse or resume
someone else's checkpoint (issue: `run.resume=auto` used to pick up whatever sat under the recipe's folder)."""
import os
import subprocess
import sys

import pytest

from launch.run.metrics import read_metrics
from tests.conftest import REPO

# -m full (CI): README's commands in order: a feature over layouts the parity tests train.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
SHORT = ("train.steps=4", "train.warmup_steps=1", "train.lr_warmup_steps=1")
DOCUMENTED = [  # (the command as README or docs/ show it, what this test appends to keep it short)
    ("bash launch/run.sh recipes/tiny_zero2 parallel.zero_stage=3 parallel.tp=2 hardware.gpus_per_node=4",
     (*SHORT, "train.checkpoint_every=2")),
    ("python -m launch recommend recipes/tiny_zero2", ("top=3",)),
    ("bash launch/sweep.sh recipes/tiny_zero2 recipes/tiny_tp2_zero3 --dry-run", ()),
    ("python -m launch export-accelerate recipes/tiny_zero2", ()),
]
FIRST = "bash launch/run.sh recipes/tiny_zero2"


def _run(command: str, extra, runs):
    argv = command.split()
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
    p = subprocess.run([*argv, *extra], cwd=REPO, env={**os.environ, "LAYOUTLAB_RUNS": str(runs)},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{command}: {p.stdout[-2000:]}{p.stderr[-2000:]}"
    return p


def test_readme_first_command_after_every_other(tmp_path):
    shown = (REPO / "README.md").read_text() + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    for command, _ in [*DOCUMENTED, (FIRST, ())]:
        assert command in shown, command  # the commands this test runs are the ones the documents show
    runs = tmp_path / "runs"
    for command, extra in DOCUMENTED:
        _run(command, extra, runs)
    p = _run(FIRST, SHORT, runs)
    assert "starting fresh" in p.stdout and "differs in" in p.stdout, p.stdout
    (latest,) = [d for d in (runs / "tiny_zero2").iterdir() if (d / "metrics" / "rank0.jsonl").is_file()
                 and read_metrics(d / "metrics" / "rank0.jsonl").meta.zero_stage == 2]
    meta = read_metrics(latest / "metrics" / "rank0.jsonl").meta
    assert (meta.start_step, meta.resumed_from) == (0, None)
