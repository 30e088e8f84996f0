"""GPU check: the 1.1B catalogue model on one GPU with the torch backend (FSDP2, world 1), eager and compiled, full and
selective checkpointing, 30 steps each; tokens/s/GPU, MFU and peak memory from our metrics, with the planner's
predicted memory (torch accounting) beside them."""
import pytest

from tests.dist.conftest import train
from tests.gpu.conftest import figures

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_one_billion_fsdp2_on_one_gpu(tmp_path, compile_, checkpointing):
    import torch

    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.resume=never",
              "hardware.gpus_per_node=1", f"hardware.profile={profile}", "precision.dtype=bf16",
              'model.name="tinyllama-1.1b"', "parallel.zero_stage=3", "batch.micro_batch_size=4",
              "batch.global_batch_size=16", "batch.seq_len=2048", f"train.activation_checkpointing={checkpointing}",
              f"train.compile={str(compile_).lower()}", recipe="recipes/tiny_fsdp2", timeout=1800)
    f = figures(t.root)
    print(f.line(f"FSDP2 {'compiled' if compile_ else 'eager'}, {checkpointing} checkpointing"))
    assert f.loss_fell
    assert f.memory_within(), f.line("memory off the plan by more than 15%")
