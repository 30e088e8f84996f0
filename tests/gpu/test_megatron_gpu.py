"""GPU check (issue 9): the 0.5B catalogue model with the Megatron-Core backend at TP1 on one GPU, with
recompute none / selective / full, 30 steps each; tokens/s/GPU, MFU and peak memory from our metrics, with
the planner's prediction beside them. On a GPU, Megatron-Core runs unpatched (cpu_compat.apply() is a no-op)."""
import json

import pytest

from launch.run.metrics import read_metrics
from tests.dist.conftest import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_half_billion_megatron_on_one_gpu(tmp_path, recompute):
    import torch

    from launch.ranks.trainers.cpu_compat import apply

    assert apply() == ["torch_norm_sp"]  # no CUDA redirect where CUDA exists; the SP norm patch is not one
    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.resume=never",
              "hardware.gpus_per_node=1", f"hardware.profile={profile}", "precision.dtype=bf16",
              'model.name="qwen2.5-0.5b"', "parallel.tp=1", "parallel.sp=false", "parallel.zero_stage=0",
              f"train.activation_checkpointing={recompute}", "batch.micro_batch_size=4", "batch.global_batch_size=16",
              "batch.seq_len=2048", recipe="recipes/tiny_tp2_sp", timeout=1800)
    m = read_metrics(t.root / "metrics" / "rank0.jsonl")
    measured = [s for s in m.steps if not s.warmup]
    plan = json.loads((t.root / "plan.json").read_text())
    rank = plan["ranks"][0]
    predicted = rank["memory"][rank["implementation"]]["total"]
    peak = max(s.mem_max_allocated_bytes for s in measured)
    tps = sorted(s.tokens_per_s_per_device for s in measured)[len(measured) // 2]
    mfu = sorted(s.mfu for s in measured)[len(measured) // 2]
    print(f"\nmegatron TP1 recompute={recompute}: {tps:,.0f} tokens/s/GPU (plan {plan['step']['tokens_per_s_per_device']:,.0f}), "
          f"MFU {mfu:.1%} (plan {plan['step']['mfu']:.1%}), peak allocated {peak / 2**30:.2f} GiB, predicted "
          f"{predicted / 2**30:.2f} GiB ({rank['implementation']} accounting)")
    assert measured[-1].loss < m.steps[0].loss
    assert 0.3 < peak / predicted < 3.0  # the plan is in the right range; the ratio is reported above
