"""The comparison bench_megatron.py and bench_torch.py share: layoutlab's trainer against a bare loop of the same
library (a script under bench/ that reads the run's resolved.json), same model, weights, batches and layout, in one
invocation. Both skip the recipe's warm-up steps and take the median of the rest; the two alternate (ours, bare,
ours, bare) so that machine noise hits both. Both start from the same weights and read the same batches, so their
first-step losses must agree: checked every round, and a mismatch fails the run after the ratio is printed.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPTS = ("steps", "recipe", "rounds")
LOSS_RTOL = 1e-5  # fp32, identical maths in the same order; observed differences are 0 or a few ulps


def compare(argv: list[str], *, recipe: str, default_overrides: tuple[str, ...], bare_script: str, ours_label: str,
            bare_label: str) -> None:
    opts = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in OPTS)
    overrides = [a for a in argv if a.split("=", 1)[0] not in OPTS]
    steps, rounds = int(opts.get("steps", 60)), int(opts.get("rounds", 2))
    recipe = opts.get("recipe", recipe)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_{Path(bare_script).stem}_"))
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp / "runs"), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    common = [*default_overrides, f"train.steps={steps}", "train.checkpoint_every=0", "run.resume=never", *overrides]
    ours, bare, mismatches = [], [], []
    for i in range(rounds):
        before = set((tmp / "runs").glob("*/*")) if (tmp / "runs").exists() else set()
        subprocess.run(["bash", "launch/run.sh", recipe, *common], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        run = min(set((tmp / "runs").glob("*/*")) - before)
        recs = [json.loads(line) for line in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
        step_recs = [x for x in recs if x["kind"] == "step"]
        ours_times = [x["step_time_s"] for x in step_recs if not x["warmup"]]
        warm = recs[0]["warmup_steps"]
        world = json.loads((run / "resolved.json").read_text())["world_size"]
        out = tmp / f"bare{i}.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                               str(REPO / "bench" / bare_script), str(run), str(out)],
                              check=False, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            sys.exit(f"{bare_script} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
        b = json.loads(out.read_text())
        bare_times = b["step_time_s"][warm:]
        ours += ours_times
        bare += bare_times
        first = step_recs[0]
        diff = abs(first["loss"] - b["loss"][0])
        same = diff <= LOSS_RTOL * abs(b["loss"][0])
        if not same:
            mismatches.append(i + 1)
        print(f"round {i + 1}/{rounds}: layoutlab {statistics.median(ours_times) * 1e3:7.1f} ms, "
              f"bare {statistics.median(bare_times) * 1e3:7.1f} ms; step-1 loss {first['loss']:.6f} vs "
              f"{b['loss'][0]:.6f} (|diff| {diff:.1e}{'' if same else ', MISMATCH'}), grad norm "
              f"{first['grad_norm']:.6f} vs {b['grad_norm'][0]:.6f}; last loss {step_recs[-1]['loss']:.6f} vs "
              f"{b['loss'][-1]:.6f}", flush=True)
    a, b = statistics.median(ours), statistics.median(bare)
    print(f"{ours_label:<21}: median step {a * 1e3:8.2f} ms over {len(ours)} steps")
    print(f"{bare_label:<21}: median step {b * 1e3:8.2f} ms over {len(bare)} steps  (baseline)")
    print(f"{ours_label} / {bare_label} = {a / b:.2f}  (target <= 1.05)")
    if mismatches:
        sys.exit(f"first-step losses differ in round(s) {mismatches}: the two sides did not train the same thing")
    print("first-step losses agree in every round (same weights, same batches)")
