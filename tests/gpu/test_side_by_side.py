"""The GPU check that fits a short lend (tests/gpu/run_checks.sh's default part): the 1.1B catalogue model on one GPU
through each backend the way its authors run it (SDPA attention, fused AdamW; the torch backend compiled; DeepSpeed
ZeRO-2 compiled; Megatron-Core's own schedule), 30 steps each, bf16, the same batch. Each
run's tokens/s/GPU, MFU and peak memory beside its plan, side by side, written to $OUT/gpu_side_by_side.txt (the
lend's results, copied into bench/results/ with the date and device)."""
import os
from pathlib import Path

import pytest

from tests.dist.conftest import train
from tests.gpu.conftest import figures

pytestmark = pytest.mark.gpu
HELD = ("train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.save_final=false",
        "run.resume=never", "hardware.gpus_per_node=1", "precision.dtype=bf16", 'model.name="tinyllama-1.1b"',
        "batch.micro_batch_size=4", "batch.global_batch_size=16", "batch.seq_len=2048")
BACKENDS = {"torch FSDP2, compiled": ("recipes/tiny_fsdp2", ("parallel.zero_stage=3", "train.compile=true")),
            "deepspeed ZeRO-2, compiled": ("recipes/tiny_zero2", ("parallel.zero_stage=2", "train.compile=true")),
            "megatron ZeRO-1": ("recipes/tiny_tp2_sp", ("parallel.tp=1", "parallel.sp=false", "parallel.zero_stage=1"))}
RESULTS = Path(os.environ.get("OUT", "/tmp")) / "gpu_side_by_side.txt"


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_on_one_gpu(tmp_path, name):
    import torch

    device = torch.cuda.get_device_name(0)
    profile = "h200" if "H200" in device else "h100-sxm"
    recipe, own = BACKENDS[name]
    t = train(tmp_path, *HELD, f"hardware.profile={profile}", *own, recipe=recipe, timeout=900)
    f = figures(t.root)
    line = f.line(f"{name} ({device})")
    print(line)
    with open(RESULTS, "a") as out:
        out.write(line.lstrip("\n") + "\n")
    assert f.loss_fell
    assert f.memory_within(), f.line("memory off the plan by more than 15%")
