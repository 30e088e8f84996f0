"""[peft] on a rank: peft's LoRA adapters added to a Hugging Face model before any parallelism, the base frozen in the
precision it is kept in, and the adapters' starting values (launch/config/adapters.py names and sizes them).

Applied to the meta-device skeleton the torch backend builds (or to the whole model the deepspeed backend builds), in
this order: (qlora) every linear layer of every decoder block becomes bitsandbytes' Linear4bit, quantized to NF4 when
its weight is filled; peft's `inject_adapter_in_model` wraps the target layers and freezes every other parameter; the
frozen floating-point parameters are then held in precision.dtype (a fine-tune keeps no fp32 master copy of weights
that never step), the adapters in fp32, as the parameters that step.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from launch.config import adapters as spec
from launch.config.resolve import Resolved
from launch.plan.adapters import NF4_BLOCKSIZE, NF4_STATS_BLOCKSIZE
from launch.ranks.trainers.common import initial_tensors as initial_base_tensors, torch_dtype
from launch.torchtools.hf import lora_config

# The adapters draw from a generator of their own, seeded from train.seed: the base's stream (initial_tensors) is left
# as a model without adapters draws it, and every rank, whatever its layout, starts from the same adapters.
ADAPTER_SEED_OFFSET = 1


def frozen_dtype(resolved: Resolved) -> torch.dtype:
    """The dtype the frozen floating-point base is held in: the training precision (its matmuls run in it anyway)."""
    return torch_dtype(resolved.recipe.precision.dtype)


def apply(model, resolved: Resolved) -> None:
    """Adapters on `model` in place (on whatever device it is: meta for the torch backend's skeleton)."""
    if not spec.adapted(resolved.recipe.peft):
        return
    from peft import inject_adapter_in_model

    if resolved.recipe.peft.method == "qlora":
        _quantizable_linears(model, resolved)
    inject_adapter_in_model(lora_config(resolved.recipe.peft), model, adapter_name=spec.ADAPTER_NAME)
    _hold_in(model, frozen_dtype(resolved), trainable=False)
    # peft makes a 4-bit layer's adapters in its compute dtype; they step, so they are fp32 (autocast computes them
    # in precision.dtype), as peft's own autocast_adapter_dtype does
    _hold_in(model, torch.float32, trainable=True)
    if not any(p.is_meta for p in model.parameters()):
        # a model built whole (the deepspeed backend): its adapters take the starting values every layout starts from,
        # not peft's own draws (the torch backend fills its meta skeleton's shards from initial_tensors)
        held = dict(model.named_parameters())
        with torch.no_grad():
            for name, whole in initial_tensors(resolved):
                held[name].copy_(whole)


def _quantizable_linears(model, resolved: Resolved) -> None:
    """Every nn.Linear of the decoder blocks replaced by bitsandbytes' Linear4bit (NF4, double-quantized scales, the
    QLoRA paper's), computing in precision.dtype; its weight is quantized when `fill_quantized` gives it values."""
    import bitsandbytes as bnb

    compute = torch_dtype(resolved.recipe.precision.dtype)
    for block in model.model.layers:
        for name, module in list(block.named_modules()):
            if type(module) is torch.nn.Linear:
                parent, _, attr = name.rpartition(".")
                with torch.device(module.weight.device):
                    q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                          compute_dtype=compute, compress_statistics=True, quant_type="nf4")
                setattr(block.get_submodule(parent) if parent else block, attr, q)


def _hold_in(model, dtype: torch.dtype, trainable: bool) -> None:
    """The trainable (or the frozen) floating-point parameters re-made in `dtype` (each shared parameter once, so a
    tied embedding stays tied); Linear4bit's weights stay bitsandbytes' own."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad != trainable or is_quantized(p) or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=trainable)
            setattr(module, name, made[id(p)])


def initial_tensors(resolved: Resolved) -> Iterator[tuple[str, torch.Tensor]]:
    """Every adapter's starting value, whole, fp32, in launch.config.adapters' order: lora_A Kaiming-uniform as peft
    draws it (a = √5: U(±1/√in)), lora_B zeros, so that the adapted model starts equal to its base. The same on every
    rank and every layout."""
    generator = torch.Generator().manual_seed(resolved.recipe.train.seed + ADAPTER_SEED_OFFSET)
    for p in spec.adapter_parameters(resolved.model, resolved.recipe.peft):
        if ".lora_A." in p.name:
            bound = 1 / math.sqrt(p.shape[1])
            yield p.name, torch.empty(p.shape).uniform_(-bound, bound, generator=generator)
        else:
            yield p.name, torch.zeros(p.shape)


def base_as_trained(resolved: Resolved) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor, from the recipe's weights (or seed), as the fine-tune held it (as_trained): what an export
    merges the adapters into, on every backend."""
    for name, whole in initial_base_tensors(resolved):
        yield name, as_trained(resolved, name, whole)


