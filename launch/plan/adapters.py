"""The planner's facts about a fine-tune ([peft]: launch.config.adapters names the adapters): on one rank, which of its
parameters train and which stay frozen, and the bytes a frozen parameter takes (precision.dtype; NF4 under QLoRA). The
memory, compute, collectives and checkpoint models read them here. Without [peft] every parameter trains and none is
frozen, so each model's full-training formulas are the special case trainable = the rank's parameters."""
from __future__ import annotations

import math

from launch.config import adapters
from launch.config.adapters import ParameterSplit
from launch.config.backends import traits
from launch.plan.layout import Layout

# bitsandbytes' NF4 (functional.quantize_4bit, nn.Params4bit, as transformers' load_in_4bit builds it): two 4-bit codes a
# byte; one absmax per block of NF4_BLOCKSIZE weights, which double quantization (Params4bit's compress_statistics=True)
# stores as one byte, with one fp32 scale per NF4_STATS_BLOCKSIZE absmax (quantize_blockwise(absmax, blocksize=256)).
# The per-tensor rest (the absmax mean, the 256-entry code tables) is a few KiB a layer and left out.
NF4_BLOCKSIZE = 64
NF4_STATS_BLOCKSIZE = 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCKSIZE + 4 / (NF4_BLOCKSIZE * NF4_STATS_BLOCKSIZE)
# A NF4 weight read by the dequantization kernel (which writes it back in the compute dtype): its codes and statistics.
NF4_READ_BYTES = NF4_BYTES_PER_PARAM


def adapted(layout: Layout) -> bool:
    return adapters.adapted(layout.peft)


def quantized(layout: Layout) -> bool:
    """Whether the blocks' linear layers are stored in NF4 (QLoRA)."""
    return layout.peft.method == "qlora"


def casts_adapter_input(layout: Layout) -> bool:
    """Whether each adapted linear makes its own 16-bit copy of its input for lora_A: under the torch backend's DDP the
    adapters stay fp32 beside a 16-bit base, peft's LoRA Linear casts its input to the adapters' dtype
    (LoraLayer._cast_input_dtype) and autocast casts it back for the matmul, which saves that new tensor. FSDP2 (its
    MixedPrecisionPolicy) and DeepSpeed (the engine) run the adapters in the compute dtype, and peft's 4-bit Linear
    skips the cast under autocast, so none of those copies."""
    return (adapted(layout) and layout.peft.method == "lora" and layout.dtype != "fp32" and layout.zero_stage == 0
            and traits(layout.backend).accounting == "torch")


def _per_layer(layout: Layout) -> tuple[int, int]:
    """(adapter elements, linear-weight elements) of one decoder block on one rank. Under TP both are taken as split
    over tp: the trainers refuse TP with [peft] (launch/config/resolve.py), so this only plans layouts such as the
    published Megatron LoRA runs', whose replicated lora_A / lora_B halves it does not tell apart."""
    m, t = layout.model, layout.grid.tp
    split = adapters.parameter_split(m, layout.peft)
    return split.trainable // m.num_layers // t, adapters.linear_params_per_block(m) // t


def rank_split(layout: Layout, params: int) -> ParameterSplit:
    """One rank's parameters (its TP/PP share) by what the step does with them; `params`: the base model's on one rank
    of a pipeline stage (launch.plan.memory.stage_params)."""
    if not adapted(layout):
        return ParameterSplit(params, 0, 0)
    per_adapters, per_linear = _per_layer(layout)
    layers = layout.model.num_layers // layout.grid.pp
    return ParameterSplit(per_adapters * layers, params, per_linear * layers)


def block_adapters(layout: Layout) -> int:
    """Adapter elements of one decoder block on one rank (0 without [peft])."""
    return _per_layer(layout)[0] if adapted(layout) else 0


def frozen_bytes(layout: Layout, split: ParameterSplit) -> int:
    """Bytes of a rank's frozen base, whole: held in precision.dtype (no fp32 master: nothing steps it), the blocks'
    linear weights in NF4 under QLoRA (embeddings, norms and the output layer stay in precision.dtype)."""
    e = layout.elem_bytes
    if quantized(layout):
        return math.ceil(NF4_BYTES_PER_PARAM * split.frozen_linear) + e * (split.frozen - split.frozen_linear)
    return e * split.frozen


def dequantized_bytes(layout: Layout) -> int:
    """QLoRA's transient: bitsandbytes dequantizes one linear weight at a time to the compute dtype for its matmul (in
    the forward and again in the backward); the largest block linear on the rank (0 unless QLoRA)."""
    if not quantized(layout):
        return 0
    largest = max(lin.out_features * lin.in_features for lin in adapters.block_linears(layout.model).values())
    return layout.elem_bytes * largest // layout.grid.tp


def adapter_tensors(layout: Layout, stage: int = 0) -> list[int]:
    """Element counts of the adapter tensors on one rank of pipeline stage `stage`, in module order (the order DDP
    buckets and the gradient norm count them); split over tp as `_per_layer` says."""
    per = layout.model.num_layers // layout.grid.pp
    lo, hi = stage * per, (stage + 1) * per
    return [p.numel // layout.grid.tp for p in adapters.adapter_parameters(layout.model, layout.peft)
            if lo <= p.layer < hi]


def adapted_modules(layout: Layout) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each block linear that takes an adapter, by the model's own name (Hugging Face's:
    q_proj, ..., down_proj); empty without [peft]."""
    return {lin.name: (lin.out_features, lin.in_features)
            for lin in adapters.adapted_linears(layout.model, layout.peft)}
