"""Fine-tuning ([peft]): LoRA adapters over the tiny model's own saved weights (recipes/weights), trained on 2 gloo
ranks under the torch backend's DDP, its FSDP2 with full activation checkpointing and DeepSpeed's ZeRO-2, reproduce one
rank of the same adapters and global batch (fp32, to 1e-5: the tolerance test_torch_parity.py explains); the run counts
its trainable parameters as peft does; a checkpoint holds the adapters alone and resumes onto another layout; the
export loads in peft and transformers and reproduces the logged loss; QLoRA's NF4 base trains under DDP as on one rank.

The oracles: the one-rank run; peft's own parameter count; a DCP checkpoint's keys read by torch.distributed.checkpoint
itself; the logged loss of the step after a checkpoint, which ran on the checkpoint's weights (an exported model
loaded by transformers and peft, not by our code, must give it); the one-rank QLoRA run."""
import subprocess

import pytest

from tests.conftest import REPO
from tests.dist.conftest import EVERY_5, SHORT, TORCH, exported_losses, interrupted_copy, train, worst

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5
BASE = REPO / "recipes" / "weights" / "tiny-llama"  # tiny_fsdp2's model, pre-trained (recipes/weights/README.md)
LORA = (*SHORT, "peft.method=lora", "peft.rank=4", "peft.alpha=8", f'model.weights="{BASE}"')
LAYOUTS = {
    "one_rank": ("hardware.gpus_per_node=1", "parallel.zero_stage=0", "batch.micro_batch_size=4"),
    "ddp": ("hardware.gpus_per_node=2", "parallel.zero_stage=0", "batch.micro_batch_size=2", *EVERY_5),
    "fsdp2_ac": ("hardware.gpus_per_node=2", "parallel.zero_stage=3", "batch.micro_batch_size=2",
                 "train.activation_checkpointing=full"),
}
DS_ZERO2 = ("hardware.gpus_per_node=2", "batch.micro_batch_size=2", "parallel.zero_stage=2", *EVERY_5)
# QLoRA computes in bf16 (it refuses fp32): one rank and DDP agree to bf16's resolution of a loss near 3, not 1e-5
QLORA = (*LORA, "peft.method=qlora", "precision.dtype=bf16")
QLORA_TOL = 2e-2



@pytest.fixture(scope="module")
def runs(shared_run):
    return lambda name: shared_run(*LORA, *LAYOUTS[name], recipe=TORCH)


@pytest.mark.parametrize("name", ["ddp", "fsdp2_ac"])
def test_adapters_train_as_on_one_rank(runs, name):
    t, ref = runs(name), runs("one_rank")
    assert worst(t.losses(), ref.losses()) <= TOL, (name, t.losses(), ref.losses())
    assert [s.grad_norm for s in t.metrics().steps] == pytest.approx([s.grad_norm for s in ref.metrics().steps],
                                                                     rel=1e-4)
    losses = ref.losses()
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses  # a fine-tune that learns


def test_trainable_parameters_are_peft_own_count(runs):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    tuned = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                               "gate_proj", "up_proj", "down_proj"]))
    trainable, total = tuned.get_nb_trainable_parameters()
    meta = runs("ddp").metrics().meta
    assert (meta.trainable_params, meta.trainable_params + meta.frozen_params) == (trainable, total)
    assert "adapter" in meta.flops_formula


def _checkpoint_keys(folder) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def test_checkpoint_holds_the_adapters_alone_and_resumes_onto_fsdp2(runs, runs_root):
    """The DDP run's step-5 checkpoint: model keys are adapters only (the base is the recipe's weights), and FSDP2
    with checkpointing, resuming it, continues DDP's curve."""
    ddp = runs("ddp")
    model_keys = {k for k in _checkpoint_keys(ddp.root / "checkpoints" / "step5") if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), sorted(model_keys)[:4]
    copy = interrupted_copy(ddp, runs_root / "lora_resume")
    resumed = train(runs_root / "lora_resume", *LORA, *LAYOUTS["fsdp2_ac"], f"run.resume={copy.root}", recipe=TORCH)
    assert resumed.metrics().meta.start_step == 5
    assert worst(resumed.losses(), ddp.losses()[5:]) <= TOL


def test_export_loads_in_peft_and_transformers_and_reproduces_the_loss(runs, runs_root):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ddp = runs("ddp")
    out = runs_root / "lora_exported"
    p = subprocess.run(["python", "-m", "launch", "export", str(ddp.root), "step=5", f"out={out}", "merge=true"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "adapter_config.json").is_file() and (out / "merged" / "config.json").is_file()
    # the merged model, by transformers alone: step 6 ran its forward on the step-5 weights
    (merged_loss,) = exported_losses(out / "merged", ddp.metrics().meta, (5,))
    assert merged_loss == pytest.approx(ddp.losses()[5], abs=TOL)
    # the adapters, loaded by peft onto the base they trained on, give the merged model's logits
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager")
    tuned = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32, attn_implementation="eager")
    rows = torch.arange(64).reshape(2, 32) % 500
    with torch.no_grad():
        assert (tuned(input_ids=rows).logits - merged(input_ids=rows).logits).abs().max() <= TOL


