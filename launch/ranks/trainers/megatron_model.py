"""The Megatron-Core GPTModel of a catalogue model, and its weights to and from Hugging Face's layout.

A catalogue `ModelSpec` (Llama or Qwen2 config.json) becomes a `TransformerConfig` and this rank's
GPTModel chunk(s) built from the local (non Transformer-Engine) spec: RMSNorm, SwiGLU, RoPE,
grouped-query attention, no biases except Qwen2's q/k/v bias, tied or untied embeddings as the config
says, no dropout. Megatron's own initialisation depends on the layout (TP shards are drawn from
per-rank RNG streams), so every layout instead loads one canonical set of weights: the Hugging Face
model's initial state for a seed (`hf_reference_state`), converted to each rank's shard
(`load_hf_state`). `gather_hf_state` is the reverse, for exporting a trained run as an HF folder.

Megatron's layout of the shards (checked against an HF forward in tests/unit/test_megatron_model.py and,
at TP2 / TP2+SP / PP2, in tests/dist/test_megatron_sharding.py):
- linear_qkv fuses q, k and v per query group, [q heads of group 0, k0, v0, q heads of group 1, ...],
  and is split over TP along dim 0 (when TP exceeds the KV heads Megatron all-gathers it and slices;
  the stored shard is still the plain dim-0 split);
- linear_fc1 is [gate; up]; each TP rank holds [its gate shard; its up shard] (stride 2);
- linear_proj and linear_fc2 are row-parallel: split along dim 1;
- the word embedding and output_layer are split along the vocab dim. Megatron-Core itself never pads
  the vocab (Megatron-LM's make_vocab_size_divisible_by is a training-script argument, not core), so the
  vocab must divide by TP, which `transformer_config` checks;
- tied embeddings: at PP1 output_layer has no weight of its own; at PP>1 the last stage keeps a copy
  as output_layer.weight, which GPTModel's constructor zeroes and all-reduces over the embedding group
  (first + last stage) so both start equal, and which `load_hf_state` fills from the embedding. Training
  would have to all-reduce the two copies' grads over the same group (Megatron's finalize_model_grads does,
  for Megatron DDP); the megatron backend does not, so the resolver refuses tied embeddings under PP.

Calling the forward on CPU (after `cpu_compat.apply(cuda=False)`, which `build_chunks` calls):
    loss = chunk(input_ids, position_ids, attention_mask=None, labels=labels)
input_ids, position_ids and labels are int64 [b, s]; attention_mask=None gives the causal mask of the
local spec (an explicit bool [1, 1, s, s] mask with True above the diagonal is equivalent). With labels the
result is the per-token cross entropy [b, s] (float32 for fp32 params), identical on every TP rank; without,
logits [b, s, vocab / tp]. Only a chunk with post_process returns either; the others return the hidden
states [s (/ tp under SP), b, h] for the next stage, and a chunk without pre_process ignores input_ids and
reads the tensor given to `chunk.set_input_tensor(...)` (the pipeline schedules do both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor

from launch.config.models import ModelSpec
from launch.torchtools.hf import hf_config
from launch.ranks.trainers import cpu_compat
from launch.ranks.trainers.common import torch_dtype

Checkpointing = Literal["none", "full", "selective"]
Dtype = Literal["fp32", "bf16", "fp16"]

_SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# Megatron's llama3 RoPE scaling hard-codes these three (RotaryEmbedding._apply_scaling); only `factor` is free.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# --------------------------------------------------------------------------- Hugging Face side


def hf_reference_state(spec: ModelSpec, seed: int) -> dict[str, Tensor]:
    """The canonical initial weights: the HF model's fp32 init after torch.manual_seed(seed).

    Keyed as `spec.parameters()` names them: a tied lm_head.weight is the embedding tensor itself, so, as
    in the safetensors files save_pretrained writes, it appears once, as model.embed_tokens.weight.
    The default generator is restored afterwards: the seeding Megatron did per pipeline stage stays in effect.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
    state = model.state_dict()
    return {p.name: state[p.name] for p in spec.parameters()}


def _hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for p in spec.parameters():
        if p.name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[p.name] = (v, h)
        elif p.name == "model.norm.weight":
            shapes[p.name] = (h,)
        else:
            shapes[p.name] = per_layer[p.name.split(".", 3)[3]]
    return shapes


