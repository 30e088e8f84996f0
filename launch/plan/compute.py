"""The compute of one step on one rank, from the model's shapes on that rank: every GEMM at the fraction of dense peak
its shape allows, attention by the kernel the run uses, the memory-bound work (norms, RoPE, SwiGLU, residual adds,
the loss, the optimizer step) as bytes over the profile's memory bandwidth, as fused as the run makes it, and the
recomputation exactly as the memory model keeps activations. The nominal step time's compute (launch.plan.time);
a calibration replaces it with measured passes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from launch.config.backends import SELECTIVE_EVERY, traits
from launch.config.calibration import GemmPoint
from launch.errors import ConfigError
from launch.plan.adapters import (
    NF4_READ_BYTES,
    adapted,
    adapted_modules,
    casts_adapter_input,
    quantized,
    rank_split,
)
from launch.plan.layout import Layout
from launch.plan.memory import OP_POLICY_RECOMPUTED, chunk_layers, rank_parameters

# Bytes one token moves through the memory-bound work of a decoder layer's forward, per element of the tensor each
# op reads: (RMSNorm per hidden element, residual add per hidden element, RoPE per query/key element, SwiGLU per
# intermediate element, the attention output's copy back to (tokens, hidden), the grouped K/V repeated for the
# kernel, cross-entropy per logit), by fusion level, for 2-byte activations. Counted from the kernels each runs:
# eager Hugging Face / torchtitan RMSNorm upcasts to fp32 and runs six kernels (36 B an element), rotate_half RoPE
# five (26 B), silu then mul (10 B), an fp32 log_softmax with its backward (36 B a logit); torch.compile and
# Megatron's fused kernels (Transformer Engine, Apex) read and write each tensor once (norm 4 B, RoPE 4 B, SwiGLU
# 6 B, cross-entropy 12 B: its fp32 softmax kept in registers, the logits read and their gradient written).
@dataclass(frozen=True)
class Elementwise:
    norm: float
    residual: float
    rope: float
    swiglu: float
    attention_out: float
    repeat_kv: float
    loss: float


ELEMENTWISE = {
    "eager": Elementwise(norm=36, residual=6, rope=26, swiglu=10, attention_out=4, repeat_kv=4, loss=36),
    "compiled": Elementwise(norm=4, residual=6, rope=4, swiglu=6, attention_out=4, repeat_kv=4, loss=12),
    "fused": Elementwise(norm=4, residual=6, rope=4, swiglu=6, attention_out=0, repeat_kv=0, loss=12),
}
# A backward reads what its forward saved and writes the gradients: twice the forward's bytes.
BACKWARD_BYTES = 2.0
# Flash-style kernels compute the causal half of the scores; their backward does 2.5× the forward's matmul work
# (it recomputes the scores: five matmuls against two).
CAUSAL_SHARE = 0.5
FLASH_BACKWARD_WORK = 2.5
# Eager attention materialises the scores: bytes per score element, forward (write, scale and mask, fp32 softmax)
# and backward (the softmax gradient read and written), at 2-byte activations.
EAGER_SCORE_BYTES = (12, 16)
# The optimizer step's bytes per parameter of the rank's partition: Adam reads parameter, gradient and both moments
# and writes three of them (28 B in fp32); torch's foreach AdamW (the torch backend) makes a second pass through its
# temporaries, DeepSpeed's and Megatron's fused Adam one, plus the 16-bit copy of the parameters they write.
OPTIMIZER_BYTES = {"torch": 56, "fused": 30}
# Copies sharded data parallelism adds per parameter of the rank's model shard, in 2-byte elements' bytes: each
# all-gather writes the gathered parameters out of the flat buffer (FSDP2's copy-out, DeepSpeed's partitioned
# parameters: read and write, 4 B): at ZeRO-3 in the forward and again in the backward of every micro-batch, FSDP2's
# ZeRO-2 (no reshard after the forward) once a micro-batch; the gradients are cast to fp32 and packed for each
# reduction (6 + 8 B): every micro-batch from ZeRO-2 up, once a step at ZeRO-1.
GATHER_COPY_BYTES = 4
REDUCE_COPY_BYTES = 14
# peft's LoRA output, `result + lora_B(lora_A(dropout(x))) * scaling`, in eager kernels, per element of the adapted
# linear's output at 2-byte activations: the scaling reads and writes the adapter's output (4 B), the add reads two
# tensors and writes one (6 B). Per element of its input: with peft.dropout > 0 the dropout reads it and writes the
# output and a 1-byte mask (5 B); where the input is cast to the fp32 adapters' dtype and back by autocast
# (launch.plan.adapters.casts_adapter_input), 2 + 4, then 4 + 2 B (12 B).
LORA_OUTPUT_BYTES = 10
LORA_DROPOUT_BYTES = 5
LORA_CAST_BYTES = 12
# Their backward moves about what the forward moved (the add passes its gradient through; the scaling, the casts and
# the dropout run once on the gradient), where the base layer's reads its saved tensors too (BACKWARD_BYTES).
LORA_BACKWARD_BYTES = 1.0
# Megatron-Core's fused linear layers, by the Hugging Face modules they hold: under [peft] a fused layer takes one
# adapter where any of its parts is a target (Megatron-Bridge's LoRA adapts linear_qkv, linear_proj, linear_fc1,
# linear_fc2 as wholes).
MEGATRON_FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


@dataclass(frozen=True)
class Compute:
    """One step's compute on the slowest pipeline stage's rank, by kind (seconds; recomputation included in each)."""

    gemm_s: float
    attention_s: float
    memory_s: float  # norms, RoPE, SwiGLU, residual adds, the loss: memory-bound
    optimizer_s: float  # the optimizer step and the copies sharded data parallelism makes around its collectives
    recompute_s: float  # of the above, what activation checkpointing adds
    gemm_peak_share: float  # the GEMMs' FLOPs over their time, as a share of the dtype's dense peak
    stage: int  # the pipeline stage that sets the pace
    per_micro_batch_s: tuple[float, ...]  # each stage's forward + backward of one micro-batch

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s + self.optimizer_s


def fusion(layout: Layout) -> str:
    """How fused the run's memory-bound work is: Transformer Engine's kernels (Megatron's te spec), a compiled torch or
    DeepSpeed module, or eager (Megatron's local spec too: without Apex it runs torch's norm and an unfused RoPE)."""
    if layout.attention == "te":
        return "fused"
    return "compiled" if layout.compile else "eager"


def gemm_shape_factor(m: float, n: float, k: float, half_dim: float) -> float:
    """The compute model's efficiency curve: each dimension near or below `half_dim` leaves the GEMM further from the
    best rate (tiles half filled, too few waves)."""
    return (m / (m + half_dim)) * (n / (n + half_dim)) * (k / (k + half_dim))


# The half dimensions fit_gemm tries: log-spaced from 1 to 4096 (a GPU's is in the hundreds, a CPU core's tens).
HALF_DIMS = tuple(2 ** (i / 8) for i in range(8 * 12 + 1))


def fit_gemm(points: Sequence[GemmPoint]) -> tuple[float, float]:
    """(best rate in FLOP/s, half dimension) of the efficiency curve closest to the points in log space (every
    GEMM's relative error weighs the same): for each half dimension tried, the best rate is the geometric mean of
    rate / shape factor; the half dimension with the smallest squared log error wins."""
    pts = [p for p in points if p.seconds > 0 and math.isfinite(p.seconds)]
    if not pts:
        raise ValueError("no positive GEMM timings to fit")
    best: tuple[float, float, float] | None = None
    for h in HALF_DIMS:
        logs = [math.log(p.flops / p.seconds / gemm_shape_factor(p.m, p.n, p.k, h)) for p in pts]
        mean = sum(logs) / len(logs)
        err = sum((x - mean) ** 2 for x in logs)
        if best is None or err < best[0] - 1e-12:
            best = (err, math.exp(mean), h)
    return best[1], best[2]


@dataclass(frozen=True)
class _Rates:
    """The profile's figures the model reads, for the layout's dtype."""

    peak: float  # FLOP/s
    gemm: float
    gemm_half_dim: float
    bandwidth: float  # bytes/s streaming kernels reach
    attention: tuple[float, float]  # forward, backward share of peak (the fused kernel in use)


def _rates(layout: Layout) -> _Rates:
    hw = layout.hardware
    eff = hw.efficiency
    kernel = eff.attention.get(layout.attention)
    if kernel is None and layout.attention != "eager":
        # the resolver refuses it first (launch/config/resolve.py); a Layout built by hand meets this
        raise ConfigError(f"hardware profile {hw.name}", f"efficiency.attention.{layout.attention}", "(missing)",
                          "is needed to time this attention kernel", "use attention=sdpa, or add the kernel's shares")
    return _Rates(hw.peak_flops(layout.dtype), eff.gemm, eff.gemm_half_dim, hw.hbm_GBps * 1e9 * eff.memory,
                  (kernel.forward, kernel.backward) if kernel else (0.0, 0.0))


def gemm_s(m: int, n: int, k: int, rates: _Rates, elem: int) -> float:
    """One (m × k) · (k × n) GEMM: its FLOPs at the profile's best GEMM efficiency, less for each dimension near or
    below the half dimension (a thin or small matrix leaves tensor cores idle: tiles half filled, too few waves),
    unless moving its three matrices takes longer."""
    flops_s = 2.0 * m * n * k / (rates.peak * rates.gemm * gemm_shape_factor(m, n, k, rates.gemm_half_dim))
    bytes_s = (m * k + k * n + m * n) * elem / rates.bandwidth
    return max(flops_s, bytes_s)


def flash_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs a fused causal attention kernel does: the causal half of the scores and of their
    product with V; the backward 2.5× the forward. The count its efficiency is a share of (calibrate's too)."""
    forward = 4.0 * batch * seq * seq * heads * head_dim * CAUSAL_SHARE
    return forward, FLASH_BACKWARD_WORK * forward


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's work on one rank for one micro-batch, forward (a backward: twice a trained GEMM, the input
    gradient and the weight gradient; once a frozen one's, the input gradient alone)."""

    gemms: Mapping[str, tuple[float, float]]  # by module name (an adapter's: "<module>.lora_A"): (seconds, FLOPs) forward
    attention_fwd_s: float
    attention_bwd_s: float
    memory_s: float
    frozen: frozenset[str] = frozenset()  # modules whose weight does not train ([peft]: every base linear)
    # QLoRA: each NF4 linear's dequantization to the compute dtype, once per forward (again in the backward), by module
    dequant_s: Mapping[str, float] = field(default_factory=dict)
    adapter_memory_s: float = 0.0  # the adapters' memory-bound forward work (LORA_*_BYTES)

    @property
    def gemm_s(self) -> float:
        return sum(sec for sec, _ in self.gemms.values())

    @property
    def gemm_flops(self) -> float:
        return sum(fl for _, fl in self.gemms.values())

    def backward_gemms(self) -> tuple[float, float]:
        """(seconds, FLOPs) of the backward's GEMMs."""
        share = {name: 1 if name in self.frozen else 2 for name in self.gemms}
        return (sum(sec * share[n] for n, (sec, _) in self.gemms.items()),
                sum(fl * share[n] for n, (_, fl) in self.gemms.items()))


def _layer(layout: Layout, rates: _Rates) -> _Layer:
    m, t, b, s = layout.model, layout.grid.tp, layout.micro_batch_size, layout.seq_len
    e = layout.elem_bytes
    tokens = b * s
    h, f, d = m.hidden_size, m.intermediate_size // t, m.head_dim
    q, kv = m.num_heads * d // t, m.num_kv_heads * d // t
    # Megatron fuses Q, K, V into one GEMM and gate with up into another; Hugging Face and torchtitan modules run each,
    # in this order (the op policy's count: launch.plan.memory.OP_POLICY_RECOMPUTED).
    shapes = ({"linear_qkv": (tokens, q + 2 * kv, h), "linear_proj": (tokens, h, q), "linear_fc1": (tokens, 2 * f, h),
               "linear_fc2": (tokens, h, f)} if layout.backend == "megatron"
              else {"q_proj": (tokens, q, h), "k_proj": (tokens, kv, h), "v_proj": (tokens, kv, h),
                    "o_proj": (tokens, h, q), "gate_proj": (tokens, f, h), "up_proj": (tokens, f, h),
                    "down_proj": (tokens, h, f)})
    gemms = {name: (gemm_s(*shape, rates, e), 2.0 * shape[0] * shape[1] * shape[2]) for name, shape in shapes.items()}
    lora = _adapter_gemms(layout, shapes, rates)
    heads = m.num_heads // t
    if layout.attention == "eager":
        scores = b * heads * s * s
        matmuls = 2 * heads * b * gemm_s(s, s, d, rates, e)
        attn_fwd = matmuls + scores * EAGER_SCORE_BYTES[0] * e / 2 / rates.bandwidth
        attn_bwd = 2 * matmuls + scores * EAGER_SCORE_BYTES[1] * e / 2 / rates.bandwidth
    else:
        forward, backward = flash_attention_flops(b, heads, s, d)
        attn_fwd = forward / (rates.peak * rates.attention[0])
        attn_bwd = backward / (rates.peak * rates.attention[1])
    ew = ELEMENTWISE[fusion(layout)]
    # With sequence parallelism the norms and residual adds run on the rank's share of the sequence.
    h_local = h / t if layout.sp else h
    per_token = (2 * ew.norm * h_local + 2 * ew.residual * h_local + ew.rope * (q + kv) + ew.swiglu * f
                 + ew.attention_out * q + (ew.repeat_kv * 2 * q if kv < q else 0)) * e / 2
    adapted_shapes = [shapes[name.rsplit(".", 1)[0]] for name in lora if name.endswith(".lora_B")]
    per_input = ((LORA_DROPOUT_BYTES if layout.peft.dropout > 0 else 0)
                 + (LORA_CAST_BYTES if casts_adapter_input(layout) else 0))
    lora_per_token = sum(LORA_OUTPUT_BYTES * n + per_input * k for _, n, k in adapted_shapes) * e / 2
    # QLoRA: bitsandbytes dequantizes each NF4 weight to the compute dtype before its matmul (reads the codes and
    # statistics, writes the weight), memory-bound.
    dequant = ({name: n * k * (NF4_READ_BYTES + e) / rates.bandwidth for name, (_, n, k) in shapes.items()}
               if quantized(layout) else {})
    return _Layer({**gemms, **lora}, attn_fwd, attn_bwd, tokens * per_token / rates.bandwidth,
                  frozenset(shapes) if adapted(layout) else frozenset(), dequant,
                  tokens * lora_per_token / rates.bandwidth)


def _adapter_gemms(layout: Layout, shapes: Mapping[str, tuple[int, int, int]], rates: _Rates
                   ) -> dict[str, tuple[float, float]]:
    """The adapters' two thin GEMMs per adapted linear (tokens × in by in × rank, then tokens × rank by rank × out),
    by "<module>.lora_A" / ".lora_B", (seconds, FLOPs) of the forward; none without [peft]. Under TP the adapted
    linear's shard is taken (the trainers refuse TP with [peft]: this plans published layouts only)."""
    targets = adapted_modules(layout)
    r, e = layout.peft.rank, layout.elem_bytes
    out = {}
    for name, (tokens, n, k) in shapes.items():
        if name in targets or any(part in targets for part in MEGATRON_FUSED.get(name, ())):
            for part, shape in (("lora_A", (tokens, r, k)), ("lora_B", (tokens, n, r))):
                out[f"{name}.{part}"] = (gemm_s(*shape, rates, e), 2.0 * shape[0] * shape[1] * shape[2])
    return out


@dataclass(frozen=True)
class _Work:
    """Seconds by kind, and the GEMMs' FLOPs."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    gemm_flops: float = 0.0

    def __add__(self, o: "_Work") -> "_Work":
        return _Work(self.gemm_s + o.gemm_s, self.attention_s + o.attention_s, self.memory_s + o.memory_s,
                     self.gemm_flops + o.gemm_flops)

    def __mul__(self, k: float) -> "_Work":
        return _Work(self.gemm_s * k, self.attention_s * k, self.memory_s * k, self.gemm_flops * k)

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s


def _trained(layer: _Layer) -> _Work:
    """Forward and backward of one layer (QLoRA dequantizes every weight in each)."""
    back_s, back_flops = layer.backward_gemms()
    return _Work(layer.gemm_s + back_s, layer.attention_fwd_s + layer.attention_bwd_s,
                 (1 + BACKWARD_BYTES) * layer.memory_s + (1 + LORA_BACKWARD_BYTES) * layer.adapter_memory_s
                 + 2 * sum(layer.dequant_s.values()), layer.gemm_flops + back_flops)


def _recomputed(layout: Layout, layer: _Layer) -> _Work:
    """What activation checkpointing adds per decoder layer, as launch.plan.memory keeps their activations: "full"
    recomputes the layer's forward (on the torch backend, torch's non-reentrant checkpoint stops before the block's
    last matmul, whose output nothing saves); "selective" recomputes Megatron's core attention, or on the torch
    backend (torchtitan's op policy) the matmuls it does not keep and every memory-bound op, not attention;
    "every_other_block" recomputes every SELECTIVE_EVERY-th block as "full" does (a share of the layers)."""
    ac = layout.activation_checkpointing
    if ac == "none":
        return _Work()
    policy = traits(layout.backend).selective
    if ac == "selective" and policy == "core_attention":
        return _Work(attention_s=layer.attention_fwd_s)
    # QLoRA dequantizes a recomputed linear's weight again. Under [peft] "full" recomputes every adapter GEMM; the op
    # policy, which keeps every other matmul's output in the order they run, adapters' included, is approximated by the
    # base matmuls it names without [peft] (not rehearsed with adapters).
    if ac == "selective" and policy == "op":
        again = [layer.gemms[name] for name in OP_POLICY_RECOMPUTED]
        dequant = sum(layer.dequant_s.get(name, 0.0) for name in OP_POLICY_RECOMPUTED)
        return _Work(sum(sec for sec, _ in again), 0.0, layer.memory_s + dequant, sum(fl for _, fl in again))
    last = layer.gemms["down_proj"] if traits(layout.backend).accounting == "torch" else (0.0, 0.0)
    share = 1.0 / SELECTIVE_EVERY if ac == "every_other_block" else 1.0
    dequant = sum(layer.dequant_s.values()) - (layer.dequant_s.get("down_proj", 0.0) if last[1] else 0.0)
    return _Work(layer.gemm_s - last[0], layer.attention_fwd_s, layer.memory_s + layer.adapter_memory_s + dequant,
                 layer.gemm_flops - last[1]) * share


def _head(layout: Layout, rates: _Rates) -> _Work:
    """The output layer and the loss for one micro-batch, forward and backward (TP splits the vocabulary on every
    backend: launch.plan.memory counts the output layer so)."""
    m = layout.model
    tokens = layout.micro_batch_size * layout.seq_len
    vocab = m.vocab_size // layout.grid.tp
    loss = tokens * vocab * ELEMENTWISE[fusion(layout)].loss * layout.elem_bytes / 2 / rates.bandwidth
    passes = 2 if adapted(layout) else 3  # a frozen output layer (under [peft]) makes no weight gradient
    return _Work(passes * gemm_s(tokens, vocab, m.hidden_size, rates, layout.elem_bytes), 0.0, loss,
                 2.0 * passes * tokens * vocab * m.hidden_size)


def optimizer_partition(layout: Layout) -> int:
    """Parameters the largest pipeline stage's rank steps: what trains of its shard (the adapters under [peft]), whole
    without ZeRO, else 1/dp of it."""
    part = max(rank_split(layout, sum(rank_parameters(layout, s))).trainable for s in range(layout.grid.pp))
    return part if layout.zero_stage == 0 else -(-part // layout.grid.dp)


def compute(layout: Layout) -> Compute:
    rates = _rates(layout)
    g = layout.grid
    ga = max(1, layout.grad_accum)
    layer = _layer(layout, rates)
    head = _head(layout, rates)
    stages, recomputed = [], []
    for s in range(g.pp):
        n = sum(map(len, chunk_layers(layout.model.num_layers, g.pp, layout.vpp, s)))
        re = _recomputed(layout, layer) * n
        recomputed.append(re)
        stages.append(_trained(layer) * n + re + (head if s == g.pp - 1 else _Work()))
    slowest = max(range(g.pp), key=lambda s: stages[s].total_s)
    w = stages[slowest]
    kind = "torch" if traits(layout.backend).accounting == "torch" else "fused"
    # An offloaded optimizer steps on the host: launch.plan.time's offload term times it.
    optimizer = (optimizer_partition(layout) * OPTIMIZER_BYTES[kind] / rates.bandwidth
                 if layout.offload_optimizer == "none" else 0.0)
    # The gathers copy whole units (under [peft] the base and its adapters), the reductions the gradients (adapters').
    split = rank_split(layout, max(sum(rank_parameters(layout, s)) for s in range(g.pp)))
    if g.dp > 1 and layout.zero_stage > 0:
        gathers = {3: 2 * ga, 2: ga if kind == "torch" else 0}.get(layout.zero_stage, 0)
        reductions = ga if layout.zero_stage >= 2 else 1
        optimizer += ((split.frozen + split.trainable) * gathers * GATHER_COPY_BYTES
                      + split.trainable * reductions * REDUCE_COPY_BYTES) / rates.bandwidth
    return Compute(gemm_s=ga * w.gemm_s, attention_s=ga * w.attention_s, memory_s=ga * w.memory_s,
                   optimizer_s=optimizer, recompute_s=ga * recomputed[slowest].total_s,
                   gemm_peak_share=w.gemm_flops / w.gemm_s / rates.peak if w.gemm_s else 0.0,
                   stage=slowest, per_micro_batch_s=tuple(st.total_s for st in stages))
