"""Per-rank memory, communication per step, FLOPs and a predicted step time. No torch import.

Accountings of model-state memory (all three are computed; the fit check uses the backend's own):
  * "zero_paper"  — Rajbhandari et al. 2020, Table 1: 16-bit weights 2 B + 16-bit grads 2 B + K = 12 B
                    (fp32 master, Adam m, Adam v) per parameter; fp32 training: 4 + 4 + 8.
  * "deepspeed"   — DeepSpeed 0.19.8's implementation, matching its own estimators
                    (estimate_zero2/zero3_model_states_mem_needs): ZeRO-2 keeps full 16-bit weights plus
                    a partition of 16-bit and fp32 grads, fp32 master, m and v (2 + 18/N B); ZeRO-1 keeps the
                    16-bit grads whole; ZeRO-3 keeps 18/N B plus the largest layer gathered (4 B × its
                    params); ZeRO-0 keeps fp32 master and fp32 grads beside the 16-bit copies (20 B).
  * "megatron"    — for reference (both backends train through DeepSpeed's ZeRO, so their fit check uses
                    "deepspeed"): Megatron-Core 0.16.1: bf16 weights 2 B, fp32 main grads 4 B (bf16 training accumulates
                    gradients in fp32), optimizer 12 B; with the distributed optimizer (zero_stage >= 1) the
                    12 B are split over the data-parallel group (6 + 12/d, as its docs state).

Activations are derived per layer from the architecture (see `activation_terms`): the Llama family
(SwiGLU, GQA, RMSNorm, no dropout, fused attention that keeps no s×s scores) or the GPT layer of
Korthikanti et al. 2022, whose published totals the tests reproduce.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from statistics import NormalDist
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from launch import calibration as cal
from launch import nccl_format
from launch.backends import traits
from launch.commbench_spec import backend_of
from launch.grid import RankGrid
from launch.hardware import HardwareProfile
from launch.models import ModelSpec

PLAN_SCHEMA_VERSION = 1
GiB = 1024**3
ACCOUNTINGS = ("zero_paper", "deepspeed", "megatron")
# A fixed runtime allowance (CUDA context, NCCL channels, cuBLAS workspace) plus allocator
# fragmentation as a fraction of everything else; both are stated in plan.json.
RUNTIME_ALLOWANCE_GPU = 1 * GiB
RUNTIME_ALLOWANCE_CPU = GiB // 2
FRAGMENTATION = 0.05
# DeepSpeed's estimators multiply every host figure by additional_buffer_factor=1.5 (pinned staging buffers and
# allocator slack); the host check uses the same factor so that it equals their CPU column.
HOST_BUFFER_FACTOR = 1.5
PCIE_GBps = 25.0  # host<->device copies for offloaded optimizer state (PCIe 4 x16, effective)
HOST_ADAM_GBps = 20.0  # CPU Adam streams ~16 B/param in and out; effective host memory bandwidth
# Whether a process group's collectives run beside compute: NCCL's kernels run on their own streams, while gloo
# runs each call on the calling CPU thread, so on CPU ranks nothing overlaps and a step is the sum of its parts.
OVERLAPS = {"nccl": True, "gloo": False}
# DeepSpeed ZeRO-3 defaults (stage3 config) that decide how many gathers a step makes.
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO_BUCKET_DEFAULT = 500_000_000  # reduce_bucket_size / allgather_bucket_size defaults (elements)
ZERO0_BUCKET_ELEMENTS = 500_000_000  # engine.allreduce_gradients' fixed bucket without ZeRO


@dataclass(frozen=True)
class Layout:
    """Everything the planner needs; built from a Resolved recipe or directly by the `plan` command."""

    backend: str
    model: ModelSpec
    hardware: HardwareProfile
    grid: RankGrid
    zero_stage: int
    dtype: str
    micro_batch_size: int
    global_batch_size: int
    seq_len: int
    recompute: str = "none"  # none | selective | full
    sp: bool = False
    vpp: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    ds_zero: Mapping[str, Any] = field(default_factory=dict)  # the composed zero_optimization section
    headroom: float = 0.10

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.grid.dp)

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def hpz(self) -> int:
        """ZeRO++ hpZ's secondary partition group size (1: off); ZeRO-3 only, as DeepSpeed applies it."""
        return _int_or(self.ds_zero.get("zero_hpz_partition_size"), 1, low=1) if self.zero_stage == 3 else 1

    @classmethod
    def from_resolved(cls, r) -> "Layout":
        rc = r.recipe
        return cls(
            backend=rc.backend, model=r.model, hardware=r.hardware, grid=r.grid,
            zero_stage=rc.parallel.zero_stage, dtype=rc.precision.dtype,
            micro_batch_size=rc.batch.micro_batch_size, global_batch_size=rc.batch.global_batch_size,
            seq_len=rc.batch.seq_len, recompute=rc.train.activation_checkpointing, sp=rc.parallel.sp,
            vpp=rc.parallel.vpp, offload_optimizer=rc.parallel.offload_optimizer,
            offload_params=rc.parallel.offload_params,
            ds_zero=dict(r.ds_config.get("zero_optimization", {})), headroom=rc.plan.headroom,
        )


