"""Memory per rank: the parameters each rank holds, model states by accounting, activations, buffers, and host
memory per node.

Accountings of model-state memory (all three are computed; the fit check uses the backend's own):
  * "zero_paper"  — Rajbhandari et al. 2020, Table 1: 16-bit weights 2 B + 16-bit grads 2 B + K = 12 B
                    (fp32 master, Adam m, Adam v) per parameter; fp32 training: 4 + 4 + 8.
  * "deepspeed"   — DeepSpeed 0.19.8's implementation, matching its own estimators
                    (estimate_zero2/zero3_model_states_mem_needs): ZeRO-2 keeps full 16-bit weights plus
                    a partition of 16-bit and fp32 grads, fp32 master, m and v (2 + 18/N B); ZeRO-1 keeps the
                    16-bit grads whole; ZeRO-3 keeps 18/N B plus the largest layer gathered (4 B × its
                    params); ZeRO-0 keeps fp32 master and fp32 grads beside the 16-bit copies (20 B).
  * "megatron"    — Megatron-Core 0.16.1's DDP and distributed optimizer, what the megatron backend builds at ZeRO-1
                    (its other stages, and the deepspeed backend, train through DeepSpeed's ZeRO and are checked by
                    "deepspeed"): bf16 weights 2 B, main grads in DDP's buffer 4 B (bf16 training accumulates and
                    reduces gradients in fp32) or 2 B with precision.grad_reduce_dtype="bf16", optimizer 12 B (fp32
                    main parameters, Adam's m and v); with the distributed optimizer (zero_stage >= 1) the 12 B are
                    split over the data-parallel group (6 + 12/d, as its docs state; 4 + 12/d with bf16 gradients).
  * "torch"       — PyTorch 2.13's DDP and FSDP2 (the torch backend): fp32 parameters are the master copy and Adam's
                    m and v are fp32, so DDP holds 4 + 4 + 8 = 16 B/param (gradients as views of its reduce buckets),
                    plus under autocast the 16-bit weight copies saved from forward to backward; FSDP2 shards the
                    16 B over the data-parallel group and gathers units in the compute dtype while they run
                    (`fsdp_gathered`).

Activations are derived per layer from the architecture (see `activation_terms`): the Llama family
(SwiGLU, GQA, RMSNorm, no dropout, fused attention that keeps no s×s scores) or the GPT layer of
Korthikanti et al. 2022, whose published totals the tests reproduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from launch.config.backends import SELECTIVE_EVERY, traits
from launch.plan.adapters import (
    adapted,
    adapted_modules,
    block_adapters,
    casts_adapter_input,
    dequantized_bytes,
    frozen_bytes,
    rank_split,
)
from launch.plan.layout import Layout, RankPlan, bucket, int_or, persistence_threshold, prefetch_bucket
from launch.units import GiB

ACCOUNTINGS = ("zero_paper", "deepspeed", "megatron", "torch")
# The step's phases whose peaks the torch accounting plans, in the order they happen (the rehearsal measures each):
# the last micro-batch's forward with its loss, its backward (gradients being reduced), and the optimizer step.
PHASES = ("forward", "backward", "optimizer step")
# A fixed runtime allowance (CUDA context, NCCL channels, cuBLAS workspace) plus allocator
# fragmentation as a fraction of everything else; both are stated in plan.json.
RUNTIME_ALLOWANCE_GPU = 1 * GiB
RUNTIME_ALLOWANCE_CPU = GiB // 2
FRAGMENTATION = 0.05
# DeepSpeed's estimators multiply every host figure by additional_buffer_factor=1.5 (pinned staging buffers and
# allocator slack); the host check uses the same factor so that it equals their CPU column.
HOST_BUFFER_FACTOR = 1.5


# --------------------------------------------------------------------------- parameters per rank


def _tp_split(layout: Layout, split: str) -> bool:
    """Whether tensor parallelism splits a parameter of this kind.

    Megatron-Core: every Linear plus the vocab-parallel embedding and output layer. DeepSpeed AutoTP
    (measured on 0.19.8): decoder Linears and lm_head (a column-parallel LinearLayer that gathers its
    output), while the embedding stays replicated.
    """
    if split in ("out", "in"):
        return True
    if split == "vocab":
        return True if traits(layout.backend).vocab_parallel else "lm_head"
    return False


def rank_parameters(layout: Layout, stage: int) -> list[int]:
    """Element counts of the parameter tensors one rank of pipeline stage `stage` holds (its TP shard)."""
    m, t, p = layout.model, layout.grid.tp, layout.grid.pp
    per_stage = m.num_layers // p
    lo, hi = stage * per_stage, (stage + 1) * per_stage
    out = []
    for info in m.parameters():
        if info.layer == -1:
            keep = stage == 0
        elif info.layer == m.num_layers:
            keep = stage == p - 1
        else:
            keep = lo <= info.layer < hi
        split = _tp_split(layout, info.split)
        if split == "lm_head":
            split = info.name.startswith("lm_head")
        if keep:
            out.append(info.numel // t if split else info.numel)
    if m.tie_word_embeddings and p > 1 and stage == p - 1:
        # The last stage keeps its own copy of the tied matrix (kept in sync by an all-reduce).
        out.append(m.vocab_size * m.hidden_size // (t if traits(layout.backend).vocab_parallel else 1))
    return out


def chunk_layers(num_layers: int, pp: int, vpp: int, stage: int) -> list[range]:
    """Decoder layers (0-based) of each model chunk on pipeline stage `stage`: Megatron-Core's interleaved
    assignment gives chunk v of stage p the layers of virtual stage v·pp + p (one chunk without vpp)."""
    per = num_layers // (pp * vpp)
    return [range((v * pp + stage) * per, (v * pp + stage + 1) * per) for v in range(vpp)]


def stage_params(layout: Layout, stage: int) -> tuple[int, int]:
    """(parameters held by one rank of pipeline stage `stage`, decoder layers on it)."""
    return sum(rank_parameters(layout, stage)), layout.model.num_layers // layout.grid.pp


def zero3_partition_numel(layout: Layout, stage: int = 0) -> int:
    """Elements of parameters one rank owns under ZeRO-3: each tensor is split into dp equal pieces,
    the last padded (DeepSpeed's ds_tensor holds ceil(numel / dp) elements)."""
    d = layout.grid.dp
    return sum(-(-n // d) for n in rank_parameters(layout, stage))


def zero3_fetched(layout: Layout, stage: int = 0) -> list[int]:
    """Sizes of a stage's parameters that ZeRO-3 partitions and gathers on use: those above
    stage3_param_persistence_threshold (the others stay whole on every rank)."""
    threshold = persistence_threshold(layout)
    return [n for n in rank_parameters(layout, stage) if n > threshold]



def largest_layer_params(layout: Layout) -> int:
    """Largest single module's parameters on one rank, as DeepSpeed's ZeRO-3 estimator means it (the embedding
    here); a backend whose TP splits the embedding (and every Linear) holds 1/tp of it."""
    big = layout.model.param_counts().largest_layer
    return big // layout.grid.tp if traits(layout.backend).vocab_parallel else big


def fsdp_units(layout: Layout, stage: int = 0) -> tuple[int, int]:
    """(the root units' parameters, one decoder block's) on one rank of pipeline stage `stage` before sharding: the
    torch backend's FSDP2 shards each decoder block as a unit and the rest of each model part (the embedding on the
    first stage; final norm and output layer on the last) in that part's root. Under [peft] a block's adapters are in
    its unit."""
    m, g = layout.model, layout.grid
    root, block = 0, block_adapters(layout)
    for info in m.parameters():
        n = info.numel // g.tp if _tp_split(layout, info.split) else info.numel
        if (info.layer == -1 and stage == 0) or (info.layer == m.num_layers and stage == g.pp - 1):
            root += n
        elif info.layer == 0:
            block += n
    return root, block


def fsdp_trained_units(layout: Layout, stage: int = 0) -> tuple[int, int]:
    """The trainable parameters of `fsdp_units`' root and block, whose gradients FSDP2 makes unsharded and reduces:
    the whole units without [peft]; under it a block's adapters alone (the root holds none)."""
    return (0, block_adapters(layout)) if adapted(layout) else fsdp_units(layout, stage)


def output_layer_params(layout: Layout) -> int:
    """Parameters of the output layer (final norm and output projection; the embedding where they are tied) on one
    rank of the last stage: the first gradients the backward makes, held unsharded in FSDP2's root unit until the
    embedding's arrive at its end."""
    m, t = layout.model, layout.grid.tp
    return sum(info.numel // t if _tp_split(layout, info.split) else info.numel for info in m.parameters()
               if info.layer == m.num_layers or (m.tie_word_embeddings and info.layer == -1))


def fsdp_gathered(layout: Layout, params: int, stage: int = 0) -> int:
    """Parameters FSDP2 holds gathered at its peak: at stage 3 the root (the output layer and loss run while it is
    gathered, and its backward gathers it again first) and two blocks (the one computing and the next, prefetched); every unit at stage 2
    (reshard_after_forward=False keeps each block gathered until its backward), and under a pipeline at either stage
    (its stages keep the parameters gathered from the first backward to the last: reshard_after_backward=False)."""
    if layout.zero_stage == 2 or layout.grid.pp > 1:
        return params
    root, block = fsdp_units(layout, stage)
    return min(params, root + 2 * block)


# --------------------------------------------------------------------------- model states


def model_states(layout: Layout, params: int, accounting: str, stage: int = 0) -> tuple[int, int, int, int]:
    """(weights, grads, optimizer, host) bytes on one rank of pipeline stage `stage` holding `params` parameters
    before ZeRO (under [peft] the base model's; its adapters beside them, launch.plan.adapters)."""
    if accounting == "torch":
        return _torch_states(layout, params, stage)
    states = {"zero_paper": _zero_paper_states, "deepspeed": _deepspeed_states, "megatron": _megatron_states}.get(
        accounting)
    if states is None:
        raise ValueError(f"unknown accounting {accounting}")
    # Each accounting's states are those of the parameters that train (the adapters under [peft]: their 16-bit copy,
    # master, gradients and optimizer state); the frozen base adds only its weights, in precision.dtype (DeepSpeed and
    # Megatron keep no fp32 master of a parameter without a gradient), partitioned as ZeRO-3 partitions every parameter.
    split = rank_split(layout, params)
    w, g, o, host = states(layout, split.trainable)
    frozen = frozen_bytes(layout, split)
    return w + (math.ceil(frozen / layout.grid.dp) if layout.zero_stage >= 3 else frozen), g, o, host


def _zero_paper_states(layout: Layout, params: int) -> tuple[int, int, int, int]:
    z, d, e = layout.zero_stage, layout.grid.dp, layout.elem_bytes
    k = 12 if layout.dtype != "fp32" else 8
    w, g, o = e * params, e * params, k * params
    if z >= 1:
        o = math.ceil(o / d)
    if z >= 2:
        g = math.ceil(g / d)
    if z >= 3:
        w = math.ceil(w / d)
    if layout.offload_optimizer != "none":
        return w, g, 0, o
    return w, g, o, 0


def _deepspeed_states(layout: Layout, params: int) -> tuple[int, int, int, int]:
    # DeepSpeed 0.19.8 (stage_1_and_2.py / stage3.py estimators): fp32 master 4 + Adam m, v 8 = 12 B
    # per parameter of the partition, plus an fp32 gradient partition of 4 B; ZeRO-2 also keeps its
    # 16-bit gradient partition (2 + 18/N in all); ZeRO-3 keeps 16-bit parameter partitions and the
    # largest layer gathered as 16-bit weights and gradients (4 B × its params).
    z, d, e = layout.zero_stage, layout.grid.dp, layout.elem_bytes
    mixed = layout.dtype != "fp32"
    host = 0
    if z == 0:
        w, g = e * params, e * params + (4 * params if mixed else 0)
        o = (12 if mixed else 8) * params
    elif z == 1:
        w, g = e * params, e * params + 4 * params // d
        o = 12 * params // d
    elif z == 2:
        w, g = e * params, (e + 4) * params // d
        o = 12 * params // d
    else:
        # The largest layer gathered whole, as weights and as gradients, in the model's element size (the
        # estimator's 4 B assumes 16-bit). In fp32 the parameter partition is itself the master copy
        # (stage3.py _link_all_hp_params): the optimizer adds Adam's m and v only (measured live,
        # tests/dist/test_state_bytes.py).
        big = largest_layer_params(layout)
        # hpZ adds a secondary partition over its group, in the parameters' dtype, to each parameter
        # that is released after use (partition_parameters.py _partition_param_sec); persistent ones stay whole.
        secondary = e * sum(zero3_fetched(layout)) // layout.hpz if layout.hpz > 1 else 0
        w = e * params // d + e * big + secondary
        g = 4 * params // d + e * big
        o = (12 if mixed else 8) * params // d
    if layout.offload_optimizer != "none":
        # The optimizer step, its fp32 state and the fp32 gradient partition move to the host. ZeRO-1/2 then
        # copy gradients from the reduce bucket straight into that fp32 partition, keeping no 16-bit one
        # (the estimators: 2 B/param on the device, 16 on the host); ZeRO-3 keeps the largest layer's.
        moved_g = g - (2 * largest_layer_params(layout) if z == 3 else 0)
        host += o + (4 * params // d if z < 3 else moved_g)
        o, g = 0, g - moved_g
    if layout.offload_params != "none" and z == 3:
        host += e * params // d
        w -= e * params // d
    return w, g, o, host


def _megatron_states(layout: Layout, params: int) -> tuple[int, int, int, int]:
    # Megatron-Core's distributed-optimizer table: bf16 params + fp32 main grads 6 + 12/d; fp16 params and
    # grads (fp32 main grads live in the optimizer) 4 + 16/d; fp32 8 + 8/d. DDP's gradient buffer holds the dtype it
    # reduces in (grad_reduce_in_fp32): bf16 halves it (4 + 12/d). In fp32 the main parameters are the parameters.
    z, d, e = layout.zero_stage, layout.grid.dp, layout.elem_bytes
    grad_bytes, opt_bytes = {"bf16": (layout.grad_reduce_bytes, 12), "fp16": (2, 16), "fp32": (4, 8)}[layout.dtype]
    w, g = e * params, grad_bytes * params
    opt = opt_bytes * params
    o = math.ceil(opt / d) if z >= 1 else opt
    if z >= 3:
        w, g = math.ceil(w / d), math.ceil(g / d)
    return w, g, o, 0


def _torch_states(layout: Layout, params: int, stage: int) -> tuple[int, int, int, int]:
    # fp32 parameters (the master copy), fp32 gradients (FSDP2 reduces in fp32) and AdamW's fp32 m and v, of the
    # parameters that train; under [peft] the frozen base beside them in precision.dtype (NF4 linear under QLoRA).
    e = layout.elem_bytes
    split = rank_split(layout, params)
    t, frozen = split.trainable, frozen_bytes(layout, split)
    if layout.zero_stage == 0:
        # DDP: everything whole; gradients are views of the reduce buckets. Under autocast the 16-bit copies of the
        # trained weights are saved for the backward (a frozen base is in the compute dtype already); QLoRA's one
        # dequantized linear weight at a time.
        return (4 * t + (e * t if layout.dtype != "fp32" else 0) + frozen + dequantized_bytes(layout), 4 * t, 8 * t,
                0)
    # FSDP2: the 16 B sharded over dp (each tensor padded to a multiple of dp rows, ignored here), plus the
    # gathered units in the compute dtype, and one block's and the root's unsharded gradients in the backward.
    root, block = fsdp_trained_units(layout, stage)
    gathered = e * fsdp_gathered(layout, split.trainable + split.frozen, stage)
    group = layout.hpz if layout.hpz > 1 else layout.grid.dp  # hybrid sharding: within its groups
    shard, frozen_shard = -(-t // group), -(-frozen // group)
    # The unsharded gradients of the unit in its backward; under a pipeline every unit's, accumulated in
    # fp32 until the last micro-batch (torch.distributed.pipelining defers FSDP2's reduce-scatter there).
    unsharded = 4 * t if layout.grid.pp > 1 else e * min(t, root + block)
    if layout.offload_params != "none":
        # CPUOffloadPolicy: sharded parameters, gradients and the optimizer step live on the host
        return gathered, unsharded, 0, 16 * shard + frozen_shard
    return 4 * shard + frozen_shard + gathered, 4 * shard + unsharded, 8 * shard, 0


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActTerm:
    name: str
    bytes: float  # for one micro-batch, one layer, no parallelism
    region: str  # "tp": split over t; "replicated": split over t only with SP; "whole": never split
    scores: bool = False  # s×s attention terms, dropped by selective recompute


def activation_terms(arch: str, s: int, b: int, h: int, a: int, *, ffn: int = 0, kv_heads: int = 0,
                     head_dim: int = 0, e: int = 2, hf_norm: bool = False, attention: str = "sdpa",
                     fused_qkv: bool = False, sp_gathered_inputs: bool = False, repeat_kv: bool = False) -> list[ActTerm]:
    """Bytes saved for backward by one transformer layer.

    "gpt": Korthikanti et al. 2022, §4.1 (16-bit activations, 1-byte dropout masks, 4h MLP):
           sbh(34 + 5as/h) without parallelism.
    "llama": RMSNorm (saves its input), SwiGLU saving gate, up, silu(gate) and their product; no dropout.
           hf_norm: Hugging Face's RMSNorm instead of a fused one: it saves an fp32 copy of its input and the
           normalized tensor.
           The attention block (terms named attn_*, measured per implementation in tests/unit/test_attention_memory.py):
           its input (the q/k/v projections'), q and k after RoPE and v, then
           attention="sdpa": scaled_dot_product_attention's output and fp32 log-sum-exp, no s×s scores ("te", Transformer
           Engine's fused attention, planned the same: not measured here, it needs a GPU); with repeat_kv (a device whose
           fused kernel refuses grouped-query attention: HardwareProfile.fused_attention_gqa) the K and V it keeps are
           repeated to every query head;
           attention="eager" (Hugging Face's eager attention, Megatron-Core's DotProductAttention): k and v repeated
           to every query head (grouped-query attention), the s×s softmax (fp32, plus its cast to the model dtype)
           and the output's reshaped copy that the output projection keeps.
           fused_qkv (Megatron-Core): v is a view of the fused q/k/v projection's output, which it keeps whole
           (q and k before RoPE too) wherever v itself is saved.
           sp_gathered_inputs (DTensor's SequenceParallel, the torch backend): the attention's and the MLP's inputs
           are the all-gathered sequence, which the column-parallel projections save whole (Megatron-Core saves its
           shard and gathers it again in the backward); measured by `python -m launch rehearse`.
    """
    sbh = s * b * h
    if arch == "gpt":
        return [
            ActTerm("ln1_input", 2 * sbh, "replicated"), ActTerm("qkv_input", 2 * sbh, "replicated"),
            ActTerm("q_k", 4 * sbh, "tp"), ActTerm("softmax_out", 2 * a * s * s * b, "tp", True),
            ActTerm("softmax_dropout_mask", a * s * s * b, "tp", True),
            ActTerm("attn_dropout_out", 2 * a * s * s * b, "tp", True), ActTerm("v", 2 * sbh, "tp"),
            ActTerm("proj_input", 2 * sbh, "tp"), ActTerm("attn_dropout_mask", sbh, "replicated"),
            ActTerm("ln2_input", 2 * sbh, "replicated"), ActTerm("fc1_input", 2 * sbh, "replicated"),
            ActTerm("gelu_input", 8 * sbh, "tp"), ActTerm("fc2_input", 8 * sbh, "tp"),
            ActTerm("mlp_dropout_mask", sbh, "replicated"),
        ]
    if arch == "llama":
        kv = s * b * kv_heads * head_dim
        sbf = s * b * ffn
        norm_in = 4 * sbh if hf_norm else e * sbh
        q = e * s * b * a * head_dim
        gathered = "whole" if sp_gathered_inputs else "replicated"
        terms = [ActTerm("norm1_input", norm_in, "replicated"), ActTerm("attn_input", e * sbh, gathered),
                 ActTerm("attn_q", q, "tp"), ActTerm("attn_out", q, "tp")]
        if attention in ("sdpa", "te"):  # Transformer Engine's fused attention keeps what flash attention keeps
            terms += [ActTerm("attn_k_v", 2 * q if repeat_kv else 2 * e * kv, "tp"), ActTerm("attn_lse", 4 * b * a * s, "tp")]
        elif attention == "eager":
            probs = (4 + (e if e != 4 else 0)) * a * s * s * b
            terms += [ActTerm("attn_k_v", 2 * q, "tp"), ActTerm("attn_probs", probs, "tp", scores=True)]
        else:
            raise ValueError(f"unknown attention {attention!r}")
        if fused_qkv and (attention in ("sdpa", "te") or kv_heads == a):
            terms.append(ActTerm("attn_qkv_kept", q + e * kv, "tp"))  # the fused output's q and k parts, before RoPE
        terms += [ActTerm("norm2_input", norm_in, "replicated"), ActTerm("mlp_input", e * sbh, gathered),
                  ActTerm("gate_out", e * sbf, "tp"), ActTerm("up_out", e * sbf, "tp"),
                  ActTerm("silu_out", e * sbf, "tp"), ActTerm("down_input", e * sbf, "tp")]
        if hf_norm and e != 4:
            terms += [ActTerm("norm1_normalized", e * sbh, "replicated"), ActTerm("norm2_normalized", e * sbh, "replicated")]
        return terms
    raise ValueError(f"unknown layer arch {arch!r}")


def layer_activation_bytes(terms: list[ActTerm], *, t: int = 1, sp: bool = False, activation_checkpointing: str = "none",
                           layer_input_bytes: float | None = None) -> float:
    """Bytes one layer keeps for one micro-batch under TP degree t, SP and a recompute policy."""
    if activation_checkpointing == "full":
        # Only the layer input survives the forward pass; it is sharded along the sequence with SP.
        x = layer_input_bytes if layer_input_bytes is not None else terms[0].bytes
        return x / t if sp else x
    total = 0.0
    for term in terms:
        if activation_checkpointing == "selective" and term.scores:
            continue
        split = t if term.region == "tp" or (sp and term.region == "replicated") else 1
        total += term.bytes / split
    return total


def _model_terms(layout: Layout, b: int) -> list[ActTerm]:
    m = layout.model
    # A backend training Hugging Face modules has unfused RMSNorm; Megatron-Core's layers fuse q/k/v in one projection;
    # every backend runs the attention the recipe names.
    hf = traits(layout.backend).hf_modules
    return activation_terms("llama", layout.seq_len, b, m.hidden_size, m.num_heads, ffn=m.intermediate_size,
                            kv_heads=m.num_kv_heads, head_dim=m.head_dim, e=layout.elem_bytes, hf_norm=hf,
                            attention=layout.attention, fused_qkv=not hf, sp_gathered_inputs=hf and layout.sp,
                            repeat_kv=repeats_kv(layout)) + adapter_terms(layout, b)


# The block linears that read each input the base terms count once (activation_terms' names); the attention's output,
# o_proj's input, is kept by SDPA itself ("attn_out") whatever its linear saves.
LINEAR_INPUTS = {"attn_input": ("q_proj", "k_proj", "v_proj"), "mlp_input": ("gate_proj", "up_proj"),
                 "down_input": ("down_proj",), "attn_out": ("o_proj",)}


def adapter_terms(layout: Layout, b: int) -> list[ActTerm]:
    """How [peft] changes what a block saves for the backward (none without it), measured on peft 0.21.2's LoRA Linear
    (saved_tensors_hooks over a block, and `python -m launch rehearse`):
    - a frozen linear saves no input (no weight gradient) and a frozen norm weight no normalized tensor, so a block input
      the base terms count is kept only for the adapters that read it: the one tensor itself, or, where the layer casts
      it (`casts_adapter_input`: fp32 adapters beside a 16-bit base), a 16-bit copy per adapter; with peft.dropout > 0
      each adapter's dropped-out input and its 1-byte mask instead;
    - lora_A's output (tokens × rank, 16-bit), which lora_B keeps.
    Approximation: bitsandbytes' 4-bit matmul is taken to keep what nn.Linear keeps (no input: its weight is frozen)."""
    adapted_now = adapted_modules(layout)
    if not adapted_now:
        return []
    m, e, tokens = layout.model, layout.elem_bytes, layout.seq_len * b
    dropout = layout.peft.dropout > 0
    copies = dropout or casts_adapter_input(layout)
    per_adapter = (e + (1 if dropout else 0)) * tokens  # per input element: the new tensor (and the dropout's mask)
    terms = []
    for base, readers in LINEAR_INPUTS.items():
        width = adapted_now.get(readers[0], (0, m.hidden_size if base != "down_input" else m.intermediate_size))[1]
        users = [r for r in readers if r in adapted_now]
        kept_anyway = base == "attn_out"
        if copies:
            kept = len(users) * per_adapter * width
        else:
            kept = e * tokens * width if users and not kept_anyway else 0
        dropped = 0 if kept_anyway else e * tokens * width  # the base terms' own count of the input
        terms.append(ActTerm(f"lora_{base}", kept - dropped, "replicated" if base != "down_input" else "tp"))
    if traits(layout.backend).hf_modules and e != 4:  # activation_terms' norm*_normalized, kept for the norm weights
        terms.append(ActTerm("lora_frozen_norms", -2 * e * tokens * m.hidden_size, "replicated"))
    terms += [ActTerm(f"lora_{name}_a_out", e * tokens * layout.peft.rank, "whole") for name in adapted_now]
    return terms


def sdpa_kernel(layout: Layout) -> str:
    """The kernel scaled_dot_product_attention runs for the layout (causal, no mask), by torch 2.13.0's dispatch: on
    GPUs flash attention for 16-bit inputs where the device has it (HardwareProfile.fused_attention_gqa: sm 8.0 and
    later), else the memory-efficient kernel; on CPU ranks torch's CPU flash kernel."""
    if layout.hardware.device_type == "cpu":
        return "the CPU flash kernel"
    return ("the flash kernel" if layout.hardware.fused_attention_gqa and layout.dtype != "fp32"
            else "the memory-efficient kernel")


def repeats_kv(layout: Layout) -> bool:
    """Whether the layout's attention runs on K/V heads repeated to every query head: a grouped-query model's SDPA on
    the memory-efficient kernel, which refuses GQA in torch 2.13.0 (it would fall to the math kernel and its s × s
    scores), so the Hugging Face backends repeat them first (Megatron-Core's own attention is not Hugging Face's)."""
    m = layout.model
    return (layout.attention == "sdpa" and m.num_kv_heads < m.num_heads and traits(layout.backend).hf_modules
            and sdpa_kernel(layout) == "the memory-efficient kernel")


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations one stage holds at its peak (1F1B; interleaved per Korthikanti §4.2.3)."""
    p, mb = layout.grid.pp, max(1, layout.grad_accum)
    if p == 1:
        return 1.0
    held = min(p - stage, mb)
    if layout.vpp > 1 and stage == 0:
        held *= 1 + (p - 1) / (p * layout.vpp)
    return float(held)


@dataclass(frozen=True)
class StageActivations:
    """Bytes one rank of a pipeline stage keeps for backward, for one micro-batch in flight."""

    layers: float  # what the decoder layers save in the forward (under full checkpointing: each one's input)
    recomputed: float  # one layer's whole set, alive while it is recomputed in the backward (full checkpointing)
    norm_input: float  # the last stage's final-norm input
    logits: float  # elements of the last stage's logits on this rank (its share of the vocabulary under TP)
    in_flight: float  # micro-batches whose activations the stage holds at its peak (`in_flight`)


def _checkpointed_input(layout: Layout) -> float | None:
    """What a fully checkpointed layer keeps: its input. The torch backend's FSDP2 casts each unit's input to the
    compute dtype (MixedPrecisionPolicy's cast_forward_inputs); under DDP's autocast the residual stream stays fp32,
    unless a [peft] base held in the compute dtype makes it so from the embedding on. Elsewhere the first term (the
    norm's input) stands for it."""
    if traits(layout.backend).accounting != "torch":
        return None
    rows = layout.seq_len * layout.micro_batch_size * layout.model.hidden_size
    return (layout.elem_bytes if layout.zero_stage > 0 or adapted(layout) else 4) * rows


# torchtitan's op policy (launch/ranks/trainers/torch_backend.py: op_policy) on a Hugging Face Llama block, whose
# matmuls run q, k, v, o, gate, up, down: it keeps every second one's output from the first (q, v, gate, down) and
# recomputes the others; the one home of which, for memory, FLOPs and time.
OP_POLICY_RECOMPUTED = ("k_proj", "o_proj", "up_proj")


def op_policy_layer_bytes(layout: Layout, b: int, block_input: float) -> float:
    """What one block keeps under the op policy for one micro-batch: its input, the kept matmuls' outputs (q and v
    split over TP, gate too; down's partial sums whole), attention's output and fp32 log-sum-exp, and with TP each
    reduction's output (o's and down's: whole after an all-reduce, a sequence shard after SP's reduce-scatter).
    Measured by `python -m launch rehearse` (FSDPMemTracker's activations)."""
    m, t, e = layout.model, layout.grid.tp, layout.elem_bytes
    rows = layout.seq_len * b
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    kept = e * rows * (2 * q + kv + m.intermediate_size) / t + 4 * b * m.num_heads * layout.seq_len / t
    kept += e * rows * m.hidden_size  # down_proj's output: the whole hidden size, partial sums under TP
    if t > 1:
        kept += 2 * e * rows * m.hidden_size / (t if layout.sp else 1)
    return (block_input / t if layout.sp else block_input) + kept


def stage_activation_parts(layout: Layout, stage: int) -> StageActivations:
    m, t, p = layout.model, layout.grid.tp, layout.grid.pp
    b = layout.micro_batch_size
    terms = _model_terms(layout, b)
    layers = m.num_layers // p
    ac = layout.activation_checkpointing
    x = _checkpointed_input(layout)
    if ac == "selective" and traits(layout.backend).selective == "op":
        # the op policy's count is the base block's; the adapters' tensors taken as kept (their matmuls are not in it)
        stored = layers * (op_policy_layer_bytes(layout, b, x if x is not None else terms[0].bytes)
                           + sum(t.bytes for t in adapter_terms(layout, b)))
        ac = "full"  # one recomputed block's activations are alive at once, as below
    elif ac == "every_other_block":
        # Blocks 0, n, 2n, ... recompute fully (launch.config.backends.SELECTIVE_EVERY); the others save everything.
        full = -(-layers // SELECTIVE_EVERY)
        stored = (full * layer_activation_bytes(terms, t=t, sp=layout.sp, activation_checkpointing="full",
                                                layer_input_bytes=x)
                  + (layers - full) * layer_activation_bytes(terms, t=t, sp=layout.sp))
        ac = "full"  # one recomputed block's activations are alive at once, as below
    else:
        stored = layers * layer_activation_bytes(terms, t=t, sp=layout.sp, activation_checkpointing=ac,
                                                 layer_input_bytes=x)
    # While one layer is recomputed, its full activation set is alive once.
    recomputed = layer_activation_bytes(terms, t=t, sp=layout.sp, activation_checkpointing="none") if ac == "full" else 0
    norm_input = logits = 0.0
    if stage == p - 1:
        vocab_split = t if traits(layout.backend).vocab_parallel else 1
        norm_input = layout.elem_bytes * layout.seq_len * b * m.hidden_size
        logits = layout.seq_len * b * m.vocab_size / vocab_split
    return StageActivations(stored, recomputed, norm_input, logits, in_flight(layout, stage))


def stage_activations(layout: Layout, stage: int) -> int:
    """The activations' peak, as the accountings that add each kind's peak count it: every layer's saved tensors,
    one recomputed layer and, on the last stage, the output layer at the start of the backward (final-norm input,
    16-bit logits, the fp32 upcast and log-softmax of the loss, and the fp32 gradient of the logits beside them),
    for each micro-batch in flight."""
    a = stage_activation_parts(layout, stage)
    output = a.norm_input + (layout.elem_bytes + 12) * a.logits
    return int((a.layers + a.recomputed + output) * a.in_flight)


# --------------------------------------------------------------------------- the torch backend's step, phase by phase


# Bytes per logit (beyond the logits themselves, in the compute dtype) the torch backend's loss keeps, at the loss and
# in its backward, measured by `python -m launch rehearse`: cross_entropy on the fp32 upcast keeps the log-softmax
# (8: the upcast is alive until the log-softmax exists) and adds the fp32 gradient of the logits in the backward (10);
# DTensor's loss_parallel (TP, the vocabulary split) keeps the upcast, the log-softmax and its own fp32 intermediates.
LOSS_BYTES = {"cross_entropy": (8, 10), "loss_parallel": (14, 16)}


@dataclass(frozen=True)
class PhaseMemory:
    """What one rank holds at the peak of one phase of the step (PHASES), by kind, in bytes."""

    phase: str
    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def phased(layout: Layout) -> bool:
    """Whether the torch accounting plans this layout phase by phase (checked against the rehearsal): without a
    pipeline (its stages hold several micro-batches' activations and gradients at once) and without offloading."""
    return layout.grid.pp == 1 and layout.offload_params == "none" and layout.offload_optimizer == "none"


def torch_phases(layout: Layout, params: int, stage: int = 0) -> list[PhaseMemory]:
    """The torch backend's rank (DDP or FSDP2, no pipeline) at the peak of each phase of the last micro-batch and the
    step after it, as torch's FSDPMemTracker / MemTracker see them in `python -m launch rehearse`:

    forward   the model states (the gradients held only when earlier micro-batches made them) and the larger of: the
              first units gathered beside their all-gather buffers as it begins; every layer's saved activations with
              the larger of the units gathered while the last layers run and the output layer at the loss (FSDP2 at
              zero_stage 3 has resharded every unit by then; at 2 they all stay gathered);
    backward  the gradients held (sharded), the activations not yet freed, and the larger of the loss's gradient of
              the logits and the first layers' backward: the units gathered, one recomputed layer (full checkpointing),
              the unit's unsharded gradients in the compute dtype and their fp32 copy being reduce-scattered;
    optimizer step  the model states alone (AdamW fused, as on a GPU: no temporaries).
    """
    e, g = layout.elem_bytes, layout.grid
    a = stage_activation_parts(layout, stage)
    layers = int(a.layers)
    at_loss, in_loss_backward = LOSS_BYTES["loss_parallel" if g.tp > 1 else "cross_entropy"]
    output_forward = int(a.norm_input + (e + at_loss) * a.logits)
    output_backward = int(a.norm_input + (e + in_loss_backward) * a.logits)
    # What trains (every parameter without [peft], its adapters under it) holds fp32 master, gradients and m, v; a frozen
    # base only its weights (launch.plan.adapters).
    split = rank_split(layout, params)
    t, frozen = split.trainable, frozen_bytes(layout, split)
    if layout.zero_stage == 0:
        # DDP: fp32 parameters, their gradients (views of the reduce buckets, allocated when DDP wraps the model) and
        # AdamW's m and v, whole; under autocast the 16-bit copies of the trained weights, cast once per forward and
        # kept until the backward has used them; QLoRA's one dequantized linear weight while it computes.
        copies = e * t if layout.dtype != "fp32" else 0
        running = 4 * t + frozen + copies + dequantized_bytes(layout)
        fw = PhaseMemory("forward", running, 4 * t, 8 * t, layers + output_forward)
        bw = PhaseMemory("backward", running, 4 * t, 8 * t, layers + max(output_backward, int(a.recomputed)))
        return [fw, bw, PhaseMemory("optimizer step", 4 * t + frozen, 4 * t, 8 * t, 0)]
    group = layout.hpz if layout.hpz > 1 else g.dp  # hybrid sharding: within its groups
    shard = -(-t // group)
    stored = 4 * shard + -(-frozen // group)  # the sharded parameters: fp32 trained ones and the frozen base
    total = t + split.frozen
    root, block = fsdp_units(layout, stage)
    trained_block = fsdp_trained_units(layout, stage)[1]
    gathered = e * fsdp_gathered(layout, total, stage)
    after_forward = e * total if layout.zero_stage == 2 else 0  # units still gathered once the forward is done
    held = 4 * shard if layout.grad_accum > 1 else 0  # the sharded gradients of the earlier micro-batches
    # The output layer's unsharded gradients (its root unit reduces them with the embedding's, at the end; frozen under
    # [peft]), a block's, and the block's copy in precision.grad_reduce_dtype, the reduce-scatter's input.
    output = 0 if adapted(layout) else output_layer_params(layout)  # (this rank: the output layer)
    reducing = e * (output + trained_block) + layout.grad_reduce_bytes * trained_block
    # As the forward begins, the root and the first block are gathered while their all-gather outputs are still
    # held (the tracker's all-gather buffers): twice their bytes, beside no activations yet.
    starting = 2 * e * min(total, root + block)
    if starting >= layers + max(gathered, after_forward + output_forward):
        fw = PhaseMemory("forward", stored + starting, held, 8 * shard, 0)
    elif gathered >= after_forward + output_forward:
        fw = PhaseMemory("forward", stored + gathered, held, 8 * shard, layers)
    else:
        fw = PhaseMemory("forward", stored + after_forward, held, 8 * shard, layers + output_forward)
    if gathered + reducing + int(a.recomputed) >= after_forward + output_backward:
        bw = PhaseMemory("backward", stored + gathered, held + reducing, 8 * shard, layers + int(a.recomputed))
    else:
        bw = PhaseMemory("backward", stored + after_forward, held, 8 * shard, layers + output_backward)
    return [fw, bw, PhaseMemory("optimizer step", stored, 4 * shard, 8 * shard, 0)]


# --------------------------------------------------------------------------- buffers


def buffers(layout: Layout, params: int) -> int:
    """Communication buffers DeepSpeed allocates (elements × element size), capped by the rank's parameters. Nothing
    else has any beyond its model states: DDP's buckets are its gradients (torch's and Megatron's, whose distributed
    optimizer reduce-scatters and gathers in place), FSDP2 gathers into the units' parameters."""
    if layout.grid.dp == 1 and layout.zero_stage == 0 or not traits(layout.backend).uses_deepspeed(layout.zero_stage):
        return 0
    z, e, zo = layout.zero_stage, layout.elem_bytes, layout.ds_zero
    # Buckets carry gradients and updated partitions: of the parameters that train (the adapters under [peft]).
    trained = rank_split(layout, params).trainable
    reduce = min(bucket(layout, "reduce_bucket_size"), trained)
    if z in (1, 2):
        gather = min(bucket(layout, "allgather_bucket_size"), trained)
        copies = 2 if zo.get("overlap_comm") else 1  # overlap_comm double-buffers the gradient bucket
        return e * (copies * reduce + gather)
    if z == 3:
        prefetch = prefetch_bucket(layout)
        live = min(int_or(zo.get("stage3_max_live_parameters"), 1_000_000_000), prefetch + largest_layer_params(layout),
                   params)
        return e * (reduce + live)
    return e * reduce



def host_bytes_per_node(layout: Layout, ranks: list[RankPlan], staged_per_rank: int = 0) -> int:
    """Host memory of the busiest node, as DeepSpeed's estimate_zero2/zero3_model_states_mem_needs count it: the model
    as it is built on the host (fp32, 4 B per parameter), and offloaded optimizer state (and ZeRO-3 parameters) there
    afterwards; the node needs the larger of the two, times the estimators' buffer factor. Who builds what there is the backend's
    BackendTraits.host_build: no rank the whole model (torch: each rank holds one tensor whole at a time while it cuts
    its shards; megatron: about a layer's tensors), or every rank (deepspeed below ZeRO-3,
    where every rank keeps every parameter, and with AutoTP; at ZeRO-3 zero.Init, where each rank holds one module
    whole at a time, DeepSpeed's estimator with zero_init). With one node,
    tp = pp = 1 and DeepSpeed,
    this is DeepSpeed's CPU column exactly; across nodes their ZeRO-2 offload figure counts every GPU's model copy as if
    on one node (max(4 · total GPUs, 16) B/param), which this does not. Local weights read under zero.Init pass through
    rank 0's page cache, which this does not count. `staged_per_rank`: each rank's asynchronous checkpoint copy, held in
    host memory from the first save on, beside the offloaded state (the build is over by then)."""
    g = layout.grid
    counts = layout.model.param_counts()
    whole = 4 * counts.total  # a process that builds the whole fp32 model before sharding it
    bt = traits(layout.backend)
    # A sharded start-up holds one whole tensor at a time (torch), or about a layer's (Megatron: its fused q/k/v and
    # gate/up shards are cut once a layer's tensors are all there); zero.Init one module at a time.
    held = max(counts.largest_layer, counts.per_layer) if bt.host_build == "sharded" and not bt.hf_modules else (
        counts.largest_layer)
    per_rank = 4 * held if bt.builds_partitioned(layout.zero_stage, g.tp) else whole
    # (first, stop, offloaded bytes per rank) of each run of consecutive ranks: a stage's ranks are a range.
    runs = [(a, b, rp.memory[rp.implementation].host_bytes) for rp in ranks for a, b in _consecutive(rp.ranks)]
    gpn = g.gpus_per_node
    # Only nodes where a run starts or ends, the one after a run's first node and node 0 can differ from their
    # neighbours: every other node is filled by one run, as the node after that run's first node is.
    nodes = {0, *(n for a, b, _ in runs for n in (a // gpn, a // gpn + 1, (b - 1) // gpn))}
    last = max((b - 1) // gpn for _, b, _ in runs) if runs else -1
    worst = None
    for n in sorted(x for x in nodes if x <= last):
        held = [(a, b, off, max(0, min(b, (n + 1) * gpn) - max(a, n * gpn))) for a, b, off in runs]
        if not any(k for *_, k in held):
            continue  # no rank of the plan lives there
        load = sum(k * per_rank for *_, k in held)
        offloaded = sum(k * off for *_, off, k in held)
        value = max(int(HOST_BUFFER_FACTOR * max(load, offloaded)),
                    int(HOST_BUFFER_FACTOR * offloaded) + sum(k for *_, k in held) * staged_per_rank)
        worst = value if worst is None else max(worst, value)
    return worst or 0


def _consecutive(ranks) -> list[tuple[int, int]]:
    """(first, stop) of each run of consecutive ranks: one for a range, without walking it."""
    if isinstance(ranks, range) and ranks.step == 1:
        return [(ranks.start, ranks.stop)] if len(ranks) else []
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(a, b) for a, b in out]

