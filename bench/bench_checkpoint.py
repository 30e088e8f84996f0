"""Asynchronous checkpoints: the time a save blocks training with run.checkpoint_async=true (DCP's async_save) against
the synchronous save (the baseline), the same recipe, model and layout, measured in the same invocation.

    python bench/bench_checkpoint.py [model.config=tests/fixtures/models/tall-llama/config.json] [key=value ...]

The torch backend's FSDP2 (tiny_fsdp2, 2 gloo ranks) trains 6 steps saving every 2; read back: each rank's checkpoint
records (blocked_s) and its step times. Printed: the median blocked time per save of each, their ratio (target <= 0.2),
and the median step time of the steps right after a save against the others (the asynchronous writer shares the
cores with training on a CPU machine).
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ("train.steps=6", "train.warmup_steps=0", "train.lr_warmup_steps=0", "batch.seq_len=32",
       "batch.micro_batch_size=1", "batch.global_batch_size=2", "hardware.gpus_per_node=2", "parallel.zero_stage=3",
       "train.checkpoint_every=2", "run.save_final=false", "run.resume=never")


def measure(runs: str, asynchronous: bool, extra: list[str]) -> tuple[list[float], list[float], list[float]]:
    """(blocked seconds of every save on every rank, step times after a save, the other step times)."""
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_fsdp2", *RUN, f"run.checkpoint_async={str(asynchronous).lower()}",
                        *extra], cwd=REPO, capture_output=True, text=True, env={**os.environ, "LAYOUTLAB_RUNS": runs})
    if p.returncode:
        sys.exit(f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    run = max(Path(runs, "tiny_fsdp2").iterdir())
    blocked, after, other = [], [], []
    for rank in (0, 1):
        records = [json.loads(line) for line in (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        saved = {r["step"] for r in records if r["kind"] == "checkpoint"}
        blocked += [r["blocked_s"] for r in records if r["kind"] == "checkpoint"]
        for r in records:
            if r["kind"] == "step" and r["step"] > 1:
                (after if r["step"] - 1 in saved else other).append(r["step_time_s"])
    return blocked, after, other


def main(args: list[str]) -> None:
    extra = args or [f"model.config={REPO / 'tests/fixtures/models/tall-llama/config.json'}"]
    with tempfile.TemporaryDirectory() as runs:
        sync = measure(runs, False, extra)
        asyn = measure(runs, True, extra)
    for name, (blocked, after, other) in (("synchronous (baseline)", sync), ("asynchronous", asyn)):
        print(f"{name}: blocked {statistics.median(blocked):.3f} s a save (median of {len(blocked)}); step time after "
              f"a save {statistics.median(after) * 1e3:.0f} ms, other steps {statistics.median(other) * 1e3:.0f} ms")
    print(f"ratio asynchronous / synchronous blocked time: {statistics.median(asyn[0]) / statistics.median(sync[0]):.3f}"
          " (target <= 0.2)")


if __name__ == "__main__":
    main(sys.argv[1:])
