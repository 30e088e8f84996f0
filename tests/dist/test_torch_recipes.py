"""README's FSDP2-against-ZeRO-3 sweep gives one report whose loss table says the two curves agree. (The torch
layouts of the catalogue train in tests/dist/test_twins.py, as their twins: DDP, FSDP2, TP 2 + SP × FSDP2.)"""
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

# -m full (CI): FSDP2 against ZeRO-3 as a sweep: test_torch_parity compares the same two runs.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
SWEEP = "bash launch/sweep.sh recipes/tiny_fsdp2 recipes/tiny_zero2 parallel.zero_stage=3"


def test_fsdp2_against_zero3_sweep_reports_equal_curves(tmp_path):
    assert SWEEP in (REPO / "README.md").read_text()
    p = subprocess.run([*SWEEP.split(), "train.steps=12", "train.warmup_steps=2"], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = Path(re.search(r"^report: (\S+)$", p.stdout, re.M).group(1)).read_text()
    # | run | against | steps compared | max |Δ loss| | ... | expected to agree | source |
    row = re.search(r"^\| tiny_zero2 \| tiny_fsdp2 \| (\d+) \| ([0-9.e+-]+) \|.*\| (yes[^|]*)\|", report, re.M)
    assert row, report
    assert int(row.group(1)) == 12 and float(row.group(2)) <= 1e-5 and row.group(3).startswith("yes")
    # a sweep's runs are benchmarks: no final checkpoint unless asked (run.save_final)
    runs = [d for d in (tmp_path / "runs" / "sweeps").glob("*/tiny_*/*") if (d / "resolved.json").is_file()]
    assert len(runs) == 2 and not [c for d in runs for c in (d / "checkpoints").glob("step*")]