@dataclass(frozen=True)
class Memory:
    """Bytes per rank. `device_*` live in device memory; `host_bytes` were offloaded."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    allowance: int
    host_bytes: int

    @property
    def model_states(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.allowance


@dataclass(frozen=True)
class RankPlan:
    kind: str  # e.g. "all ranks", "pp stage 0 (first)"
    ranks: tuple[int, ...]
    pp_stage: int
    layers: int
    params: int  # parameters this rank holds before ZeRO partitioning (its TP/PP shard)
    micro_batches_in_flight: float
    memory: Mapping[str, Memory]  # by accounting
    implementation: str  # the accounting the fit check uses
    device_memory_bytes: int
    usable_bytes: int  # device memory minus headroom

    @property
    def fits(self) -> bool:
        return self.memory[self.implementation].total <= self.usable_bytes


@dataclass(frozen=True)
class Comm:
    parallelism: str  # dp | tp | sp | pp
    collective: str  # all_reduce | all_gather | reduce_scatter | send_recv | broadcast
    link: str  # intra_node | inter_node
    group_size: int
    calls_per_step: int
    message_bytes: int  # per call, the S of nccl-tests
    bytes_per_rank: int  # sent per rank per step = calls × S × bus factor
    busbw_GBps: float  # the link speed assumed (calibrated: the fitted bandwidth × the bus factor)
    time_s: float
    note: str = ""
    after_step: bool = False  # runs after the optimizer step: nothing left to overlap it with
    latency_us: float = 0.0  # per call assumed (calibrated: the fitted α)


@dataclass(frozen=True)
class StepTime:
    model_flops_per_step: float  # 6 N + attention, torchtitan's count
    hardware_flops_per_step: float  # + recomputation
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float  # on the critical path: a send and a receive posted together wait once (pipeline_exchanges)
    dp_comm_s: float
    dp_exposed_s: float
    offload_s: float
    total_s: float
    tokens_per_s_per_device: float
    mfu: float
    assumptions: str
    timing: str = "nominal"  # "calibrated": compute and collectives from a calibration file; else "nominal"
    correction: float = 1.0  # the calibration's measured/predicted ratio from verified runs, already in total_s


@dataclass(frozen=True)
class Plan:
    recipe_name: str
    backend: str
    hardware: str
    grid: Mapping[str, int]
    ranks: tuple[RankPlan, ...]
    comm: tuple[Comm, ...]
    step: StepTime
    notes: tuple[str, ...]
    host_bytes_per_node: int = 0  # offloaded state of every rank on the busiest node
    host_usable_bytes: int = 0  # the node's host memory minus headroom
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.host_usable_bytes

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks) and self.host_fits

    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.memory[r.implementation].total)

    def to_json(self) -> str:
        d = asdict(self)
        for rp, src in zip(d["ranks"], self.ranks):
            rp["fits"] = src.fits
            for acc, mem in rp["memory"].items():
                mem["model_states"] = src.memory[acc].model_states
                mem["total"] = src.memory[acc].total
        d["fits"] = self.fits
        d["host_fits"] = self.host_fits
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        mem_fields = set(Memory.__dataclass_fields__)
        ranks = tuple(
            RankPlan(**{**{k: v for k, v in rp.items() if k in RankPlan.__dataclass_fields__},
                        "ranks": tuple(rp["ranks"]),
                        "memory": {a: Memory(**{k: v for k, v in m.items() if k in mem_fields})
                                   for a, m in rp["memory"].items()}})
            for rp in d["ranks"])
        return cls(recipe_name=d["recipe_name"], backend=d["backend"], hardware=d["hardware"], grid=d["grid"],
                   ranks=ranks, comm=tuple(Comm(**c) for c in d["comm"]), step=StepTime(**d["step"]),
                   notes=tuple(d["notes"]), host_bytes_per_node=d.get("host_bytes_per_node", 0),
                   host_usable_bytes=d.get("host_usable_bytes", 0), schema_version=d["schema_version"])


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


def largest_layer_params(layout: Layout) -> int:
    """Largest single module's parameters on one rank, as DeepSpeed's ZeRO-3 estimator means it (the embedding
    here); a backend whose TP splits the embedding (and every Linear) holds 1/tp of it."""
    big = layout.model.param_counts().largest_layer
    return big // layout.grid.tp if traits(layout.backend).vocab_parallel else big


# --------------------------------------------------------------------------- model states


def model_states(layout: Layout, params: int, accounting: str) -> tuple[int, int, int, int]:
    """(weights, grads, optimizer, host) bytes on one rank holding `params` parameters before ZeRO."""
    z, d, e = layout.zero_stage, layout.grid.dp, layout.elem_bytes
    mixed = layout.dtype != "fp32"
    off_opt = layout.offload_optimizer != "none"
    off_par = layout.offload_params != "none"
    host = 0
    if accounting == "zero_paper":
        k = 12 if mixed else 8
        w, g, o = e * params, e * params, k * params
        if z >= 1:
            o = math.ceil(o / d)
        if z >= 2:
            g = math.ceil(g / d)
        if z >= 3:
            w = math.ceil(w / d)
    elif accounting == "deepspeed":
        # DeepSpeed 0.19.8 (stage_1_and_2.py / stage3.py estimators): fp32 master 4 + Adam m, v 8 = 12 B
        # per parameter of the partition, plus an fp32 gradient partition of 4 B; ZeRO-2 also keeps its
        # 16-bit gradient partition (2 + 18/N in all); ZeRO-3 keeps 16-bit parameter partitions and the
        # largest layer gathered as 16-bit weights and gradients (4 B × its params).
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
        if off_opt:
            # The optimizer step, its fp32 state and the fp32 gradient partition move to the host. ZeRO-1/2 then
            # copy gradients from the reduce bucket straight into that fp32 partition, keeping no 16-bit one
            # (the estimators: 2 B/param on the device, 16 on the host); ZeRO-3 keeps the largest layer's.
            moved_g = g - (2 * largest_layer_params(layout) if z == 3 else 0)
            host += o + (4 * params // d if z < 3 else moved_g)
            o, g = 0, g - moved_g
        if off_par and z == 3:
            host += e * params // d
            w -= e * params // d
    elif accounting == "megatron":
        # Megatron-Core's distributed-optimizer table: bf16 params + fp32 main grads 6 + 12/d; fp16 params and
        # grads (fp32 main grads live in the optimizer) 4 + 16/d; fp32 8 + 8/d.
        grad_bytes, opt_bytes = {"bf16": (4, 12), "fp16": (2, 16), "fp32": (4, 8)}[layout.dtype]
        w, g = e * params, grad_bytes * params
        opt = opt_bytes * params
        o = math.ceil(opt / d) if z >= 1 else opt
        if z >= 3:
            w, g = math.ceil(w / d), math.ceil(g / d)
    else:
        raise ValueError(f"unknown accounting {accounting}")
    if accounting == "zero_paper" and off_opt:
        host, o = o, 0
    return w, g, o, host


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActTerm:
    name: str
    bytes: float  # for one micro-batch, one layer, no parallelism
    region: str  # "tp": split over t; "replicated": split over t only with SP
    scores: bool = False  # s×s attention terms, dropped by selective recompute


def activation_terms(arch: str, s: int, b: int, h: int, a: int, *, ffn: int = 0, kv_heads: int = 0,
                     head_dim: int = 0, e: int = 2, hf_norm: bool = False, eager_attention: bool = False) -> list[ActTerm]:
    """Bytes saved for backward by one transformer layer.

    "gpt": Korthikanti et al. 2022, §4.1 (16-bit activations, 1-byte dropout masks, 4h MLP):
           sbh(34 + 5as/h) without parallelism.
    "llama": RMSNorm (saves its input), q/k/v after RoPE, fused attention (output + fp32 log-sum-exp,
           no s×s scores), SwiGLU saving gate, up, silu(gate) and their product; no dropout.
           hf_norm: Hugging Face's RMSNorm instead of a fused one: it saves an fp32 copy of its input and the
           normalized tensor. eager_attention: the s×s softmax is materialised (fp32, plus its cast to the
           model dtype), as Hugging Face's eager attention on CPU ranks does.
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
        terms = [
            ActTerm("norm1_input", norm_in, "replicated"), ActTerm("qkv_input", e * sbh, "replicated"),
            ActTerm("q_rope", e * s * b * a * head_dim, "tp"), ActTerm("k_rope_v", 2 * e * kv, "tp"),
            ActTerm("attn_out", e * s * b * a * head_dim, "tp"), ActTerm("attn_lse", 4 * b * a * s, "tp"),
            ActTerm("norm2_input", norm_in, "replicated"), ActTerm("mlp_input", e * sbh, "replicated"),
            ActTerm("gate_out", e * sbf, "tp"), ActTerm("up_out", e * sbf, "tp"),
            ActTerm("silu_out", e * sbf, "tp"), ActTerm("down_input", e * sbf, "tp"),
        ]
        if hf_norm and e != 4:
            terms += [ActTerm("norm1_normalized", e * sbh, "replicated"), ActTerm("norm2_normalized", e * sbh, "replicated")]
        if eager_attention:
            probs = (4 + (e if e != 4 else 0)) * a * s * s * b
            terms.append(ActTerm("attn_probs", probs, "tp", scores=True))
        return terms
    raise ValueError(f"unknown layer arch {arch!r}")


