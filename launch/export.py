"""`python -m launch export RUN_DIR [step=N] [out=DIR]`: a checkpoint as a Hugging Face safetensors folder.

ZeRO shards and AutoTP slices are consolidated through DeepSpeed's universal checkpoint format, which
stores every parameter whole in fp32 (`zero/<name>/fp32.pt`); a ZeRO-0 checkpoint without tensor
parallelism already holds the whole module.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from launch.errors import ConfigError
from launch.resolve import Resolved
from launch.rundir import RunDir


def consolidated_state_dict(run: RunDir, step: int | None = None):
    import torch

    from launch.trainers import common
    from launch.trainers.deepspeed_trainer import to_universal

    found = common.complete_checkpoints(run.checkpoints)
    if step is not None:
        found = [c for c in found if c.step == step]
    if not found:
        raise ConfigError(str(run.checkpoints), "step", step, "has no complete checkpoint",
                          "train with train.checkpoint_every>0 (a final checkpoint is always written), or pick a listed step")
    ckpt = found[-1]
    if ckpt.info["zero_stage"] == 0 and ckpt.info["tp"] == 1:
        states = torch.load(ckpt.dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return ckpt, {k: v.float() for k, v in states["module"].items()}
    universal = to_universal(ckpt)
    state = {}
    for d in sorted((universal / "zero").iterdir()):
        if d.is_dir():
            saved = torch.load(d / "fp32.pt", map_location="cpu", weights_only=False)
            # ZeRO-1/2 and AutoTP conversions store {"param": tensor}; ZeRO-3's a bare flat tensor.
            state[d.name] = (saved["param"] if isinstance(saved, dict) else saved).detach()
    return ckpt, state


def export(run_dir: str | Path, step: int | None = None, out: str | Path | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from launch.trainers.common import hf_config

    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)
    ckpt, state = consolidated_state_dict(run, step)
    config = hf_config(resolved)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # ZeRO-3's universal tensors are stored flat; give each its module shape back.
    state = {k: v.reshape(shapes[k]) if k in shapes and v.numel() == shapes[k].numel() else v
             for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if resolved.model.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(str(ckpt.dir), "parameters", sorted(set(missing) - tied)[:5] or sorted(unexpected)[:5],
                          "do not match the model in resolved.json", "export a checkpoint of this run's own model")
    target = Path(out) if out else run.root / "export" / ckpt.tag
    model.save_pretrained(target, safe_serialization=True)
    return target


def cmd_export(args: Sequence[str]) -> int:
    if not args:
        raise ConfigError("command line", "run_dir", None, "is missing", "usage: python -m launch export RUN_DIR [step=N] [out=DIR]")
    run_dir, opts = args[0], {}
    for a in args[1:]:
        k, _, v = a.partition("=")
        if k not in ("step", "out") or not v:
            raise ConfigError("command line", k, v, "is not an export option", "use step=N or out=DIR")
        opts[k] = v
    if not RunDir.is_run_dir(run_dir):
        raise ConfigError(run_dir, "run_dir", run_dir, "is not a run directory (no resolved.json)", "pass runs/<recipe>/<stamp>")
    try:
        step = int(opts["step"]) if "step" in opts else None
    except ValueError:
        raise ConfigError("command line", "step", opts["step"], "is not an integer", "write step=N") from None
    print(export(run_dir, step, opts.get("out")))
    return 0
