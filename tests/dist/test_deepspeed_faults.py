"""A rank that fails or stalls brings the job down in time, naming the rank and the step, with no orphans."""
import json
import re
import time

import pytest

from tests.dist.conftest import SHORT, train
from tests.dist.test_deepspeed_checkpoint import no_rank_left

# -m full (CI): a crashing and a stalled rank: the watchdog, over tiny_zero2's layout.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]


def test_crashing_rank_names_itself_and_the_step(runs_root):
    t = train(runs_root / "crash", *SHORT, env_extra={"LAYOUTLAB_FAULT": "crash:1:4"}, check=False)
    assert t.proc.returncode != 0
    assert "rank 1 failed at step 4: RuntimeError: injected fault" in t.proc.stderr
    assert "rank 1: last recorded step 3" in t.proc.stderr
    record = json.loads((t.root / "logs" / "failure_rank1.json").read_text())
    assert (record["rank"], record["step"], record["kind"]) == (1, 4, "exception")
    assert "RuntimeError: injected fault" in record["message"]
    assert no_rank_left(t.root)


def test_stalled_rank_is_ended_within_the_timeout(runs_root):
    t0 = time.time()
    t = train(runs_root / "hang", *SHORT, "run.timeout_s=15", env_extra={"LAYOUTLAB_FAULT": "hang:0:3"}, check=False,
              timeout=240)
    elapsed = time.time() - t0
    assert t.proc.returncode != 0
    # Rank 0 sleeps at the start of step 3; rank 1 waits for it in that step's first collective. Each rank's
    # watchdog sees no progress for the same timeout, so whichever notices first ends the job and names itself:
    # the step is certain, the rank is either.
    out = t.proc.stderr + t.proc.stdout
    assert re.search(r"rank [01] stalled at step 3 \(step\) for \d+ s > run\.timeout_s=15", out), out[-2000:]
    # Whichever fires, the sleeping rank is the one named outside any collective: itself, or as the likely cause.
    assert re.search(r"rank 0 (stalled at step 3 \(step\) for \d+ s > run\.timeout_s=15, outside any collective|"
                     r"is outside any collective at step 3) \(launch/ranks/trainers/common\.py:\d+ in inject_fault\)",
                     out), out[-2000:]
    records = [json.loads(p.read_text()) for p in sorted((t.root / "logs").glob("failure_rank*.json"))]
    assert any(r["kind"] == "stall" and r["step"] == 3 for r in records), records
    assert elapsed < 15 + 60, elapsed  # start-up + the timeout + teardown, far from hanging forever
    assert no_rank_left(t.root), "a rank outlived the job"
