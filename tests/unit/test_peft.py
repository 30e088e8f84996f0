"""[peft]: bad adapters refused before launch in one line (file, field, value, fix; exit 2); the adapters the config
names are the ones peft itself builds; their starting values; QLoRA's NF4 base as bitsandbytes quantizes it."""
import math
from pathlib import Path

import pytest

from launch.commands.cli import main
from launch.config import adapters
from launch.config.resolve import resolve_path
from launch.config.schema import LORA_ALL_LINEAR

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LORA = "recipes/tiny_7b_lora_1gpu"  # tiny-llama2, one rank, fp32, its own saved weights


@pytest.mark.parametrize("recipe, overrides, field, says", [
    (LORA, ["peft.target_modules=q_proj,qkv_proj"], "peft.target_modules", 'peft.target_modules="qkv_proj" is not a linear layer of tiny-llama2'),
    (LORA, ["peft.target_modules=[]"], "peft.target_modules", "names no module"),
    (LORA, ["peft.target_modules=q_proj,q_proj"], "peft.target_modules", "names a module twice"),
    (LORA, ["peft.rank=0"], "peft.rank", "peft.rank=0 must be at least 1"),
    (LORA, ["peft.rank=65"], "peft.rank", "peft.rank=65 is larger than down_proj (64 features)"),
    ("recipes/tiny_fsdp2", ["peft.method=lora", "peft.rank=33"], "peft.rank",
     "peft.rank=33 is larger than k_proj (32 features)"),
    (LORA, ["peft.alpha=0"], "peft.alpha", "peft.alpha=0.0 must be a positive finite number"),
    (LORA, ["peft.alpha=nan"], "peft.alpha", "is not a finite number within 64 bits"),
    (LORA, ["peft.dropout=1.0"], "peft.dropout", "peft.dropout=1.0 must be in [0, 1)"),
    (LORA, ["peft.method=dora"], "peft.method", 'peft.method="dora" is not "none" | "lora" | "qlora"'),
    (LORA, ["backend=megatron"], "backend", "Megatron-Core 0.16.1 has no adapter modules"),
    (LORA, ["backend=deepspeed", "parallel.zero_stage=3"], "parallel.zero_stage", "zero.Init"),
    (LORA, ["hardware.gpus_per_node=2", "parallel.tp=2", "parallel.zero_stage=3"], "parallel.tp",
     "parallel.tp=2 cannot combine with peft.method=\"lora\""),
    (LORA, ["train.compile=true"], "train.compile", "cannot combine with peft.method"),
    ("recipes/tiny_7b_qlora_1gpu_ac", ["precision.dtype=fp32"], "precision.dtype", "cannot compute a QLoRA fine-tune"),
    ("recipes/tiny_7b_qlora_1gpu_ac", ["hardware.gpus_per_node=2", "parallel.zero_stage=3"], "parallel.zero_stage",
     "FSDP2 cannot shard"),
    ("recipes/tiny_7b_qlora_1gpu_ac", ["backend=deepspeed"], "backend", "DeepSpeed's ZeRO does not partition"),
])
def test_adapters_that_cannot_work_are_one_line_exit_2(capsys, recipe, overrides, field, says):
    assert main(["run", recipe, *overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and f"{field}=" in err, err
    assert any(f"; {fix}" in err for fix in ("set ", "name ", "did you mean", "write ")), err  # the fix, last


def test_a_random_base_is_warned_about():
    r = resolve_path("recipes/tiny_fsdp2", ["peft.method=lora"])  # no model.weights
    assert any("randomly initialised base" in w for w in r.warnings)
    assert not any("randomly" in w for w in resolve_path(LORA).warnings)


@pytest.mark.parametrize("model, targets", [("tiny-llama2", LORA_ALL_LINEAR), ("tiny-qwen2", ("q_proj", "v_proj"))])
def test_the_adapters_named_are_the_ones_peft_builds(model, targets):
    """Names, shapes and order of every adapter tensor, and the trainable count, as peft's own LoRA makes them on the
    transformers model (tiny-qwen2: biased q/k/v, which adapters leave to the base)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    r = resolve_path("recipes/tiny_fsdp2", [f"model.name={model}", "peft.method=lora", "peft.rank=4",
                                            f"peft.target_modules={','.join(targets)}"])
    hf = AutoModelForCausalLM.from_config(hf_config(r.model), dtype=torch.float32)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=list(targets)), hf)
    built = [(n, tuple(p.shape)) for n, p in hf.named_parameters() if p.requires_grad]
    listed = [(p.name, p.shape) for p in adapters.adapter_parameters(r.model, r.recipe.peft)]
    assert listed == built
    split = adapters.parameter_split(r.model, r.recipe.peft)
    assert (split.trainable, split.total) == (sum(math.prod(s) for _, s in built),
                                              sum(p.numel() for p in hf.parameters()))


def test_adapters_start_as_peft_draws_them_the_same_on_every_rank():
    """lora_A uniform within ±1/√in (Kaiming-uniform with a = √5, peft's), lora_B zero, the same draws every time."""
    from launch.ranks.trainers import adapters as rank_adapters

    r = resolve_path(LORA)
    first, again = dict(rank_adapters.initial_tensors(r)), dict(rank_adapters.initial_tensors(r))
    assert list(first) == [p.name for p in adapters.adapter_parameters(r.model, r.recipe.peft)]
    for name, t in first.items():
        assert t.equal(again[name])
        if ".lora_B." in name:
            assert not t.any()
        else:
            bound = 1 / math.sqrt(t.shape[1])
            assert t.abs().max() <= bound and t.abs().max() > 0.8 * bound and t.std() > 0.4 * bound


def test_qlora_holds_the_blocks_in_nf4_and_computes_what_the_export_merges():
    """The skeleton's block linears become 4-bit (packed bytes: half a byte a weight, plus scales), the rest stays
    16-bit; each dequantizes to what the export's as_trained gives (bitsandbytes' own dequantize), within NF4's error of
    the weight it was made from."""
    import torch
    import bitsandbytes.functional as F

    from launch.ranks.trainers import adapters as rank_adapters, common
    from launch.ranks.trainers.torch_backend import _materialise, _skeleton

    r = resolve_path("recipes/tiny_7b_qlora_1gpu_ac")
    model = _skeleton(r)
    rank_adapters.apply(model, r)
    _materialise([model], r, torch.device("cpu"), lambda done, total: None)
    whole = dict(common.initial_tensors(r))
    q = model.model.layers[1].mlp.down_proj.base_layer.weight
    assert q.dtype == torch.uint8 and q.numel() * 2 == whole["model.layers.1.mlp.down_proj.weight"].numel()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.down_proj.lora_A["default"].weight.dtype == torch.float32
    # quantized from the compute dtype: each matmul dequantizes straight to bf16, as the plan times it
    assert q.quant_state.dtype == torch.bfloat16
    got = F.dequantize_4bit(q.data, q.quant_state).float()
    want = rank_adapters.as_trained(r, "model.layers.1.mlp.down_proj.weight", whole["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(got, want)
    original = whole["model.layers.1.mlp.down_proj.weight"]
    # NF4's worst step is about a fifth of each 64-weight block's absmax
    blocks = original.flatten().reshape(-1, 64)
    err = (got.flatten().reshape(-1, 64) - blocks).abs().max(dim=1).values
    assert (err <= 0.2 * blocks.abs().max(dim=1).values + 1e-2).all()


def test_checkpointed_blocks_redraw_the_adapters_dropout_exactly():
    """With peft.dropout > 0 the recomputation of a checkpointed block must draw the forward's masks again: the same
    gradients as without checkpointing, from the same seed (a block that skipped saving the generator's state gave
    different ones)."""
    import torch

    from launch.ranks.trainers import adapters as rank_adapters
    from launch.ranks.trainers.torch_backend import _apply_ac, _materialise, _skeleton

    grads = {}
    for ac in ("none", "full"):
        r = resolve_path(LORA, ["peft.dropout=0.3", f"train.activation_checkpointing={ac}"])
        model = _skeleton(r)
        rank_adapters.apply(model, r)
        _apply_ac(model, ac, marked=False, cuda=False, random=True)
        _materialise([model], r, torch.device("cpu"), lambda done, total: None)
        model.train()
        torch.manual_seed(7)
        rows = torch.arange(64).reshape(2, 32) % 500
        model(input_ids=rows, labels=rows).loss.backward()
        grads[ac] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        assert any(g.abs().sum() > 0 for g in grads[ac])
    for a, b in zip(grads["none"], grads["full"], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_qlora_without_working_4bit_kernels_is_refused_before_launch(tmp_path):
    """A bitsandbytes that cannot run NF4 here (a wheel whose native library does not load, as on a GPU machine with
    a build for another CUDA) is one line and exit 2 from the CLI, before any rank starts or any run folder exists;
    the installed one passes the same check. The broken install is a package that fails as it imports, ahead of the
    real one on the path."""
    import os
    import subprocess
    import sys

    broken = tmp_path / "site" / "bitsandbytes"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise OSError('libbitsandbytes_cuda128.so: cannot open shared object file')\n")
    repo, runs = RECIPES.parent, tmp_path / "runs"
    env = {**os.environ, "LAYOUTLAB_RUNS": str(runs), "PYTHONPATH": str(broken.parent)}
    p = subprocess.run([sys.executable, "-m", "launch", "run", "recipes/tiny_7b_qlora_1gpu_ac"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and 'peft.method="qlora" cannot train here: bitsandbytes does not import (OSError: ' \
        "libbitsandbytes_cuda128.so: cannot open shared object file)" in err[0], err
    assert err[0].endswith('or set peft.method="lora"'), err
    assert not runs.exists() or not any(runs.rglob("resolved.json"))
    ok = subprocess.run([sys.executable, "-m", "launch.torchtools.four_bit", "cpu", "bf16"], cwd=repo,
                        capture_output=True, text=True, timeout=300)
    assert (ok.returncode, ok.stderr) == (0, "")


def test_a_tied_output_layer_stays_tied_and_frozen_under_adapters():
    """tiny-qwen2 ties its output layer to its embedding: re-made in the frozen base's dtype, the two stay one
    parameter (the start-up fills it once), frozen; what trains is the adapters launch.config.adapters counts."""
    import torch

    from launch.ranks.trainers import adapters as rank_adapters
    from launch.ranks.trainers.torch_backend import _materialise, _skeleton

    r = resolve_path(RECIPES / "tiny_fsdp2", ["model.name=tiny-qwen2", "peft.method=lora", "precision.dtype=bf16"])
    assert r.model.to_dict()["hf_config"]["tie_word_embeddings"] is True
    model = _skeleton(r)
    rank_adapters.apply(model, r)
    _materialise([model], r, torch.device("cpu"), lambda done, total: None)
    tied = model.lm_head.weight
    assert tied is model.model.embed_tokens.weight and tied.dtype == torch.bfloat16 and not tied.requires_grad
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    assert sum(trainable) == sum(p.numel for p in adapters.adapter_parameters(r.model, r.recipe.peft)) > 0