def test_deepspeed_zero2_trains_the_same_adapters(runs, shared_run):
    """DeepSpeed's engine, its ZeRO-2 optimizer taking the adapters alone, over the same base and batches: another
    library's step, the same losses."""
    ds = shared_run(*LORA, *DS_ZERO2, recipe="recipes/tiny_zero2")
    assert ds.metrics().meta.backend == "deepspeed"
    assert worst(ds.losses(), runs("one_rank").losses()) <= TOL, (ds.losses(), runs("one_rank").losses())


@pytest.mark.full  # DeepSpeed's own checkpoint of the adapters: resumed and exported (a resume and an export, ~25 s)
def test_deepspeed_checkpoint_of_the_adapters_resumes_and_exports(shared_run, runs_root):
    ds = shared_run(*LORA, *DS_ZERO2, recipe="recipes/tiny_zero2")
    copy = interrupted_copy(ds, runs_root / "lora_ds_resume")
    resumed = train(runs_root / "lora_ds_resume", *LORA, *DS_ZERO2, f"run.resume={copy.root}",
                    recipe="recipes/tiny_zero2")
    assert resumed.metrics().meta.start_step == 5
    assert worst(resumed.losses(), ds.losses()[5:]) <= TOL
    out = runs_root / "lora_ds_exported"
    p = subprocess.run(["python", "-m", "launch", "export", str(copy.root), "step=5", f"out={out}", "merge=true"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (merged_loss,) = exported_losses(out / "merged", ds.metrics().meta, (5,))
    assert merged_loss == pytest.approx(ds.losses()[5], abs=TOL)


@pytest.mark.full  # two 5-step bf16 DeepSpeed runs and their exports (~40 s)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_bf16_exports_the_adapters_fp32_copies(shared_run, runs_root, zero_stage):
    """In bf16 the engine's module holds rounded adapters; the export writes the optimizer's fp32 copies they are
    rounded from. ZeRO-2: equal to DeepSpeed's own zero_to_fp32 of the checkpoint; ZeRO-0 (zero_to_fp32 reads ZeRO
    checkpoints only): each rounds to the module's bf16 copy exactly, and not every one is that copy widened."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ds = shared_run(*LORA, *DS_ZERO2, f"parallel.zero_stage={zero_stage}", "precision.dtype=bf16", "train.steps=5",
                    recipe="recipes/tiny_zero2")
    out = runs_root / f"lora_ds_bf16_zero{zero_stage}"
    p = subprocess.run(["python", "-m", "launch", "export", str(ds.root), "step=5", f"out={out}", "merge=true"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    exported = {k.removeprefix("base_model.model."): v for k, v in load_file(out / "adapter_model.safetensors").items()}
    # the merge is into the base as the run held it: in bf16 (a tensor no adapter touches, against the weights file)
    base = load_file(BASE / "model.safetensors")["model.embed_tokens.weight"]
    merged = load_file(out / "merged" / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(merged.float(), base.to(torch.bfloat16).float()) and not torch.equal(base.float(), merged.float())
    if zero_stage == 2:
        want = get_fp32_state_dict_from_zero_checkpoint(str(ds.root / "checkpoints"), tag="step5",
                                                        exclude_frozen_parameters=True)
        want = {k.replace(".default", ""): v for k, v in want.items()}
        assert sorted(exported) == sorted(want)
        assert all(torch.equal(exported[k], want[k].float()) for k in want)
    else:
        module = torch.load(ds.root / "checkpoints" / "step5" / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=True)["module"]
        module = {k.replace(".default", ""): v for k, v in module.items()}
        assert sorted(exported) == sorted(module) and all(v.dtype == torch.bfloat16 for v in module.values())
        assert all(torch.equal(exported[k].to(torch.bfloat16), module[k]) for k in module)
        assert any(not torch.equal(exported[k], module[k].float()) for k in module)


@pytest.mark.full  # a run with dropout and a resume of it (~40 s)
def test_adapter_dropout_continues_across_a_resume_onto_another_layout(runs, shared_run, runs_root):
    """Adapter dropout's masks come from (train.seed, step, data-parallel rank) alone: a DDP run with dropout,
    interrupted after step 5 and resumed under FSDP2 with activation checkpointing (which recomputes each block's
    dropout in the backward), continues the uninterrupted curve; and the dropout is on (the curve is not the
    dropout-free run's)."""
    dropout = ("peft.dropout=0.1", *LAYOUTS["ddp"])
    ddp = shared_run(*LORA, *dropout, recipe=TORCH)
    assert worst(ddp.losses()[1:], runs("ddp").losses()[1:]) > 1e-3
    copy = interrupted_copy(ddp, runs_root / "lora_dropout_resume")
    resumed = train(runs_root / "lora_dropout_resume", *LORA, "peft.dropout=0.1", *LAYOUTS["fsdp2_ac"],
                    f"run.resume={copy.root}", recipe=TORCH)
    assert resumed.metrics().meta.start_step == 5
    assert worst(resumed.losses(), ddp.losses()[5:]) <= TOL, (resumed.losses(), ddp.losses()[5:])


@pytest.mark.full  # two bf16 runs of bitsandbytes' CPU kernels: CI's second command
def test_qlora_trains_under_ddp_as_on_one_rank(shared_run):
    one = shared_run(*QLORA, *LAYOUTS["one_rank"], recipe=TORCH)
    ddp = shared_run(*QLORA, "hardware.gpus_per_node=2", "parallel.zero_stage=0", "batch.micro_batch_size=2",
                     recipe=TORCH)
    assert worst(ddp.losses(), one.losses()) <= QLORA_TOL, (ddp.losses(), one.losses())
    losses = one.losses()
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
