"""What the planner plans and what it answers: the layout (`Layout`, built from a resolved recipe or by the
`plan` command) and the plan's records (memory, collectives, step time per rank), with plan.json's reader and writer."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from launch.config.grid import RankGrid
from launch.config.hardware import HardwareProfile
from launch.config.models import ModelSpec
from launch.config.schema import PeftSection
from launch.config.dsconfig import ZERO3_PERSISTENCE_THRESHOLD

PLAN_SCHEMA_VERSION = 1
# plan.json lists a rank type's ranks up to this many; beyond, {"first": a, "last": b} (they are consecutive): a world
# of a million ranks is not a million numbers per rank type.
RANKS_LISTED = 10_000
# DeepSpeed ZeRO-3 defaults (stage3 config) that decide how many gathers a step makes.
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size (elements)
ZERO_BUCKET_DEFAULT = 500_000_000  # reduce_bucket_size / allgather_bucket_size defaults (elements)
ZERO0_BUCKET_ELEMENTS = 500_000_000  # engine.allreduce_gradients' fixed bucket without ZeRO


def megatron_bucket_elements(dp: int) -> int:
    """Megatron-Core 0.16.1 DDP's bucket with overlap_grad_reduce (distributed_data_parallel.py): max(40M, 1M × dp)."""
    return max(40_000_000, 1_000_000 * dp)


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
    activation_checkpointing: str = "none"  # none | selective | full
    attention: str = "sdpa"  # sdpa (fused: no s×s scores kept) | eager (the softmax materialised) | te
    compile: bool = False  # train.compile: the blocks' memory-bound work fused (launch/plan/compute.py)
    grad_reduce_dtype: str = "fp32"  # precision.grad_reduce_dtype (with a 16-bit dtype; fp32 training reduces fp32)
    sp: bool = False
    vpp: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    ds_zero: Mapping[str, Any] = field(default_factory=dict)  # the composed zero_optimization section
    headroom: float = 0.10
    zero_hpz_partition_size: int = 1  # the recipe's; DeepSpeed's composed section (ds_zero) overrides it
    checkpoint_async: bool = False  # run.checkpoint_async
    peft: PeftSection = PeftSection()  # [peft]: a frozen base with adapters (launch.config.adapters); method none: off

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.grid.dp)

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient element data parallelism reduces (every backend honours precision.grad_reduce_dtype)."""
        return 2 if self.grad_reduce_dtype == "bf16" and self.dtype == "bf16" else 4

    @property
    def hpz(self) -> int:
        """ZeRO++ hpZ's secondary partition group size (DeepSpeed), or the torch backend's hybrid-sharding group
        (FSDP2 shards within it, replicates across); 1: off. ZeRO-3 only, as both apply it."""
        return (int_or(self.ds_zero.get("zero_hpz_partition_size"), self.zero_hpz_partition_size, low=1)
                if self.zero_stage == 3 else 1)

    @classmethod
    def from_resolved(cls, r) -> "Layout":
        rc = r.recipe
        return cls(
            backend=rc.backend, model=r.model, hardware=r.hardware, grid=r.grid,
            zero_stage=rc.parallel.zero_stage, dtype=rc.precision.dtype,
            micro_batch_size=rc.batch.micro_batch_size, global_batch_size=rc.batch.global_batch_size,
            seq_len=rc.batch.seq_len, activation_checkpointing=rc.train.activation_checkpointing,
            attention=rc.train.attention, compile=rc.train.compile, grad_reduce_dtype=rc.precision.grad_reduce_dtype,
            sp=rc.parallel.sp,
            vpp=rc.parallel.vpp, offload_optimizer=rc.parallel.offload_optimizer,
            offload_params=rc.parallel.offload_params,
            ds_zero=dict(r.ds_config.get("zero_optimization", {})), headroom=rc.plan.headroom,
            zero_hpz_partition_size=rc.parallel.zero_hpz_partition_size, checkpoint_async=rc.run.checkpoint_async, peft=rc.peft,
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
    # Where the kinds above are the peak of the step's phases (launch.plan.memory.PHASES, the torch accounting): each
    # phase's bytes before the allowance, and which phase is the peak. Empty where each kind's own peak is added.
    phases: Mapping[str, int] = field(default_factory=dict)
    peak_phase: str = ""

    KINDS = ("weights", "grads", "optimizer", "activations", "buffers", "allowance", "host_bytes")

    def kinds(self) -> dict[str, int]:
        """Its byte counts by kind (not the phases)."""
        return {k: getattr(self, k) for k in self.KINDS}

    @property
    def before_allowance(self) -> int:
        """The peak torch's memory tracker can see (the rehearsal): the total less the runtime allowance."""
        return self.total - self.allowance

    @property
    def model_states(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.allowance


@dataclass(frozen=True)
class RankPlan:
    kind: str  # e.g. "all ranks", "pp stage 0 (first)"
    ranks: Sequence[int]  # a range (a stage's ranks are consecutive); a tuple only if read back non-consecutive
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
    # "calibrated": a calibration's passes and collectives; "fitted": the compute model on figures a calibration
    # fitted on this machine (launch.plan.timing.Timing); else "nominal"
    timing: str = "nominal"
    correction: float = 1.0  # the calibration's measured/predicted ratio from verified runs, already in total_s
    # The nominal compute by kind (launch/plan/compute.py; 0 where calibrated: measured passes are not split), each
    # already in compute_s: GEMMs, fused attention, memory-bound work (norms, RoPE, SwiGLU, loss), the optimizer step,
    # and the GEMMs' FLOP rate as a share of dense peak.
    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    optimizer_s: float = 0.0
    recompute_s: float = 0.0
    gemm_peak_share: float = 0.0
    # host work on the critical path, already in total_s: DeepSpeed ZeRO-3's per-module hooks beyond the device's
    # compute (launch/plan/time.py)
    engine_s: float = 0.0

    def terms(self) -> dict[str, float]:
        """What sets the MFU: each kind's share of the step (empty where the compute was measured, not modelled)."""
        if not self.gemm_s or not self.total_s:
            return {}
        return {"GEMMs": self.gemm_s / self.total_s, "attention": self.attention_s / self.total_s,
                "memory-bound": self.memory_s / self.total_s,
                "optimizer and shard copies": self.optimizer_s / self.total_s,
                "exposed communication": (self.tp_comm_s + self.pp_comm_s + self.dp_exposed_s) / self.total_s,
                "bubble": self.bubble_s / self.total_s, "offload": self.offload_s / self.total_s,
                "ZeRO-3 hooks": self.engine_s / self.total_s}


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint save (launch/plan/checkpoint.py)."""

    bytes_total: int  # the checkpoint folder: every rank's files
    bytes_per_parameter: int
    bytes_held_per_rank: int  # the busiest rank's part: what an asynchronous save copies to host memory first
    write_s: float  # the files written, every node at hardware.checkpoint_write_GBps at once (0: no figure)
    blocked_s: float  # training stands still this long per save (0: no figure)
    asynchronous: bool  # run.checkpoint_async


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
    checkpoint: CheckpointCost | None = None  # one save's cost (launch/plan/checkpoint.py); None in older plans
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
            rp["ranks"] = ranks_to_json(src.ranks)
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
                        "ranks": ranks_from_json(rp["ranks"]),
                        "memory": {a: Memory(**{k: v for k, v in m.items() if k in mem_fields})
                                   for a, m in rp["memory"].items()}})
            for rp in d["ranks"])
        return cls(recipe_name=d["recipe_name"], backend=d["backend"], hardware=d["hardware"], grid=d["grid"],
                   ranks=ranks, comm=tuple(Comm(**c) for c in d["comm"]), step=StepTime(**d["step"]),
                   notes=tuple(d["notes"]), host_bytes_per_node=d.get("host_bytes_per_node", 0),
                   host_usable_bytes=d.get("host_usable_bytes", 0), checkpoint=CheckpointCost(**d["checkpoint"]) if d.get("checkpoint") else None,
                   schema_version=d["schema_version"])



def ranks_to_json(ranks: Sequence[int]) -> list[int] | dict[str, int]:
    """A rank type's ranks in plan.json: listed, or first and last where more than RANKS_LISTED follow each other."""
    if len(ranks) > RANKS_LISTED and isinstance(ranks, range) and ranks.step == 1:
        return {"first": ranks.start, "last": ranks.stop - 1}
    return list(ranks)


def ranks_from_json(value: Any) -> Sequence[int]:
    """plan.json's ranks back: a range where they follow each other (as every plan writes them), else a tuple."""
    if isinstance(value, dict):
        return range(value["first"], value["last"] + 1)  # a TypeError for anything but whole numbers
    ranks = tuple(value)
    if ranks and all(type(r) is int for r in ranks) and all(r == ranks[0] + i for i, r in enumerate(ranks)):
        return range(ranks[0], ranks[0] + len(ranks))
    return ranks


def int_or(value: Any, default: int, low: int = 0) -> int:
    """A count from the composed zero_optimization section, or DeepSpeed's default where it is unset, "auto" or not
    a number >= low (DeepSpeed itself replaces or refuses those)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    return int(value) if ok else default


def prefetch_bucket(layout: Layout) -> int:
    return int_or(layout.ds_zero.get("stage3_prefetch_bucket_size"), ZERO3_PREFETCH_BUCKET)


def bucket(layout: Layout, key: str) -> int:
    return int_or(layout.ds_zero.get(key), ZERO_BUCKET_DEFAULT, low=1)


def persistence_threshold(layout: Layout) -> int:
    return int_or(layout.ds_zero.get("stage3_param_persistence_threshold"), ZERO3_PERSISTENCE_THRESHOLD)

