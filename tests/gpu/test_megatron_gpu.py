"""GPU check (issue 9): the 0.5B catalogue model with the Megatron-Core backend at TP1 on one GPU, with
recompute none / selective / full, 30 steps each; tokens/s/GPU, MFU and peak memory from our metrics, with
the planner's prediction beside them. On a GPU, Megatron-Core runs unpatched (cpu_compat.apply(cuda=True) installs
only the SP norm patch)."""
import pytest

from tests.dist.conftest import train
from tests.gpu.conftest import figures

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_half_billion_megatron_on_one_gpu(tmp_path, recompute):
    import torch

    from launch.ranks.trainers.cpu_compat import apply

    assert apply(cuda=True) == ["torch_norm_sp"]  # no CUDA redirect on GPUs; the SP norm patch is not one
    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=30", "train.warmup_steps=10", "train.checkpoint_every=0", "run.resume=never",
              "hardware.gpus_per_node=1", f"hardware.profile={profile}", "precision.dtype=bf16",
              'model.name="qwen2.5-0.5b"', "parallel.tp=1", "parallel.sp=false", "parallel.zero_stage=0",
              f"train.activation_checkpointing={recompute}", "batch.micro_batch_size=4", "batch.global_batch_size=16",
              "batch.seq_len=2048", recipe="recipes/tiny_tp2_sp", timeout=1800)
    f = figures(t.root)
    print(f.line(f"megatron TP1 recompute={recompute}"))
    assert f.loss_fell
    assert f.memory_within(), f.line("memory off the plan by more than 15%")


def test_transformer_engine_spec_trains_and_exports(tmp_path):
    """train.attention=te on a GPU with Transformer Engine: the run starts from the canonical state through the TE
    spec's own names (its norms inside the fused linears, launch/ranks/trainers/megatron_model.py NORM_KEYS), its loss
    falls, and its checkpoint exports to a Hugging Face folder that transformers loads without a missing tensor."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine is optional: the image may not carry it")
    import subprocess
    import sys

    import torch

    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    t = train(tmp_path, "train.steps=20", "train.warmup_steps=5", "run.resume=never", "hardware.gpus_per_node=1",
              f"hardware.profile={profile}", "precision.dtype=bf16", "parallel.tp=1", "parallel.sp=false",
              "parallel.zero_stage=0", "train.attention=te", recipe="recipes/tiny_tp2_sp", timeout=900)
    assert figures(t.root).loss_fell
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(t.root), f"out={out}"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
