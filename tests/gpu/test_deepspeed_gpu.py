"""GPU check: a ~0.5B catalogue model on one GPU with ZeRO-2 and ZeRO-3 for 30 steps; tokens/s/GPU, MFU
and peak memory from our metrics, with the planner's predicted memory beside them."""
import pytest

from tests.dist.conftest import train
from tests.gpu.conftest import figures

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero", [2, 3])
def test_half_billion_on_one_gpu(tmp_path, zero):
    import torch

    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.resume=never",
              "hardware.gpus_per_node=1", f"hardware.profile={profile}", "precision.dtype=bf16",
              'model.name="qwen2.5-0.5b"', f"parallel.zero_stage={zero}", "batch.micro_batch_size=4",
              "batch.global_batch_size=16", "batch.seq_len=2048", "run.profile=torch", timeout=1800)
    f = figures(t.root)
    print(f.line(f"ZeRO-{zero}"))
    assert f.loss_fell
    assert f.memory_within(), f.line("memory off the plan by more than 15%")