def as_trained(resolved: Resolved, name: str, whole: torch.Tensor) -> torch.Tensor:
    """A base tensor as the fine-tune held it, in fp32: under QLoRA a block's linear weight is its NF4 values
    (quantized and dequantized as fill_quantized quantizes it); every other one rounded to the frozen base's dtype."""
    if resolved.recipe.peft.method != "qlora" or not _block_linear(resolved, name):
        return whole.to(frozen_dtype(resolved)).float()
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(whole.to(frozen_dtype(resolved)).contiguous(), blocksize=NF4_BLOCKSIZE,
                                    compress_statistics=True, quant_type="nf4")  # as fill_quantized does
    return F.dequantize_4bit(packed, state).float()


def _block_linear(resolved: Resolved, name: str) -> bool:
    paths = {lin.path for lin in spec.block_linears(resolved.model).values()}
    parts = name.split(".")  # model.layers.<i>.<path>.weight
    return name.startswith("model.layers.") and parts[-1] == "weight" and ".".join(parts[3:-1]) in paths


def is_quantized(p) -> bool:
    """A bitsandbytes 4-bit weight (its values are filled by `fill_quantized`, not copied)."""
    return type(p).__name__ == "Params4bit"


@contextlib.contextmanager
def quantized_kept(model) -> Iterator[None]:
    """Inside, the 4-bit layers' weights are out of the model, so that to_empty allocates everything else and never a
    full-precision copy of them (it would re-make each as a plain parameter of its whole shape); they are back after,
    still on meta until `fill_quantized` fills each."""
    # its own parameter (peft's wrapper answers `.weight` with its base layer's too)
    held = {m: m._parameters["weight"] for m in model.modules() if is_quantized(m._parameters.get("weight"))}
    for module in held:
        module._parameters["weight"] = None
    try:
        yield
    finally:
        for module, weight in held.items():
            module._parameters["weight"] = weight


def empty_quantized(model, device) -> None:
    """Every 4-bit layer's weight as the NF4 storage fill_quantized makes, unfilled: the packed codes (half a byte a
    weight), one byte of absmax per NF4_BLOCKSIZE weights and their fp32 scales (double quantization), the tables.
    For the rehearsal, under FakeTensorMode, where bitsandbytes' matmuls run on their fake kernels but its quantization
    would need values."""
    for module in model.modules():
        old = module._parameters.get("weight")
        if not is_quantized(old) or not old.is_meta:
            continue
        import bitsandbytes.functional as F  # a QLoRA model's: other rehearsals never import bitsandbytes here

        n = old.numel()
        blocks = -(-n // NF4_BLOCKSIZE)

        def empty(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device=device)

        scales = F.QuantState(absmax=empty(-(-blocks // NF4_STATS_BLOCKSIZE)), code=empty(256),
                              blocksize=NF4_STATS_BLOCKSIZE, dtype=torch.float32)
        state = F.QuantState(absmax=empty(blocks, dtype=torch.uint8), shape=old.shape, code=empty(16),
                             blocksize=NF4_BLOCKSIZE, quant_type=old.quant_type, dtype=module.compute_dtype,
                             offset=empty(), state2=scales)
        # A plain parameter holding the codes, its quantization state beside it as Params4bit keeps it (Linear4bit's
        # forward reads weight.quant_state): Params4bit itself cannot wrap a fake tensor.
        module.weight = torch.nn.Parameter(empty((n + 1) // 2, 1, dtype=old.quant_storage), requires_grad=False)
        module.weight.quant_state = state
        # Its statistics are the layer's buffers here, so that a memory tracker, which knows a module's parameters
        # and buffers, sees them as the real layer holds them (beside its weight, in quant_state).
        for name, t in (("nf4_absmax", state.absmax), ("nf4_code", state.code), ("nf4_offset", state.offset),
                        ("nf4_scales", scales.absmax), ("nf4_scales_code", scales.code)):
            module.register_buffer(name, t, persistent=False)


def fill_quantized(model, name: str, whole: torch.Tensor, device) -> None:
    """A Linear4bit's weight from its whole tensor: quantized to NF4 on `device` (bitsandbytes quantizes as the weight
    moves to a device)."""
    import bitsandbytes as bnb

    module = model.get_submodule(name.rsplit(".", 1)[0])
    old = module.weight
    # From the compute dtype, as transformers' load_in_4bit quantizes a 16-bit checkpoint: bitsandbytes dequantizes to
    # the dtype it quantized from, so a float32 source would make every matmul's weight in float32, then a cast.
    module.weight = bnb.nn.Params4bit(whole.to(module.compute_dtype).contiguous(), requires_grad=False,
                                      quant_type=old.quant_type,
                                      compress_statistics=old.compress_statistics, blocksize=NF4_BLOCKSIZE,
                                      quant_storage=old.quant_storage).to(device)
