"""Every recipe's tiny twin trains: the catalogue's layouts on CPU ranks, a few steps each, in one sweep per group of
twins held equal (the seed's 7B matrix; the T4 ladder; the multi-node layouts), each sweep ending in its report.

The oracle is the run's own metrics read here: every step recorded, the loss finite and lower at the end than at the
start (a tiny model at lr 3e-3 falls from ln 512 ≈ 6.24 within a few steps), and the report naming every run."""
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from launch.run.metrics import read_metrics
from tests.conftest import REPO, RECIPES

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS = 6
# Half the twins' global batch: TP 4 has no data parallelism, so each step is 8 micro-batches at the recipes' 8; at 4
# the layouts train the same way in half the time (the suite's budget), and the loss still falls within the steps.
GLOBAL_BATCH = 4
TWINS = sorted(p.parent.name for p in RECIPES.glob("tiny_*/recipe.toml")
               if (RECIPES / p.parent.name.removeprefix("tiny_") / "recipe.toml").is_file())
GROUPS = {  # sweeps hold the batch, the sequence and the steps equal; each group also shares its rank count
    "7b_matrix": [t for t in TWINS if t.startswith("tiny_7b_")],
    "t4_ladder": [t for t in TWINS if "_t4_" in t],
    "multi_node": [t for t in TWINS if t.startswith(("tiny_8b_", "tiny_70b_"))],
}


def test_the_groups_hold_every_twin():
    assert sorted(t for group in GROUPS.values() for t in group) == TWINS and len(GROUPS["7b_matrix"]) >= 10


def _losses(run: Path) -> list[float]:
    """The loss curve of a run: the rank that records losses (the last pipeline stage holds the loss under PP)."""
    for path in sorted((run / "metrics").glob("rank*.jsonl")):
        losses = [s.loss for s in read_metrics(path).steps if s.loss is not None]
        if losses:
            return losses
    return []


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_twin_trains(tmp_path, group):
    twins = GROUPS[group]
    p = subprocess.run(["bash", "launch/sweep.sh", *(f"recipes/{t}" for t in twins), f"train.steps={STEPS}",
                        f"batch.global_batch_size={GLOBAL_BATCH}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    sweep = Path(re.search(r"^report: (\S+)$", p.stdout, re.M).group(1)).parent
    for twin in twins:
        runs = [d for d in (sweep / twin).glob("*") if (d / "resolved.json").is_file()]
        assert len(runs) == 1, (twin, runs)
        losses = _losses(runs[0])
        assert len(losses) == STEPS and all(map(math.isfinite, losses)), (twin, losses)
        assert losses[-1] < losses[0], (twin, losses)
    report = (sweep / "report.md").read_text()
    named = set(re.findall(r"^\| (tiny_\S+) \|", report, re.M))
    assert set(twins) <= named, set(twins) - named
    # every file a run of ours writes is read or known as ours: none listed as unreadable
    assert not re.findall(r"^- .* — skipped: .*$", report, re.M), re.findall(r"^- .* — skipped: .*$", report, re.M)