def checked_hf_state(hf_state: Mapping[str, Tensor], spec: ModelSpec) -> Mapping[str, Tensor]:
    """Every key of `spec.parameters()` with its shape, nothing else; a tied lm_head.weight may come along
    (HF's own state_dict() lists it) if it equals the embedding."""
    shapes = _hf_shapes(spec)
    extra = sorted(set(hf_state) - set(shapes))
    if spec.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
        if not torch.equal(hf_state["lm_head.weight"], hf_state.get("model.embed_tokens.weight", torch.empty(0))):
            raise ValueError(f"{spec.name}: lm_head.weight differs from model.embed_tokens.weight, but the "
                             "config ties them (tie_word_embeddings=true)")
    if extra:
        raise ValueError(f"{spec.name}: HF state has {extra[0]!r}, which this {spec.architecture} config does not "
                         f"have ({len(extra)} unexpected keys)")
    for name, shape in shapes.items():
        if name not in hf_state:
            raise ValueError(f"{spec.name}: HF state lacks {name!r}")
        if tuple(hf_state[name].shape) != shape:
            raise ValueError(f"{spec.name}: HF {name!r} has shape {tuple(hf_state[name].shape)}, expected {shape}")
    return hf_state


# --------------------------------------------------------------------------- Megatron config and model


def _rope(spec: ModelSpec) -> dict[str, Any]:
    hf = spec.hf_config
    scaling = hf.get("rope_scaling")
    out: dict[str, Any] = {"rotary_base": float(hf.get("rope_theta", 10000.0)), "rope_scaling": False}
    if scaling is None:
        return out
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {k: float(scaling.get(k, -1)) for k in _LLAMA3_FIXED}
    if kind != "llama3" or fixed != _LLAMA3_FIXED:
        raise ValueError(f"{spec.source}: rope_scaling={dict(scaling)} is not supported by Megatron-Core's RoPE; "
                         f"only rope_type 'llama3' with {_LLAMA3_FIXED} is")
    return {**out, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def _check_supported(spec: ModelSpec) -> None:
    hf = spec.hf_config
    where = spec.source
    if spec.architecture not in _SUPPORTED:
        raise ValueError(f"{where}: {spec.architecture} has no Megatron-Core mapping here; use one of {_SUPPORTED}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r}; the SwiGLU mapping needs 'silu'")
    # Megatron's add_bias_linear puts a bias on every linear at once; Llama's attention_bias (q, k, v and o)
    # or mlp_bias cannot be expressed, only Qwen2's q/k/v-only bias (add_qkv_bias).
    if spec.architecture == "LlamaForCausalLM" and (spec.attention_bias or spec.mlp_bias):
        raise ValueError(f"{where}: attention_bias/mlp_bias on Llama are not supported by the Megatron mapping")
    if hf.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported by the Megatron mapping")
    _rope(spec)


def transformer_config(spec: ModelSpec, *, cuda: bool, tp: int, pp: int, vpp: int, sp: bool,
                       activation_checkpointing: Checkpointing, dtype: Dtype) -> TransformerConfig:
    """The Megatron TransformerConfig of `spec` at this layout (vpp = model chunks per pipeline rank, 1 = none), for a
    run on GPUs (`cuda`) or on CPU ranks (HardwareProfile.device_type decides, not this machine's torch.cuda)."""
    _check_supported(spec)
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}; use one of fp32, bf16, fp16")
    if activation_checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r}; use none, full or selective")
    if sp and tp < 2:
        raise ValueError(f"sp=True needs tp > 1 (got tp={tp})")
    if vpp > 1 and pp < 2:
        raise ValueError(f"vpp={vpp} needs pp > 1 (got pp={pp})")
    for what, size in (("vocab_size", spec.vocab_size), ("intermediate_size", spec.intermediate_size)):
        if size % tp:
            raise ValueError(f"{spec.name}: {what}={size} is not divisible by tp={tp} (Megatron-Core does not pad it)")
    if spec.num_layers % (pp * vpp):
        raise ValueError(f"{spec.name}: num_layers={spec.num_layers} is not divisible by pp*vpp={pp * vpp}")

    params_dtype = torch_dtype(dtype)
    recompute: dict[str, Any] = {}
    if activation_checkpointing == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif activation_checkpointing == "selective":
        recompute = {"recompute_granularity": "selective"}  # Megatron's default modules: core attention
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(spec.hf_config["rms_norm_eps"]),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.architecture == "Qwen2ForCausalLM",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(spec.hf_config.get("initializer_range", 0.02)),
        # The fused paths are CUDA kernels (or jit fusions of them); the unfused ones are the same maths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Megatron reads None as "no interleaving"; 1 would make it expect vp_stage arguments everywhere.
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        sequence_parallel=sp,
        # Batched p2p on a 2-rank pipeline posts both sends to the one peer (the interleaved steady state's
        # activation and gradient, equal shapes) in an order the peer does not receive them in: measured on
        # gloo, losses of micro-batches past the first group changed. Per-op p2p orders even and odd ranks.
        batch_p2p_comm=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=not cuda,
        # perform_initialization stays on although every weight is then loaded from the canonical state: Megatron's
        # init is also what marks the TP-split weights (tensor_model_parallel, partition_dim); off, the gradient
        # norm counted them as replicated and clipping diverged from the one-rank run at step 3 (measured, TP 2).
        **recompute,
    )


