"""Step time of layoutlab's DeepSpeed trainer vs a bare DeepSpeed loop, same tiny model, config and
batches, 2 gloo ranks, measured in one invocation. Prints the ratio (target <= 1.05).

    python bench/bench_trainer.py [steps=60] [recipe=recipes/tiny_zero2] [key=value overrides...]

Both sides skip the recipe's warm-up steps and take the median of the rest; the two alternate
(ours, bare, ours, bare) so that machine noise hits both.
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


def main(argv):
    opts = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in ("steps", "recipe", "rounds"))
    overrides = [a for a in argv if a.split("=", 1)[0] not in ("steps", "recipe", "rounds")]
    steps, recipe, rounds = int(opts.get("steps", 60)), opts.get("recipe", "recipes/tiny_zero2"), int(opts.get("rounds", 2))
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp / "runs"), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    common = [f"train.steps={steps}", "train.checkpoint_every=0", "run.resume=never", *overrides]
    ours, bare = [], []
    for i in range(rounds):
        before = set((tmp / "runs").glob("*/*")) if (tmp / "runs").exists() else set()
        subprocess.run(["bash", "launch/run.sh", recipe, *common], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        run = sorted(set((tmp / "runs").glob("*/*")) - before)[0]
        recs = [json.loads(l) for l in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
        ours += [x["step_time_s"] for x in recs if x["kind"] == "step" and not x["warmup"]]
        warm = recs[0]["warmup_steps"]
        out = tmp / f"bare{i}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                        str(REPO / "bench" / "bare_deepspeed.py"), str(run), str(out)],
                       cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        bare += json.loads(out.read_text())["step_time_s"][warm:]
    a, b = statistics.median(ours), statistics.median(bare)
    print(f"layoutlab trainer : median step {a * 1e3:8.2f} ms over {len(ours)} steps")
    print(f"bare DeepSpeed    : median step {b * 1e3:8.2f} ms over {len(bare)} steps  (baseline)")
    print(f"ratio layoutlab / bare DeepSpeed = {a / b:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main(sys.argv[1:])