def layer_activation_bytes(terms: list[ActTerm], *, t: int = 1, sp: bool = False, recompute: str = "none",
                           layer_input_bytes: float | None = None) -> float:
    """Bytes one layer keeps for one micro-batch under TP degree t, SP and a recompute policy."""
    if recompute == "full":
        # Only the layer input survives the forward pass; it is sharded along the sequence with SP.
        x = layer_input_bytes if layer_input_bytes is not None else terms[0].bytes
        return x / t if sp else x
    total = 0.0
    for term in terms:
        if recompute == "selective" and term.scores:
            continue
        split = t if (term.region == "tp" or sp) else 1
        total += term.bytes / split
    return total


def _model_terms(layout: Layout, b: int) -> list[ActTerm]:
    m = layout.model
    # A backend training Hugging Face modules has unfused RMSNorm, and eager attention on CPU ranks.
    hf = traits(layout.backend).hf_modules
    return activation_terms("llama", layout.seq_len, b, m.hidden_size, m.num_heads, ffn=m.intermediate_size,
                            kv_heads=m.num_kv_heads, head_dim=m.head_dim, e=layout.elem_bytes, hf_norm=hf,
                            eager_attention=hf and layout.hardware.name == "cpu")


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations one stage holds at its peak (1F1B; interleaved per Korthikanti §4.2.3)."""
    p, mb = layout.grid.pp, max(1, layout.grad_accum)
    if p == 1:
        return 1.0
    held = min(p - stage, mb)
    if layout.vpp > 1 and stage == 0:
        held *= 1 + (p - 1) / (p * layout.vpp)
    return float(held)


def stage_activations(layout: Layout, stage: int) -> int:
    m, t, p = layout.model, layout.grid.tp, layout.grid.pp
    b = layout.micro_batch_size
    terms = _model_terms(layout, b)
    layers = m.num_layers // p
    per_layer = layer_activation_bytes(terms, t=t, sp=layout.sp, recompute=layout.recompute)
    stored = layers * per_layer
    if layout.recompute == "full":
        # While one layer is recomputed, its full activation set is alive once.
        stored += layer_activation_bytes(terms, t=t, sp=layout.sp, recompute="none")
    if stage == p - 1:
        # Output layer: final-norm input, 16-bit logits, the fp32 upcast and log-softmax of the loss, and at
        # the start of the backward the fp32 gradient of the logits beside them.
        vocab_split = t if traits(layout.backend).vocab_parallel else 1
        sbv = layout.seq_len * b * m.vocab_size
        stored += layout.elem_bytes * layout.seq_len * b * m.hidden_size + (layout.elem_bytes + 12) * sbv / vocab_split
    return int(stored * in_flight(layout, stage))


# --------------------------------------------------------------------------- buffers


def buffers(layout: Layout, params: int) -> int:
    """Communication buffers DeepSpeed allocates (elements × element size), capped by the rank's parameters."""
    if layout.grid.dp == 1 and layout.zero_stage == 0:
        return 0
    z, e, zo = layout.zero_stage, layout.elem_bytes, layout.ds_zero
    reduce = min(_bucket(layout, "reduce_bucket_size"), params)
    if z in (1, 2):
        gather = min(_bucket(layout, "allgather_bucket_size"), params)
        copies = 2 if zo.get("overlap_comm") else 1  # overlap_comm double-buffers the gradient bucket
        return e * (copies * reduce + gather)
    if z == 3:
        prefetch = _int_or(zo.get("stage3_prefetch_bucket_size"), 50_000_000)
        live = min(_int_or(zo.get("stage3_max_live_parameters"), 1_000_000_000), prefetch + largest_layer_params(layout),
                   params)
        return e * (reduce + live)
    return e * reduce


# --------------------------------------------------------------------------- communication


def _bw(layout: Layout, group: tuple[int, ...]) -> tuple[str, float, float]:
    """(link, nominal busbw GB/s, nominal latency µs per call) of a group."""
    hw, g = layout.hardware, layout.grid
    if not g.spans_nodes(group):
        return "intra_node", hw.intra_node_busbw_GBps, hw.intra_node_latency_us
    return ("inter_node", min(hw.inter_node_busbw_GBps, hw.nic_GBps_per_device * g.ranks_per_node_in(group)),
            hw.inter_node_latency_us)


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor for one of our collective names (launch/nccl_format, its one home); 0 for a group of one,
    which moves nothing."""
    return 0.0 if n <= 1 else nccl_format.bus_factor(nccl_format.NCCL_TESTS_OP[collective], n)


@dataclass(frozen=True)
class Timing:
    """Where a plan's times come from: a calibration that covers the layout, or the nominal profile (and why)."""

    calibration: cal.Calibration | None = None
    why_nominal: tuple[str, ...] = ()

    def call(self, collective: str, n: int, link: str, nominal_busbw: float, nominal_latency_us: float,
             nbytes: float) -> tuple[float, float, float]:
        """(seconds per call, latency µs, busbw GB/s) of one call moving an nbytes message (nccl-tests' size)."""
        fit = self.calibration.alpha_beta(collective, n, link) if self.calibration else None
        if fit is not None:
            busbw = fit.beta_Bps * bus_factor(collective, n) / 1e9 if math.isfinite(fit.beta_Bps) else math.inf
            return fit.seconds(nbytes), fit.alpha_s * 1e6, busbw
        moved = nbytes * bus_factor(collective, n)
        return (nominal_latency_us * 1e-6 + (moved / (nominal_busbw * 1e9) if nominal_busbw else 0.0),
                nominal_latency_us, nominal_busbw)


