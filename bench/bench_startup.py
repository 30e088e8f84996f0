"""Sharded start-up: each rank's peak host-memory growth while it builds its part of the model, and its start-up time,
against the whole build a rank 0 made before the sharded start-up (transformers' from_config of the whole fp32 model,
common.build_model), measured in the same invocation in a fresh process.

    python bench/bench_startup.py [model.name=qwen2.5-0.5b] [recipes=tiny_fsdp2,tiny_tp2_sp] [key=value overrides...]

Each recipe trains one step on 2 gloo ranks (hardware.gpus_per_node=2; tiny_tp2_sp at parallel.zero_stage=0, TP 2);
read back: logs/build_memory_rank{R}.json (ru_maxrss growth over the build) and the metrics meta record's startup_s.
Printed per rank: growth / the whole build's growth (a sharded rank of 2 holds about half, ~0.5; the rank 0 of old,
>= 1) and start-up / the whole build's time.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ONE_STEP = ("train.steps=1", "train.warmup_steps=0", "train.lr_warmup_steps=0", "batch.seq_len=32",
            "batch.micro_batch_size=1", "batch.global_batch_size=2", "hardware.gpus_per_node=2", "run.save_final=false",
            "train.checkpoint_every=0", "run.resume=never")
LAYOUT = {"tiny_tp2_sp": ("parallel.zero_stage=0",)}
WHOLE = """
import json, resource, sys, time
from launch.config.resolve import resolve_path
from launch.ranks.trainers import common
resolved = resolve_path(sys.argv[1], sys.argv[2:])
common.import_model_class(resolved)
before, t = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.perf_counter()
common.build_model(resolved)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}))
"""


def main(args: list[str]) -> None:
    opts = dict(a.split("=", 1) for a in args if a.split("=", 1)[0] in ("model.name", "recipes"))
    extra = [a for a in args if a.split("=", 1)[0] not in ("model.name", "recipes")]
    model = f"model.name={opts.get('model.name', 'qwen2.5-0.5b')}"
    recipes = opts.get("recipes", "tiny_fsdp2,tiny_tp2_sp").split(",")
    whole = json.loads(subprocess.run([sys.executable, "-c", WHOLE, str(REPO / "recipes" / recipes[0]), model, *extra],
                                      cwd=REPO, check=True, capture_output=True, text=True).stdout)
    print(f"baseline, the whole fp32 build in one process ({model}): {whole['growth'] / 2**20:,.0f} MiB grown, "
          f"{whole['seconds']:.1f} s")
    with tempfile.TemporaryDirectory() as runs:
        for recipe in recipes:
            p = subprocess.run(["bash", "launch/run.sh", f"recipes/{recipe}", model, *ONE_STEP, *LAYOUT.get(recipe, ()),
                                *extra], cwd=REPO, capture_output=True, text=True,
                               env={**os.environ, "LAYOUTLAB_RUNS": runs})
            if p.returncode:
                sys.exit(f"{recipe}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
            (run,) = Path(runs, recipe).iterdir()
            for rank in (0, 1):
                grown = json.loads((run / "logs" / f"build_memory_rank{rank}.json").read_text())["peak_rss_growth_bytes"]
                meta = json.loads((run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()[0])
                print(f"{recipe} rank {rank}: {grown / 2**20:,.0f} MiB grown ({grown / whole['growth']:.2f} of the whole "
                      f"build), start-up {meta['startup_s']:.1f} s ({meta['startup_s'] / whole['seconds']:.2f} of the "
                      "whole build's time, which excludes the process group and imports)")


if __name__ == "__main__":
    main(sys.argv[1:])