def _check_parallel_state(config: TransformerConfig) -> None:
    vpp = config.virtual_pipeline_model_parallel_size
    have = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size())
    want = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, vpp)
    if have != want:
        raise ValueError(f"parallel_state has (tp, pp, vpp)={have} but the config says {want}; call "
                         "initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, "
                         "virtual_pipeline_model_parallel_size=vpp or None) before build_chunks")


class SDPAttention(MegatronModule):
    """Megatron's core attention as one `scaled_dot_product_attention` call: the fused kernels (flash /
    memory-efficient on GPUs) keep no s × s scores for backward, where the local spec's DotProductAttention keeps
    an fp32 softmax and its 16-bit cast. A drop-in for the local spec's core_attention (same arguments, [sq, b, np,
    hn] in, [sq, b, np * hn] out); grouped-query attention without repeating K and V; no dropout (our models have
    none), no context parallelism, no packed sequences."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale  # None: 1 / sqrt(head_dim), SDPA's own default
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention does not apply query-key layer scaling")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("SDPAttention has no attention dropout (transformer_config sets none)")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no attention bias or packed sequences")
        sq, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and attention_mask is None
        # Megatron's masks are True where attention is forbidden; SDPA's boolean masks are True where it is allowed.
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                                             enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def layer_spec(attention: str):
    """The GPT layer: Megatron-Core's Transformer Engine spec for attention="te" (TE's fused attention, each RMSNorm
    fused into the linear layer after it); otherwise the local spec, its core attention `SDPAttention` for "sdpa"
    (Megatron-Core's DotProductAttention for "eager")."""
    if attention == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()  # RMSNorm from the config's `normalization`
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_chunks(spec: ModelSpec, config: TransformerConfig, *, seed: int, attention: str) -> list[GPTModel]:
    """This rank's GPTModel chunks: one, or one per virtual stage with vpp > 1 (the interleaved schedule
    takes the list). Needs parallel_state initialised at the config's tp/pp/vpp.

    As Megatron-LM's get_model: pre_process on the first virtual stage of the first pipeline rank only,
    post_process on the last of the last; RNG seeded as its _set_random_seed does (seed + 100 * pp rank;
    model_parallel_cuda_manual_seed for the TP streams of dropout and GPU init).
    """
    cpu_compat.apply(cuda=not config.use_cpu_initialization)  # the run's one device decision, as the config holds it
    _check_parallel_state(config)
    rope = _rope(spec)
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else (None,):
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(attention),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            vp_stage=vp_stage,
            **rope,
        )
        chunk.model_type = ModelType.encoder_or_decoder
        # Megatron's clip-grad and optimizer helpers read these on every parameter, replicated ones included.
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(chunk)
    return chunks


# --------------------------------------------------------------------------- where a chunk's tensors come from


@dataclass(frozen=True)
class Place:
    """Which shard a local state dict is: pipeline rank, virtual stage (0 without interleaving), TP rank."""

    pp_rank: int
    vp_stage: int
    tp_rank: int


def place_of(chunk: GPTModel) -> Place:
    """The Place of one of this rank's chunks (parallel_state must be initialised)."""
    return Place(parallel_state.get_pipeline_model_parallel_rank(), chunk.vp_stage or 0,
                 parallel_state.get_tensor_model_parallel_rank())