def _comm(layout: Layout, timing: Timing, par: str, coll: str, group: tuple[int, ...], calls: int, msg: float,
          note: str = "", after_step: bool = False) -> Comm:
    link, bw, lat = _bw(layout, group)
    per_call, latency, busbw = timing.call(coll, len(group), link, bw, lat, msg)
    per_rank = calls * msg * bus_factor(coll, len(group))
    return Comm(par, coll, link, len(group), int(calls), int(msg), int(per_rank), busbw, calls * per_call, note,
                after_step, latency)


@dataclass(frozen=True)
class TpCalls:
    """Tensor-parallel calls of one collective per optimizer step on one rank, by where they happen."""

    collective: str
    layers: int  # inside the decoder layers
    head: int  # activation-sized, around the embedding and the output layer
    loss: int  # one fp32 value per token (a vocab-parallel cross entropy)
    logits: int  # full-vocabulary logits gathered


def tp_calls(backend: str, *, sp: bool, layers: int, micro_batches: int, recompute: str, first_stage: bool = True,
             last_stage: bool = True) -> list[TpCalls]:
    """The collectives tensor (and sequence) parallelism issues per step on one rank of a pipeline stage that
    holds `layers` decoder layers (the embedding on the first stage; output layer and loss on the last): the one
    model the planner times and the report compares traces with (launch/backends.py holds each backend's counts
    per micro-batch)."""
    bt = traits(backend)
    tc = bt.tp_sp if sp else bt.tp
    if tc is None:
        raise ValueError(f'backend "{backend}" has no sequence parallelism')
    forwards = 2 if recompute == "full" else 1  # a full recompute runs every layer's forward collectives again
    head = Counter(tc.embedding if first_stage else {}) + Counter(tc.output if last_stage else {})
    loss = tc.loss_all_reduces if last_stage else 0
    logits = tc.logits_all_gathers if last_stage else 0
    out = []
    for coll in sorted(set(tc.layer_forward) | set(tc.layer_backward) | set(head) | ({"all_reduce"} if loss else set())
                       | ({"all_gather"} if logits else set())):
        per_layer = tc.layer_forward.get(coll, 0) * forwards + tc.layer_backward.get(coll, 0)
        out.append(TpCalls(coll, per_layer * layers * micro_batches, head.get(coll, 0) * micro_batches,
                           (loss if coll == "all_reduce" else 0) * micro_batches,
                           (logits if coll == "all_gather" else 0) * micro_batches))
    return out


