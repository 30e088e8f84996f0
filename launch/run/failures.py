"""What a failed run says about itself after the fact: each rank's failure record and last recorded step."""
from __future__ import annotations

import json

from launch.run.rundir import RunDir


def failure_summary(run: RunDir, world_size: int) -> list[str]:
    """After a failed run: what each rank recorded about its failure (RunDir.failure), and the last step it
    recorded."""
    from launch.run.metrics import read_metrics

    lines = [f"error: the run failed; per-rank logs are in {run.logs}"]
    for rank in range(world_size):
        said = ""
        try:
            record = json.loads(run.failure(rank).read_text())
            said = str(record.get("message", "")) if isinstance(record, dict) else ""
        except (OSError, ValueError):
            pass
        step = ""
        if run.metrics(rank).is_file():
            steps = read_metrics(run.metrics(rank)).steps
            step = f"last recorded step {steps[-1].step if steps else 0}"
        lines.append(f"  rank {rank}: " + "; ".join(x for x in (step, said) if x) if (step or said) else
                     f"  rank {rank}: no failure recorded (killed, or stopped by torchrun); see {run.stderr(rank)}")
    return lines


def users_to_mend(run: RunDir, world_size: int) -> bool:
    """Whether a rank ended on what the user must change (its failure record's kind "resume": a checkpoint that cannot
    load, a file refused as untrusted), which the run then reports with exit 2 like any bad input."""
    for rank in range(world_size):
        try:
            record = json.loads(run.failure(rank).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("kind") == "resume":
            return True
    return False
