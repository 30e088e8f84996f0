"""The planner's predicted step time against measured runs, on this machine, in one invocation.

    python bench/bench_planner.py [steps=40] [rounds=2] [calibration=PATH] [recipe=recipes/tiny_zero2]

Calibrates first (`python -m launch calibrate`, unless calibration=PATH is given), then runs each layout below
`rounds` times (the order reversed every round so that drift hits all of them) with that calibration as the
hardware profile, and compares plan.json's `step.total_s` with the median step time after warm-up of rank 0's
metrics, the issue's definition. Prints predicted vs measured per layout, the mean absolute percentage error
(MAPE), Spearman's rank correlation, and whether the predicted order equals the measured order for every pair
whose measured times differ by more than the noise (the larger of the two layouts' spread between rounds).
Targets: every layout within 20 %, MAPE <= 10 %, the order right. Baseline: the measurement itself.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "ZeRO-0": ["parallel.zero_stage=0"],
    "ZeRO-1": ["parallel.zero_stage=1"],
    "ZeRO-2": ["parallel.zero_stage=2"],
    "ZeRO-3": ["parallel.zero_stage=3"],
    "TP2 x ZeRO-1": ["parallel.tp=2", "parallel.zero_stage=1"],
    "ZeRO-3 + full recompute": ["parallel.zero_stage=3", "train.activation_checkpointing=full"],
    "ZeRO-2, micro-batch 1": ["parallel.zero_stage=2", "batch.micro_batch_size=1"],  # 4 micro-batches a step
    "TP2 x ZeRO-0, micro-batch 8": ["parallel.tp=2", "parallel.zero_stage=0", "batch.micro_batch_size=8"],
    "Megatron ZeRO-1": ["backend=megatron", "parallel.zero_stage=1"],
    "Megatron TP2 x ZeRO-1": ["backend=megatron", "parallel.tp=2", "parallel.zero_stage=1"],
    "Megatron TP2 + SP, selective": ["backend=megatron", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1",
                                     "train.activation_checkpointing=selective"],
    "Megatron PP2, micro-batch 1": ["backend=megatron", "parallel.pp=2", "parallel.zero_stage=1",
                                    "batch.micro_batch_size=1"],
    "Megatron PP2, micro-batch 4": ["backend=megatron", "parallel.pp=2", "parallel.zero_stage=1",
                                    "batch.micro_batch_size=4"],
}


def ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 1.0


def progress(line: str) -> None:
    """Where the bench is, on stderr: it takes minutes, and its table on stdout stays the result alone."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def main(argv):
    opts = dict(a.split("=", 1) for a in argv)
    steps, rounds = int(opts.get("steps", 40)), int(opts.get("rounds", 2))
    recipe = opts.get("recipe", "recipes/tiny_zero2")
    tmp = Path(tempfile.mkdtemp(prefix="bench_planner_"))
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp / "runs")}
    calib = opts.get("calibration")
    total = rounds * len(LAYOUTS)
    if calib is None:
        calib = str(tmp / "calibration.json")
        progress(f"calibrating this machine first ({recipe}; a few minutes: `python -m launch calibrate` says how many)")
        subprocess.run([sys.executable, "-m", "launch", "calibrate", recipe, f"out={calib}"], cwd=REPO, env=env,
                       check=True, stdout=subprocess.DEVNULL)
    predicted, measured = {}, {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            done = sum(map(len, measured.values()))
            progress(f"round {rnd + 1}/{rounds}: {name} ({done + 1}/{total} runs of {steps} steps)")
            before = set((tmp / "runs").glob("*/*")) if (tmp / "runs").exists() else set()
            subprocess.run(["bash", "launch/run.sh", recipe, *LAYOUTS[name], f"train.steps={steps}",
                            "train.checkpoint_every=0", "run.resume=never", f"hardware.profile={calib}"],
                           cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
            run = sorted(set((tmp / "runs").glob("*/*")) - before)[0]
            plan = json.loads((run / "plan.json").read_text())
            if plan["step"]["timing"] != "calibrated":
                notes = [n for n in plan["notes"] if n.startswith("time:")]
                raise SystemExit(f"{name}: the plan did not use the calibration: {notes}")
            predicted[name] = plan["step"]["total_s"]
            recs = [json.loads(line) for line in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
            measured[name].append(statistics.median(r["step_time_s"] for r in recs if r["kind"] == "step"
                                                    and not r["warmup"]))
    med = {n: statistics.median(v) for n, v in measured.items()}
    spread = {n: max(v) - min(v) for n, v in measured.items()}
    errors = {n: (predicted[n] - med[n]) / med[n] for n in names}
    print(f"calibration: {calib}")
    print(f"{'layout':<30} {'predicted':>10} {'measured':>10} {'rounds':>18} {'error':>8}")
    for n in names:
        per_round = "/".join(f"{x * 1e3:.1f}" for x in measured[n])
        print(f"{n:<30} {predicted[n] * 1e3:8.1f} ms {med[n] * 1e3:8.1f} ms {per_round:>18} {errors[n]:+8.1%}")
    mape = statistics.fmean(abs(e) for e in errors.values())
    rho = spearman([predicted[n] for n in names], [med[n] for n in names])
    wrong = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
             if abs(med[a] - med[b]) > max(spread[a], spread[b])
             and (predicted[a] < predicted[b]) != (med[a] < med[b])]
    print(f"MAPE {mape:.1%} (target <= 10%); worst {max(abs(e) for e in errors.values()):.1%} (target <= 20%); "
          f"Spearman rank correlation {rho:.3f}")
    print("predicted order equals measured order for every pair apart by more than the noise" if not wrong else
          "pairs ordered wrongly (apart by more than the noise): " + "; ".join(f"{a} vs {b}" for a, b in wrong))


if __name__ == "__main__":
    main(sys.argv[1:])