def communication(layout: Layout, timing: Timing = Timing(), stage: int = 0) -> list[Comm]:
    """Every collective one rank of pipeline stage `stage` calls per optimizer step, with its count, message and
    time: DeepSpeed's ZeRO over the data-parallel group (both backends train through it), the TP/SP calls of
    `tp_calls`, and pipeline sends. The one model of collectives: the plan times the first stage's, the analysis
    compares every stage's with the traces (analysis.analyze.expected_collectives)."""
    g, m, e = layout.grid, layout.model, layout.elem_bytes
    out: list[Comm] = []
    mbs = layout.grad_accum
    params, layers = stage_params(layout, stage)
    act = layout.seq_len * layout.micro_batch_size * m.hidden_size * e
    first = g.rank(0, 0, stage)  # the stage's groups are those of its first rank
    if g.dp > 1:
        grp = g.dp_group(first)
        z = layout.zero_stage
        if z == 0:
            # The engine's allreduce_gradients buckets by a fixed element count (engine.py), not reduce_bucket_size.
            calls = -(-params // ZERO0_BUCKET_ELEMENTS)
            out.append(_comm(layout, timing, "dp", "all_reduce", grp, calls, params * e / calls,
                             f"gradient all-reduce at the accumulation boundary, one call per {ZERO0_BUCKET_ELEMENTS:,} "
                             "elements"))
        elif z in (1, 2):
            reduce_calls = -(-params // _bucket(layout, "reduce_bucket_size"))
            rs_calls = reduce_calls * (mbs if z == 2 else 1)
            out.append(_comm(layout, timing, "dp", "reduce_scatter", grp, rs_calls, params * e / reduce_calls,
                             "gradient reduce-scatter per reduce bucket " + ("every micro-step (ZeRO-2)" if z == 2 else
                                                                             "at the boundary (ZeRO-1)")))
            # One all_gather_into_tensor per parameter group (runtime/utils.all_gather_dp_groups): one here.
            out.append(_comm(layout, timing, "dp", "all_gather", grp, 1, params * e, "updated parameter partitions",
                             after_step=True))
        else:
            out.extend(_zero3_traffic(layout, timing, grp, -(-params // _bucket(layout, "reduce_bucket_size")), stage))
        # The loop's data-parallel loss mean, and DeepSpeed's gradient norm (its clip_grad_norm_ averages it over the
        # data-parallel group) unless the backend clips itself at this stage (launch.backends.StepCollectives).
        norm = z not in traits(layout.backend).step.clip_zero_stages
        out.append(_comm(layout, timing, "dp", "all_reduce", grp, 1 + norm, 4,
                         "one fp32 each: the logged loss mean (the loop)" + (" and the gradient norm (DeepSpeed)" if norm
                                                                             else ""), after_step=True))
    if g.tp > 1:
        grp = g.tp_group(first)
        sb = layout.seq_len * layout.micro_batch_size
        par = "sp" if layout.sp else "tp"
        for c in tp_calls(layout.backend, sp=layout.sp, layers=layers, micro_batches=mbs, recompute=layout.recompute,
                          first_stage=stage == 0, last_stage=stage == g.pp - 1):
            if c.layers + c.head:
                out.append(_comm(layout, timing, par, c.collective, grp, c.layers + c.head, act,
                                 f"{c.layers} in the decoder layers, {c.head} around the embedding and output layer"))
            if c.loss:
                out.append(_comm(layout, timing, "tp", c.collective, grp, c.loss, 4 * sb,
                                 "vocab-parallel cross entropy: max, target logit and sum of exponentials per token"))
            if c.logits:
                out.append(_comm(layout, timing, "tp", c.collective, grp, c.logits, sb * m.vocab_size * e,
                                 "AutoTP lm_head gathers the full-vocabulary logits every micro-batch"))
    if g.pp > 1:
        grp = (g.pp_group(0)[0], g.pp_group(0)[1])  # every boundary moves the same activations
        msg = act / g.tp if layout.sp else act
        # Each of this stage's model chunks (virtual stage k = v·pp + stage) sends to and receives from the virtual
        # stages next to it: per micro-batch and boundary one call forward (activations), one backward (gradients).
        virtual = g.pp * layout.vpp
        ends = sum((k > 0) + (k < virtual - 1) for k in (v * g.pp + stage for v in range(layout.vpp)))
        out.append(_comm(layout, timing, "pp", "send_recv", grp, 2 * mbs * ends, msg,
                         f"activations forward and gradients backward per micro-batch at {ends} chunk boundaries"
                         + ("; under 1F1B a send and a receive posted together wait once (the step's pp time)"
                            if layout.vpp == 1 else "")))
    out.extend(_step_collectives(layout, timing, stage, first, layers))
    return out


def _step_collectives(layout: Layout, timing: Timing, stage: int, first: int, layers: int) -> list[Comm]:
    """What the backend itself issues once per step after the micro-batches (launch.backends.StepCollectives), on
    pipeline stage `stage` whose first rank is `first`."""
    g, st, e = layout.grid, traits(layout.backend).step, layout.elem_bytes
    out = []
    if layout.sp and st.sp_norm_grads:
        # Two norms per decoder layer, and the final norm on the last stage, each of hidden_size weights.
        norms = 2 * layers + (stage == g.pp - 1)
        out.append(_comm(layout, timing, "sp", "all_reduce", g.tp_group(first), 1,
                         norms * layout.model.hidden_size * e, "the sequence-parallel norm weights' gradients summed "
                         "over TP, one coalesced call", after_step=True))
    if g.tp * g.pp > 1 and layout.zero_stage in st.clip_zero_stages:
        mp = tuple(g.rank(t, 0, p) for p in range(g.pp) for t in range(g.tp))  # `first` has data-parallel rank 0
        out.append(_comm(layout, timing, "tp", "all_reduce", mp, 1, 8,
                         f"the gradient norm over TP × PP ({len(mp)} ranks), one fp64 value (the backend clips)",
                         after_step=True))
    if g.pp > 1 and st.pp_loss_broadcast:
        out.append(_comm(layout, timing, "pp", "broadcast", g.pp_group(first), 1, 4,
                         "the logged loss, from the last stage to the pipeline group", after_step=True))
    return out


def _int_or(value: Any, default: int, low: int = 0) -> int:
    """A count from the composed zero_optimization section, or DeepSpeed's default where it is unset, "auto" or not
    a number >= low (DeepSpeed itself replaces or refuses those)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    return int(value) if ok else default


def _bucket(layout: Layout, key: str) -> int:
    return _int_or(layout.ds_zero.get(key), ZERO_BUCKET_DEFAULT, low=1)


def _persistence_threshold(layout: Layout) -> int:
    return _int_or(layout.ds_zero.get("stage3_param_persistence_threshold"), ZERO3_PERSISTENCE_THRESHOLD)


def zero3_fetched(layout: Layout, stage: int = 0) -> list[int]:
    """Sizes of a stage's parameters that ZeRO-3 partitions and gathers on use: those above
    stage3_param_persistence_threshold (the others stay whole on every rank)."""
    threshold = _persistence_threshold(layout)
    return [n for n in rank_parameters(layout, stage) if n > threshold]


def _zero3_traffic(layout: Layout, timing: Timing, grp: tuple[int, ...], reduce_calls: int, stage: int) -> list[Comm]:
    """DeepSpeed ZeRO-3 (partition_parameters.py, stage3.py; counted in traces of 0.19.8 on gloo): parameters at or
    below stage3_param_persistence_threshold stay whole and are re-gathered one call each after every optimizer step;
    the others are gathered one call each before their module's forward in every micro-step, and again before its
    backward when the stage holds more than stage3_max_reuse_distance parameters (otherwise they are still there);
    gradients leave in one reduce-scatter per bucket per micro-step."""
    zo, e, mbs = layout.ds_zero, layout.elem_bytes, layout.grad_accum
    threshold = _persistence_threshold(layout)
    tensors = rank_parameters(layout, stage)
    persistent = [n for n in tensors if n <= threshold]
    fetched = zero3_fetched(layout, stage)
    params = sum(tensors)
    out = []
    if fetched:
        again = params > _int_or(zo.get("stage3_max_reuse_distance"), ZERO3_MAX_REUSE_DISTANCE)
        msg = e * sum(fetched) / len(fetched)
        if again and layout.hpz > 1:
            # ZeRO++ hpZ: the backward re-gather reads the secondary partition, inside its group of hpz
            # consecutive ranks (a node when hpz = gpus_per_node); the forward gather still spans the dp group.
            out.append(_comm(layout, timing, "dp", "all_gather", grp, mbs * len(fetched), msg,
                             "ZeRO-3: one gather per partitioned parameter before its forward every micro-step"))
            out.append(_comm(layout, timing, "dp", "all_gather", grp[:layout.hpz], mbs * len(fetched), msg,
                             f"ZeRO++ hpZ: the backward re-gather from the secondary partition, within groups of "
                             f"{layout.hpz}"))
        else:
            times = mbs * (2 if again else 1)
            out.append(_comm(layout, timing, "dp", "all_gather", grp, times * len(fetched), msg,
                             "ZeRO-3: one gather per partitioned parameter before its forward"
                             + (" and again before its backward" if again else "") + " every micro-step"))
    out.append(_comm(layout, timing, "dp", "reduce_scatter", grp, mbs * reduce_calls, params * e / reduce_calls,
                     "ZeRO-3: gradients every micro-step, one call per reduce bucket"))
    if persistent:
        out.append(_comm(layout, timing, "dp", "all_gather", grp, len(persistent), e * sum(persistent) / len(persistent),
                         f"ZeRO-3: the {len(persistent)} persistent parameters (<= {threshold:,} elements), one gather "
                         "each after the optimizer step", after_step=True))
    return out


# --------------------------------------------------------------------------- FLOPs and step time


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """torchtitan's count: 6 × (non-embedding parameters, lm_head included) + 12 · L · heads · head_dim · s."""
    pc = model.param_counts()
    return 6 * pc.flops_params + 12 * model.num_layers * model.num_heads * model.head_dim * seq_len


def pipeline_exchanges(pp: int, stage: int, micro_batches: int) -> int:
    """Waits for point-to-point traffic per step on pipeline stage `stage` under Megatron-Core 0.16.1's 1F1B without
    interleaving (schedules.forward_backward_pipelining_without_interleaving): warm-up and cool-down micro-batches
    receive and send on their own, each steady-state micro-batch sends its output and receives its gradient in
    one exchange, then sends its input gradient and receives the next input in another (p2p_communication._p2p_ops
    posts both and waits for both; on a 2-rank pipeline over two groups, so that they overlap). An exchange takes
    about one call's time: the send and the receive are the same size."""
    first, last = stage == 0, stage == pp - 1
    ends = (not first) + (not last)
    warmup = min(pp - stage - 1, micro_batches)
    steady = micro_batches - warmup
    return 2 * warmup * ends + (not first) * (steady > 0) + steady * ends


def step_time(layout: Layout, comm: list[Comm], timing: Timing = Timing()) -> StepTime:
    """`comm`: pipeline stage 0's calls (communication(layout, timing)); the calibrated compute is the slowest
    stage's."""
    g, hw = layout.grid, layout.hardware
    tokens = layout.global_batch_size * layout.seq_len
    model_flops = model_flops_per_token(layout.model, layout.seq_len) * tokens
    recompute_factor = {"none": 1.0, "selective": 1.0, "full": 4 / 3}[layout.recompute]  # one more forward of 2N
    hw_flops = model_flops * recompute_factor
    peak = hw.peak_flops(layout.dtype)
    ga = max(1, layout.grad_accum)
    params, _ = stage_params(layout, 0)
    compute_c = timing.calibration.compute if timing.calibration else None
    tp = sum(c.time_s for c in comm if c.parallelism in ("tp", "sp"))
    bubble = None
    if compute_c is not None:
        # Measured op classes: forward and backward of this rank's part of the backend's own model per micro-batch
        # (timed in situ, its TP collectives included), the engine's own cost at this ZeRO stage (what real steps
        # spend beyond the rest of this sum), and Adam over the rank's partition (the whole shard without ZeRO).
        p = compute_c.find_pass(layout.backend, g.tp, layout.sp, layout.micro_batch_size, layout.recompute)
        eng = compute_c.find_engine(layout.backend, layout.zero_stage)
        engine = eng.micro_step_s + (eng.recompute_s if p.activation_checkpointing == "full" else 0.0)
        # Pipeline stages: each stage's share of the measured pass (its layers, the embedding on the first, output
        # layer and loss on the last). Under 1F1B the first micro-batch crosses every stage forward and back, the
        # others follow at the pace of the slowest: ga × the slowest stage, plus the other stages' one micro-batch
        # each (the bubble; (p-1)/m of the compute when the stages are equal, the nominal formula).
        stages = [p.stage_s(sum(map(len, chunk_layers(layout.model.num_layers, g.pp, layout.vpp, s)))
                            / layout.model.num_layers, s == 0, s == g.pp - 1)
                  for s in range(g.pp)]
        slowest = max(range(g.pp), key=stages.__getitem__)
        passes = ga * stages[slowest]
        bubble = sum(stages) - stages[slowest]
        # Adam on each stage's partition at once after the flush: the largest finishes last.
        part = max(sum(rank_parameters(layout, s)) for s in range(g.pp))
        part = part if layout.zero_stage == 0 else -(-part // g.dp)
        compute = ga * (engine + compute_c.data_s.get(str(layout.micro_batch_size), 0.0)) + eng.step_s + compute_c.adam_s(part)
        # Ranks that wait for one another each step finish with the slowest: the expected maximum of n ranks'
        # compute exceeds the mean by c_n standard deviations (Blom's approximation of the normal order statistic),
        # counted once per step, a lower bound when the ranks meet more often. The ranks of a TP group already
        # waited for one another inside the measured pass (at every TP collective), those of a pipeline at every
        # send and receive: n counts the model replicas.
        n = g.world // (g.tp * g.pp)
        skew = (NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) * p.sd_s * math.sqrt(ga)) if n > 1 else 0.0
        compute += skew
        # The passes hold the TP calls as they ran in situ: the table's α–β time for them is their share, the rest
        # of the passes is compute. The backend's own calls after the micro-batches ran outside the passes.
        after = sum(c.time_s for c in comm if c.parallelism in ("tp", "sp") and c.after_step)
        tp = min(tp - after, passes)
        compute += passes - tp
        tp += after
        compute_how = (f"compute measured ({timing.calibration.created}, {timing.calibration.machine_kind}): forward + "
                       f"backward of the {layout.backend} model at tp={g.tp}{' with SP' if layout.sp else ''} in situ"
                       + (f", split into {g.pp} pipeline stages by where its forward went (embedding, decoder layers, "
                          f"output layer and loss; the slowest, stage {slowest}, sets the pace)" if g.pp > 1 else "")
                       + " (its TP collectives included: the "
                       f"α–β time of those is shown as TP), micro_batch_size={layout.micro_batch_size}, "
                       f"activation_checkpointing={p.activation_checkpointing}, + the engine's own cost at ZeRO-"
                       f"{layout.zero_stage} (measured in real steps) + Adam over "
                       f"{part:,} parameters + making the micro-batches + {skew * 1e3:.2f} ms "
                       f"waiting for the slowest of {n} ranks; collectives on the measured α–β curves (calibrated)")
    else:
        compute = hw_flops / g.world / (peak * hw.achievable_mfu)
        compute_how = (f"compute at {hw.achievable_mfu:.0%} of {hw.name} {layout.dtype} peak (nominal); collectives "
                       f"{hw.intra_node_latency_us:g}/{hw.inter_node_latency_us:g} µs per call (intra/inter-node, "
                       "nominal) + bytes over the nominal bus bandwidth")
    if bubble is None:
        bubble = compute * (g.pp - 1) / (layout.vpp * max(ga, 1)) if g.pp > 1 else 0.0
    # Pipeline sends and receives on the critical path: under 1F1B without interleaving an exchange pairs a send
    # with a receive (the comm table lists every call at its own α–β time); interleaved schedules are counted call
    # by call. `comm` is stage 0's, as make_plan passes it.
    exchanges = pipeline_exchanges(g.pp, 0, ga) if layout.vpp == 1 else None
    pp = sum(c.time_s * (exchanges / c.calls_per_step if c.collective == "send_recv" and exchanges is not None
                         else 1.0) for c in comm if c.parallelism == "pp")
    dp = sum(c.time_s for c in comm if c.parallelism == "dp")
    dp_c = [c for c in comm if c.parallelism == "dp"]
    overlaps = OVERLAPS[backend_of(hw.name)]
    if not overlaps:
        dp_exposed = dp
        overlap_how = f"{backend_of(hw.name)} runs collectives on the training thread: nothing overlaps"
    else:
        dp_exposed = _dp_exposed(layout, dp_c, compute, ga)
        overlap_how = ("TP/SP and PP traffic on the critical path; DP traffic issued every micro-step overlaps the "
                       "backward, boundary traffic only the last micro-batch's backward, post-step gathers none "
                       "(ZeRO-3: forward gathers overlap the forward)")
    offload = 0.0
    part = params / g.dp
    if layout.offload_optimizer != "none":
        offload += (2 * part * layout.elem_bytes) / (PCIE_GBps * 1e9) + 16 * 2 * part / (HOST_ADAM_GBps * 1e9)
    if layout.offload_params != "none":
        # Offloaded 16-bit parameter partitions cross PCIe before the forward and again before the backward.
        offload += 2 * ga * part * layout.elem_bytes / (PCIE_GBps * 1e9)
    total = compute + bubble + tp + pp + dp_exposed + offload
    correction = timing.calibration.correction if compute_c is not None else 1.0
    if correction != 1.0:
        total *= correction
        compute_how += (f"; × {correction:.3f}, the measured/predicted ratio of {len(timing.calibration.verified)} "
                        "verified run(s)")
    return StepTime(
        model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops, compute_s=compute, bubble_s=bubble,
        tp_comm_s=tp, pp_comm_s=pp, dp_comm_s=dp, dp_exposed_s=dp_exposed, offload_s=offload, total_s=total,
        tokens_per_s_per_device=tokens / total / g.world if total else 0.0,
        mfu=model_flops / total / g.world / peak if total and peak else 0.0,
        assumptions=f"{compute_how}; {overlap_how}; offload adds PCIe and host-Adam time"
                    + ("" if g.pp == 1 else "; bubble " + ("the other stages' first micro-batch" if compute_c is not None
                                                          else "(p-1)/(v·m) of the compute")
                       + ("; a send and a receive posted together wait once (1F1B)" if layout.vpp == 1 else "")),
        timing="calibrated" if compute_c is not None else "nominal", correction=correction,
    )


def _dp_exposed(layout: Layout, dp_c: list[Comm], compute: float, ga: int) -> float:
    """DP time left on the critical path when collectives overlap compute."""
    forward_win, backward_win = compute / 3, compute * 2 / 3
    after = sum(c.time_s for c in dp_c if c.after_step)  # e.g. the post-step parameter all-gather: never hidden
    if layout.zero_stage == 3:
        fwd_gather = sum(c.time_s for c in dp_c if c.collective == "all_gather" and not c.after_step) / 2
        rest = sum(c.time_s for c in dp_c if not c.after_step) - fwd_gather
        return max(0.0, fwd_gather - forward_win) + max(0.0, rest - backward_win) + after
    # Collectives issued every micro-step can hide behind every backward; one issued at the accumulation
    # boundary only behind the last micro-batch's backward.
    per_micro = sum(c.time_s for c in dp_c if not c.after_step and c.calls_per_step > 1)
    boundary = sum(c.time_s for c in dp_c if not c.after_step and c.calls_per_step <= 1)
    return max(0.0, per_micro - backward_win) + max(0.0, boundary - backward_win / ga) + after


def layout_timing(layout: Layout) -> Timing:
    """The calibration of `layout.hardware` when it covers this layout on this machine, else nominal with why."""
    if layout.hardware.nominal:
        return Timing()
    from launch import envinfo

    calib = cal.Calibration.from_dict(layout.hardware.calibration)
    needs = sorted({(c.collective, c.group_size, c.link) for c in communication(layout)})
    why = cal.problems(calib, machine_kind=envinfo.machine_kind(), versions=envinfo.package_versions(), needs=needs,
                       model=layout.model.name, dtype=layout.dtype, seq_len=layout.seq_len,
                       ranks_per_node=layout.grid.gpus_per_node, tp=layout.grid.tp, micro_batch_size=layout.micro_batch_size,
                       backend=layout.backend, sp=layout.sp, activation_checkpointing=layout.recompute,
                       zero_stage=layout.zero_stage)
    if layout.vpp > 1:
        why.append("it does not time interleaved pipeline stages (vpp > 1)")
    if layout.offload_optimizer != "none" or layout.offload_params != "none":
        why.append("it does not time offloading")
    return Timing(None, tuple(why)) if why else Timing(calib)


# --------------------------------------------------------------------------- the plan


def implementation_accounting(backend: str) -> str:
    return traits(backend).accounting


def make_plan(layout: Layout, recipe_name: str = "") -> Plan:
    g, hw = layout.grid, layout.hardware
    allowance_fixed = RUNTIME_ALLOWANCE_CPU if hw.name == "cpu" else RUNTIME_ALLOWANCE_GPU
    usable = int(hw.memory_bytes * (1 - layout.headroom))
    stages = range(g.pp)
    ranks: list[RankPlan] = []
    for st in stages:
        params, layers = stage_params(layout, st)
        acts = stage_activations(layout, st)
        buf = buffers(layout, params)
        mem = {}
        for acc in ACCOUNTINGS:
            w, gr, o, host = model_states(layout, params, acc)
            body = w + gr + o + acts + buf
            mem[acc] = Memory(w, gr, o, acts, buf, allowance_fixed + int(FRAGMENTATION * body), host)
        members = tuple(r for r in range(g.world) if g.coords(r)[2] == st)
        if g.pp == 1:
            kind = "all ranks"
        else:
            kind = f"pp stage {st}" + (" (first)" if st == 0 else " (last)" if st == g.pp - 1 else "")
        ranks.append(RankPlan(kind, members, st, layers, params, in_flight(layout, st), mem,
                              implementation_accounting(layout.backend), hw.memory_bytes, usable))
    ranks = _merge_identical(ranks)
    timing = layout_timing(layout)
    comm = communication(layout, timing)
    notes = [
        "zero_paper: Rajbhandari et al. 2020 (2 + 2 + 12 B/param, 16-bit); deepspeed: DeepSpeed 0.19.8's "
        "implementation and estimators; megatron: Megatron-Core 0.16.1's distributed optimizer (fp32 main grads), for "
        "reference: both backends train through DeepSpeed's ZeRO",
        f"activations: Llama-family layer ({layout.model.architecture}), fused attention (no s×s scores kept), "
        f"recompute={layout.recompute}, sp={layout.sp}",
        f"allowance: {allowance_fixed / GiB:.1f} GiB runtime + {FRAGMENTATION:.0%} fragmentation",
        f"fit check: {implementation_accounting(layout.backend)} accounting against {hw.memory_bytes / GiB:.1f} GiB "
        f"× (1 - headroom {layout.headroom:.0%})",
    ]
    if timing.calibration is not None:
        notes.append(f"time: calibrated on {timing.calibration.machine_kind} at {timing.calibration.created} "
                     f"(hardware.profile is a calibration file)")
    elif timing.why_nominal:
        notes.append("time: nominal figures, labelled so: the calibration does not apply because "
                     + "; ".join(timing.why_nominal))
    else:
        notes.append(f"time: nominal figures of the {hw.name} profile (run `python -m launch calibrate` on the machine "
                     "that trains to measure them)")
    if traits(layout.backend).autotp and g.tp > 1:
        notes.append("DeepSpeed AutoTP shards the decoder Linear layers and lm_head (gathering full logits); "
                     "the embedding stays replicated")
    notes += placement_notes(layout, timing, comm)
    host = host_bytes_per_node(layout, ranks)
    notes.append(f"host check: {host / GiB:.1f} GiB per node = {HOST_BUFFER_FACTOR} × the larger of each local rank's fp32 "
                 f"model built on the host and the node's offloaded state (DeepSpeed's estimators, zero_init off), "
                 f"against {hw.host_memory_bytes / GiB:.0f} GiB × (1 - headroom)")
    return Plan(recipe_name, layout.backend, hw.name, g.to_dict(), tuple(ranks), tuple(comm),
                step_time(layout, comm, timing), tuple(notes), host, int(hw.host_memory_bytes * (1 - layout.headroom)))


def placement_notes(layout: Layout, timing: Timing, comm: list[Comm]) -> list[str]:
    """A TP group that spans nodes, with the numbers: its collectives' time per step on the inter-node link, against
    the same calls inside one node (the grid redrawn as one node of world-size ranks)."""
    g = layout.grid
    if g.tp <= 1 or not g.spans_nodes(g.tp_group(0)):
        return []
    tp_now = [c for c in comm if c.parallelism in ("tp", "sp")]
    one_node = replace(layout, grid=RankGrid(g.tp, g.pp, g.dp, g.world, 1))
    tp_inside = [c for c in communication(one_node, timing) if c.parallelism in ("tp", "sp")]
    across = sum(c.time_s for c in tp_now)
    inside = sum(c.time_s for c in tp_inside)
    link = min((c.busbw_GBps for c in tp_now), default=0.0)
    return [f"placement: the TP group of {g.tp} spans {-(-g.tp // g.gpus_per_node)} nodes: its collectives take "
            f"{across * 1e3:.1f} ms per step on the inter-node link ({link:.3g} GB/s bus bandwidth) against "
            f"{inside * 1e3:.1f} ms inside one node ({across / inside if inside else float('inf'):.1f}×); keep "
            f"parallel.tp <= hardware.gpus_per_node={g.gpus_per_node}"]


def host_bytes_per_node(layout: Layout, ranks: list[RankPlan]) -> int:
    """Host memory of the busiest node, as DeepSpeed's estimate_zero2/zero3_model_states_mem_needs count it without
    zero.Init (neither backend builds the model under it): every local process first builds its fp32 parameters
    on the host (4 B each), and offloaded optimizer state (and ZeRO-3 parameters) lives there afterwards; the node
    needs the larger of the two, times the estimators' buffer factor. Both backends build the whole model on every
    rank (trainers/common.build_model; Megatron from the canonical HF state) whatever its TP/PP shard. With one node
    and tp = pp = 1 this is their
    CPU column exactly; across nodes their ZeRO-2 offload figure counts every GPU's model copy as if on one node
    (max(4 · total GPUs, 16) B/param), which this does not."""
    g = layout.grid
    whole = 4 * layout.model.param_counts().total  # every process builds the whole fp32 model before sharding it
    load: dict[int, int] = {}
    offloaded: dict[int, int] = {}
    for rp in ranks:
        for rank in rp.ranks:
            node = g.node(rank)
            load[node] = load.get(node, 0) + whole
            offloaded[node] = offloaded.get(node, 0) + rp.memory[rp.implementation].host_bytes
    return max((int(HOST_BUFFER_FACTOR * max(load[n], offloaded[n])) for n in load), default=0)


def _merge_identical(ranks: list[RankPlan]) -> list[RankPlan]:
    """Middle pipeline stages with identical numbers are shown once, listing all their ranks."""
    out: list[RankPlan] = []
    for rp in ranks:
        prev = out[-1] if out else None
        if (prev and 0 < prev.pp_stage and rp.kind.startswith("pp stage") and "(" not in rp.kind and "(" not in prev.kind
                and prev.memory == rp.memory):
            out[-1] = RankPlan(prev.kind.split(" stage")[0] + f" stages {prev.pp_stage}-{rp.pp_stage}",
                               prev.ranks + rp.ranks, prev.pp_stage, prev.layers, prev.params,
                               prev.micro_batches_in_flight, prev.memory, prev.implementation,
                               prev.device_memory_bytes, prev.usable_bytes)
        else:
            out.append(rp)
    return out


def plan_resolved(resolved) -> Plan:
    return make_plan(Layout.from_resolved(resolved), resolved.recipe_name)