@dataclass(frozen=True)
class _Slot:
    """One Megatron tensor of a chunk, made of these HF tensors in the way `kind` names."""

    key: str
    kind: Literal["replicated", "rows", "cols", "qkv", "fc1"]
    hf: tuple[str, ...]


# Where each decoder layer's two RMSNorm weights live: their own modules in the local spec; in Transformer Engine's
# spec, inside the fused layer-norm + linear modules that follow them (TELayerNormColumnParallelLinear).
NORM_KEYS = {False: ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
             True: ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")}


def is_te_state(state: Mapping[str, Any]) -> bool:
    """Whether a chunk's state dict is of Transformer Engine's spec (its norms fused into the linear layers)."""
    return any(k.endswith(NORM_KEYS[True][0]) for k in state)


def _slots(spec: ModelSpec, first_layer: int, num_layers: int, pre: bool, post: bool, te: bool) -> list[_Slot]:
    norm1, norm2 = NORM_KEYS[te]
    slots = []
    if pre:
        slots.append(_Slot("embedding.word_embeddings.weight", "rows", ("model.embed_tokens.weight",)))
    for local in range(num_layers):
        m, h = f"decoder.layers.{local}.", f"model.layers.{first_layer + local}."
        attn = f"{h}self_attn."
        slots += [
            _Slot(m + norm1, "replicated", (h + "input_layernorm.weight",)),
            _Slot(m + "self_attention.linear_qkv.weight", "qkv",
                  (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")),
            _Slot(m + "self_attention.linear_proj.weight", "cols", (attn + "o_proj.weight",)),
            _Slot(m + norm2, "replicated", (h + "post_attention_layernorm.weight",)),
            _Slot(m + "mlp.linear_fc1.weight", "fc1", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")),
            _Slot(m + "mlp.linear_fc2.weight", "cols", (h + "mlp.down_proj.weight",)),
        ]
        if spec.attention_bias:
            slots.append(_Slot(m + "self_attention.linear_qkv.bias", "qkv",
                               (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")))
    if post:
        slots.append(_Slot("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)))
        if not spec.tie_word_embeddings:
            slots.append(_Slot("output_layer.weight", "rows", ("lm_head.weight",)))
        elif not pre:  # the tied copy the last stage keeps when the embedding lives on another stage
            slots.append(_Slot("output_layer.weight", "rows", ("model.embed_tokens.weight",)))
    return slots


def _ends(config: TransformerConfig, place: Place) -> tuple[bool, bool]:
    """(pre_process, post_process) of the chunk at `place`: the very first and very last virtual stage."""
    last_vp = (config.virtual_pipeline_model_parallel_size or 1) - 1
    return (place.pp_rank == 0 and place.vp_stage == 0,
            place.pp_rank == config.pipeline_model_parallel_size - 1 and place.vp_stage == last_vp)


def _place_slots(spec: ModelSpec, config: TransformerConfig, place: Place, te: bool) -> list[_Slot]:
    vp_stage = place.vp_stage if config.virtual_pipeline_model_parallel_size else None
    # Megatron's own helpers, as TransformerBlock uses them to number and count a chunk's layers.
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=place.pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=place.pp_rank)
    return _slots(spec, first, count, *_ends(config, place), te)


def _shard(slot: _Slot, full: list[Tensor], spec: ModelSpec, tp: int, rank: int) -> Tensor:
    if slot.kind == "replicated":
        return full[0]
    if slot.kind == "rows":
        return full[0].chunk(tp, dim=0)[rank]
    if slot.kind == "cols":
        return full[0].chunk(tp, dim=1)[rank]
    if slot.kind == "fc1":
        gate, up = full
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    q, k, v = full
    groups = spec.num_kv_heads
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                      dim=1).reshape(-1, *rest)
    return fused.chunk(tp, dim=0)[rank]


def _unshard(slot: _Slot, shards: list[Tensor], spec: ModelSpec) -> list[Tensor]:
    if slot.kind == "replicated":
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"{slot.key}: TP rank {rank} holds a different copy than TP rank 0; this "
                                 "replicated tensor's grads were not synchronised over TP")
        return [shards[0].clone()]  # every other kind builds a new tensor too: never alias a live parameter
    if slot.kind == "rows":
        return [torch.cat(shards, dim=0)]
    if slot.kind == "cols":
        return [torch.cat(shards, dim=1)]
    if slot.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)]
    fused = torch.cat(shards, dim=0)
    rest = fused.shape[1:]
    per_group = spec.num_heads // spec.num_kv_heads * spec.head_dim
    q, k, v = fused.reshape(spec.num_kv_heads, -1, *rest).split([per_group, spec.head_dim, spec.head_dim], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _tensor_entries(state: Mapping[str, Any]) -> dict[str, Tensor]:
    # Megatron's linear layers also list `_extra_state`: None with the local spec, and with Transformer Engine 2 an
    # empty byte tensor (TE's FP8 metadata, megatron.core's "TE 2.0 changed the format of extra_state"): not weights.
    return {k: v for k, v in state.items() if isinstance(v, Tensor) and not k.endswith("._extra_state")}


def _check_keys(produced: Mapping[str, Tensor], expected: Mapping[str, Tensor], what: str) -> None:
    for key in expected:
        if key not in produced:
            raise ValueError(f"{what}: {key!r} has no HF source in the mapping")
    for key, value in produced.items():
        if key not in expected:
            raise ValueError(f"{what}: the mapping makes {key!r}, which the chunk does not have")
        if value.shape != expected[key].shape:
            raise ValueError(f"{what}: {key!r} converts to shape {tuple(value.shape)}, "
                             f"the chunk has {tuple(expected[key].shape)}")


def hf_state_to_chunk(hf_state: Mapping[str, Tensor], spec: ModelSpec, chunk: GPTModel) -> dict[str, Tensor]:
    """The tensors of one local chunk (this rank's TP rank, pipeline rank and virtual stage) from a full HF
    state dict, keyed and shaped as chunk.state_dict(), in the chunk's dtypes. ValueError names any key
    that is missing, unexpected or mis-shaped, on either side."""
    hf_state = checked_hf_state(hf_state, spec)
    place = place_of(chunk)
    if (chunk.pre_process, chunk.post_process) != _ends(chunk.config, place):
        raise ValueError(f"chunk at {place} has pre_process={chunk.pre_process}, post_process={chunk.post_process}, "
                         "which its place in the pipeline contradicts; build it with build_chunks")
    tp = chunk.config.tensor_model_parallel_size
    produced = {s.key: _shard(s, [hf_state[k] for k in s.hf], spec, tp, place.tp_rank)
                for s in _place_slots(spec, chunk.config, place, is_te_state(chunk.state_dict()))}
    expected = _tensor_entries(chunk.state_dict())
    _check_keys(produced, expected, f"{spec.name} chunk {place}")
    return {k: v.to(expected[k].dtype).contiguous() for k, v in produced.items()}


def load_hf_state(chunks: list[GPTModel], hf_state: Mapping[str, Tensor], spec: ModelSpec) -> None:
    """Load a full HF state dict into this rank's chunks, strictly (see hf_state_to_chunk); every chunk is
    converted before any is loaded, so a ValueError leaves them all as they were."""
    states: list[dict[str, Any]] = [hf_state_to_chunk(hf_state, spec, chunk) for chunk in chunks]
    for chunk, state in zip(chunks, states, strict=True):
        state.update({k: v for k, v in chunk.state_dict().items() if not isinstance(v, Tensor)})
        chunk.load_state_dict(state, strict=True)


def load_hf_streamed(chunks: list[GPTModel], spec: ModelSpec, fetch: Callable[[str, tuple[int, ...]], Tensor]) -> None:
    """Load this rank's chunks from HF tensors that arrive one at a time: `fetch(name, shape)` is called for every
    tensor of `spec.parameters()`, in that order (megatron_backend: each rank makes them itself, one at a time), and
    each shard is cut as soon as its HF tensors are all there, which are then dropped. A rank so holds its own shards
    plus the full tensors of about one layer, never the whole model; the result equals load_hf_state's."""
    shapes = _hf_shapes(spec)
    waiting: list[tuple[int, _Slot]] = [(i, s) for i, c in enumerate(chunks)
                                        for s in _place_slots(spec, c.config, place_of(c), is_te_state(c.state_dict()))]
    wanted = {h for _, s in waiting for h in s.hf}
    # the chunks' own tensors (state_dict entries share their storage): each shard is copied in as it is cut
    targets = [_tensor_entries(c.state_dict()) for c in chunks]
    for i, s in waiting:
        if s.key not in targets[i]:
            raise ValueError(f"{spec.name} chunk {place_of(chunks[i])}: the mapping gives {s.key!r}, which it lacks")
    filled: list[set[str]] = [set() for _ in chunks]
    held: dict[str, Tensor] = {}
    for info in spec.parameters():
        tensor = fetch(info.name, shapes[info.name])
        if info.name not in wanted:
            continue
        held[info.name] = tensor
        for i, s in [(i, s) for i, s in waiting if all(h in held for h in s.hf)]:
            c, target = chunks[i], targets[i][s.key]
            shard = _shard(s, [held[h] for h in s.hf], spec, c.config.tensor_model_parallel_size, place_of(c).tp_rank)
            if tuple(shard.shape) != tuple(target.shape):
                raise ValueError(f"{spec.name} chunk {place_of(c)}: {s.key!r} is {tuple(shard.shape)} from the HF "
                                 f"state, {tuple(target.shape)} in the chunk")
            with torch.no_grad():
                target.copy_(shard)
            filled[i].add(s.key)
            waiting.remove((i, s))
        still = {h for _, s in waiting for h in s.hf}
        for name in [n for n in held if n not in still]:
            del held[name]
    for chunk, target, done in zip(chunks, targets, filled, strict=True):
        missing = sorted(set(target) - done)
        if missing:
            raise ValueError(f"{spec.name} chunk {place_of(chunk)}: nothing in the HF state gives {missing[0]!r}")


def gather_hf_state(local_states: Mapping[Place, Mapping[str, Any]], spec: ModelSpec, *,
                    tp: int, pp: int, vpp: int) -> dict[str, Tensor]:
    """The full HF state dict (keyed as `spec.parameters()`, like hf_reference_state) from the local
    state dicts of every (pipeline rank, virtual stage, TP rank), e.g. chunk.state_dict() of each chunk
    gathered from all ranks. Needs no process group. ValueError names a missing or unknown place or key,
    a replicated tensor whose TP copies differ, or a tied output_layer copy that drifted from the embedding.
    """
    config = transformer_config(spec, cuda=False, tp=tp, pp=pp, vpp=vpp, sp=False, activation_checkpointing="none",
                                dtype="fp32")  # only its parameter layout is read: where it would compute is moot
    places = [Place(p, v, t) for p in range(pp) for v in range(vpp) for t in range(tp)]
    unknown = sorted(set(local_states) - set(places), key=str)
    if unknown:
        raise ValueError(f"{spec.name}: no {unknown[0]} at tp={tp}, pp={pp}, vpp={vpp}")
    out: dict[str, Tensor] = {}
    for p in range(pp):
        for v in range(vpp):
            ranks = [Place(p, v, t) for t in range(tp)]
            missing = [r for r in ranks if r not in local_states]
            if missing:
                raise ValueError(f"{spec.name}: the local state of {missing[0]} is missing")
            states = [_tensor_entries(local_states[r]) for r in ranks]
            slots = _place_slots(spec, config, ranks[0], is_te_state(states[0]))
            for rank, state in zip(ranks, states, strict=True):
                unused = sorted(set(state) - {s.key for s in slots})
                if unused:
                    raise ValueError(f"{spec.name}: {rank} has {unused[0]!r}, which the mapping does not know")
            for slot in slots:
                for rank, state in zip(ranks, states, strict=True):
                    if slot.key not in state:
                        raise ValueError(f"{spec.name}: {rank} lacks {slot.key!r}")
                for name, tensor in zip(slot.hf, _unshard(slot, [s[slot.key] for s in states], spec), strict=True):
                    if name in out:
                        if not torch.equal(out[name], tensor):
                            raise ValueError(f"{spec.name}: {slot.key} at pipeline rank {p} differs from {name}; the "
                                             "tied embedding copies drifted apart (their grads were not all-reduced)")
                        continue
                    out[name] = tensor
    shapes = _hf_shapes(spec)
    for name, shape in shapes.items():
        if name not in out:
            raise ValueError(f"{spec.name}: no local state holds {name!r}")
        if tuple(out[name].shape) != shape:
            raise ValueError(f"{spec.name}: {name!r} gathers to shape {tuple(out[name].shape)}, expected {shape}")
    return {name: out[name] for name in shapes}
