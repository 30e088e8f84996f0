"""GPU check (issue 13): `python -m launch calibrate` then `python -m launch recommend ... verify=true` on one GPU
of this machine, with the ~0.5B catalogue model in bf16: the calibration's GPU branch (CUDA events inside the
forward, trainers built side by side while free memory allows) runs, and the verified layouts' measured step
times stand beside the calibrated predictions, each read back from its run's own metrics."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.dist.conftest import TINY

pytestmark = pytest.mark.gpu

HELD = ('model.name="qwen2.5-0.5b"', "precision.dtype=bf16", "batch.seq_len=1024", "batch.global_batch_size=8",
        "batch.micro_batch_size=2", "train.warmup_steps=5")


def _run(args, runs, timeout):
    env = {**os.environ, "LAYOUTLAB_RUNS": str(runs), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# The catalogue profile of a GPU by its name (its memory and links are what the calibration keeps from it).
PROFILES = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb"}


def test_calibrate_then_recommend_verify_on_one_gpu(tmp_path):
    import torch

    name = torch.cuda.get_device_name(0)
    profile = next((p for key, p in PROFILES.items() if key in name), None)
    if profile is None:
        pytest.skip(f"no catalogue profile for {name}")
    # One GPU: every TP degree of a larger node would be calibrated too, far past this check's time.
    held = [*HELD, "hardware.gpus_per_node=1"]
    runs, cal = tmp_path / "runs", tmp_path / "cal.json"
    p = _run(["calibrate", TINY, *held, f"hardware.profile={profile}", f"out={cal}", "iters=8"], runs, 1200)
    print(p.stdout[-6000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(cal.read_text())
    assert doc["base_profile"] == profile and doc["world_size"] == 1
    passes = doc["compute"]["passes"]
    assert {x["backend"] for x in passes} == {"deepspeed", "megatron"}
    # CUDA events split the forward: some of it before the first decoder layer, most inside the layers.
    assert all(0 < x["embedding_forward_s"] < x["layers_forward_s"] < x["forward_s"] for x in passes)
    # Full checkpointing re-runs the forward inside the backward: its backward is the slower one.
    for b in ("deepspeed", "megatron"):
        by_ac = {x["activation_checkpointing"]: x["backward_s"] for x in passes
                 if x["backend"] == b and x["micro_batch_size"] == 8 and x["tp"] == 1}
        assert by_ac["full"] > by_ac["none"], (b, by_ac)

    p = _run(["recommend", TINY, *held, f"hardware.profile={cal}", "verify=true", "top=3", "steps=25"], runs, 1200)
    print(p.stdout[-8000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (fed,) = tmp_path.glob("cal.verified-*.json")
    verified = json.loads(fed.read_text())["verified"]
    assert len(verified) == 3
    for v in verified:
        run = Path(v["run_dir"])
        plan = json.loads((run / "plan.json").read_text())
        assert plan["step"]["timing"] == "calibrated"
        recs = [json.loads(line) for line in (run / "metrics" / "rank0.jsonl").read_text().splitlines()][1:]
        measured = statistics.median(r["step_time_s"] for r in recs if not r["warmup"])
        print(f"{v['layout']}: predicted {plan['step']['total_s'] * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
              f"({measured / plan['step']['total_s'] - 1:+.1%})")
        # The GPU branch has no reference figure yet: within a factor of 2 either way, the ratio reported above.
        assert 0.5 < measured / plan["step"]["total_s"] < 2.0
