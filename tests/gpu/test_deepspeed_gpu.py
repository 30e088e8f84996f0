"""GPU check: a ~0.5B catalogue model on one GPU with ZeRO-2 and ZeRO-3 for 30 steps; tokens/s/GPU, MFU
and peak memory from our metrics, with the planner's predicted memory beside them."""
import json

import pytest

from launch.run.metrics import read_metrics
from tests.dist.conftest import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero", [2, 3])
def test_half_billion_on_one_gpu(tmp_path, zero):
    import torch

    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.resume=never",
              "hardware.gpus_per_node=1", f"hardware.profile={profile}", "precision.dtype=bf16",
              'model.name="qwen2.5-0.5b"', f"parallel.zero_stage={zero}", "batch.micro_batch_size=4",
              "batch.global_batch_size=16", "batch.seq_len=2048", "run.profile=torch", timeout=1800)
    m = read_metrics(t.root / "metrics" / "rank0.jsonl")
    measured = [s for s in m.steps if not s.warmup]
    plan = json.loads((t.root / "plan.json").read_text())
    predicted = plan["ranks"][0]["memory"]["deepspeed"]["total"]
    peak = max(s.mem_max_allocated_bytes for s in measured)
    tps = sorted(s.tokens_per_s_per_device for s in measured)[len(measured) // 2]
    mfu = sorted(s.mfu for s in measured)[len(measured) // 2]
    print(f"\nZeRO-{zero}: {tps:,.0f} tokens/s/GPU, MFU {mfu:.1%}, peak allocated {peak / 2**30:.2f} GiB, "
          f"predicted {predicted / 2**30:.2f} GiB (deepspeed accounting)")
    assert measured[-1].loss < m.steps[0].loss
    assert 0.3 < peak / predicted < 3.0  # the plan is in the right range; the ratio is reported above
