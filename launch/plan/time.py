"""FLOPs and the predicted step time: compute, pipeline bubble, exposed communication, offload."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

from launch.comm.commbench_spec import backend_of
from launch.config import adapters, calibration as cal
from launch.config.backends import SELECTIVE_EVERY, traits
from launch.config.dsconfig import layer_params_per_rank
from launch.config.hardware import HardwareProfile, load_profile
from launch.config.models import ModelSpec
from launch.config.schema import PeftSection
from launch.plan.collectives import communication, pipeline_exchanges
from launch.plan.compute import Compute, compute, fusion, optimizer_partition
from launch.plan.layout import Comm, Layout, StepTime, prefetch_bucket
from launch.plan.memory import OP_POLICY_RECOMPUTED, chunk_layers, stage_params
from launch.plan.timing import Timing

PCIE_GBps = 25.0  # host<->device copies for offloaded optimizer state (PCIe 4 x16, effective)
HOST_ADAM_GBps = 20.0  # CPU Adam streams ~16 B/param in and out; effective host memory bandwidth
# Whether a process group's collectives run beside compute: NCCL's kernels run on their own streams, while gloo
# runs each call on the calling CPU thread, so on CPU ranks nothing overlaps and a step is the sum of its parts.
OVERLAPS = {"nccl": True, "gloo": False}


# --------------------------------------------------------------------------- FLOPs and step time


def model_flops_per_token(model: ModelSpec, seq_len: int, peft: PeftSection = PeftSection()) -> float:
    """torchtitan's count: 6 × (non-embedding parameters, lm_head included) + 12 · L · heads · head_dim · s. Under
    [peft] the FLOPs the fine-tune does: the frozen matmuls' forward (2 per parameter) and their input gradient (2;
    no weight gradient), the adapters' 6 per parameter, the same attention."""
    pc = model.param_counts()
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
    if not adapters.adapted(peft):
        return 6 * pc.flops_params + attention
    return 4 * pc.flops_params + 6 * adapters.parameter_split(model, peft).trainable + attention



def recompute_flops_per_token(layout: Layout) -> float:
    """FLOPs activation checkpointing adds. Full, on the deepspeed and megatron backends: one more forward of every
    decoder layer (Hugging Face's gradient checkpointing and Megatron's full recompute both stop at the layers: the
    output layer runs once, as launch.plan.compute times it). The torch backend checkpoints decoder blocks with
    torch's non-reentrant checkpoint, which stops recomputing once the saved tensors the backward needs are back:
    under "full" (every block) and "every_other_block" (blocks 0, n, 2n, ...: launch.config.backends.SELECTIVE_EVERY)
    each checkpointed block's forward again but its last matmul (down_proj, whose output nothing saves), and its
    attention; under "selective" (torchtitan's op policy) the matmuls it does not keep
    (launch.plan.memory.OP_POLICY_RECOMPUTED) in every block. Counted by `python -m launch rehearse`
    (FlopCounterMode over the real step)."""
    ac, m = layout.activation_checkpointing, layout.model
    # Under [peft] a recomputed block's forward includes its adapters' GEMMs (2 FLOPs per adapter parameter), all of
    # them under "full" (the torch backend's stop before down_proj's base matmul is kept, its adapter is counted); the
    # op policy is approximated by the base matmuls it names without [peft] (launch.plan.compute says why).
    adapter_forward = 2 * adapters.parameter_split(m, layout.peft).trainable if adapters.adapted(layout.peft) else 0
    if traits(layout.backend).accounting != "torch":
        layers = m.param_counts().flops_params - m.vocab_size * m.hidden_size  # less the output layer
        return (2 * layers + adapter_forward + 4 * m.num_layers * m.num_heads * m.head_dim * layout.seq_len
                if ac == "full" else 0.0)
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    if ac == "selective":
        sizes = {"k_proj": h * kv, "o_proj": q * h, "up_proj": h * m.intermediate_size}
        return m.num_layers * 2 * sum(sizes[name] for name in OP_POLICY_RECOMPUTED)
    blocks = {"none": 0, "full": m.num_layers, "every_other_block": -(-m.num_layers // SELECTIVE_EVERY)}[ac]
    pc = m.param_counts()
    down_proj = m.intermediate_size * m.hidden_size
    per_block = (2 * (pc.attention_per_layer + pc.mlp_per_layer - down_proj) + adapter_forward // m.num_layers
                 + 4 * m.num_heads * m.head_dim * layout.seq_len)
    return blocks * per_block


@dataclass(frozen=True)
class _Compute:
    """The compute of one step, the TP time beside it and the bubble, as one time source found them."""

    compute_s: float
    tp_s: float  # TP/SP collectives on the critical path
    bubble_s: float
    how: str
    parts: Compute | None = None  # the nominal model's compute by kind


def _nominal_compute(layout: Layout, tp: float) -> _Compute:
    """The compute model's step (launch/plan/compute.py) on the nominal profile; the pipeline bubble is the other
    stages' first micro-batch under 1F1B, (p-1)/(v·m) of the passes when interleaved."""
    c = compute(layout)
    hw, g = layout.hardware, layout.grid
    if g.pp == 1:
        bubble = 0.0
    elif layout.vpp == 1:
        bubble = sum(c.per_micro_batch_s) - c.per_micro_batch_s[c.stage]
    else:
        bubble = c.per_micro_batch_s[c.stage] * (g.pp - 1) / layout.vpp
    figures = "nominal" if hw.nominal else "fitted on this machine by calibrate"
    how = (f"compute from the model's shapes on {hw.name} ({figures}): GEMMs at up to {hw.efficiency.gemm:.0%} of "
           f"{layout.dtype} peak by shape, attention ({layout.attention}) by its kernel, memory-bound work "
           f"({fusion(layout)}) over {hw.efficiency.memory:.0%} of {hw.hbm_GBps:.3g} GB/s; collectives "
           + ("on the calibration's measured α–β curves where it measured the group, else " if not hw.nominal else "")
           + f"{hw.intra_node_latency_us:g}/{hw.inter_node_latency_us:g} µs per call (intra/inter-node, nominal) + "
           "bytes over the nominal bus bandwidth")
    return _Compute(c.total_s, tp, bubble, how, c)


def step_time(layout: Layout, comm: list[Comm], timing: Timing = Timing()) -> StepTime:
    """`comm`: pipeline stage 0's calls (communication(layout, timing)); the calibrated compute is the slowest
    stage's."""
    layout = on_figures_of(layout, timing)
    g, hw = layout.grid, layout.hardware
    tokens = layout.global_batch_size * layout.seq_len
    model_flops = model_flops_per_token(layout.model, layout.seq_len, layout.peft) * tokens
    hw_flops = model_flops + recompute_flops_per_token(layout) * tokens
    peak = hw.peak_flops(layout.dtype)
    ga = max(1, layout.grad_accum)
    params, _ = stage_params(layout, 0)
    compute_c = timing.calibration.compute if timing.calibration else None
    tp = sum(c.time_s for c in comm if c.parallelism in ("tp", "sp"))
    if compute_c is not None:
        found = _calibrated_compute(layout, comm, timing, tp, ga)
    else:
        found = _nominal_compute(layout, tp)
    compute, tp, compute_how = found.compute_s, found.tp_s, found.how
    bubble = found.bubble_s
    pp = _pp_critical_s(layout, comm, ga)
    dp = sum(c.time_s for c in comm if c.parallelism == "dp")
    dp_c = [c for c in comm if c.parallelism == "dp"]
    overlaps = OVERLAPS[backend_of(hw.device_type)]
    if not overlaps:
        dp_exposed = dp
        overlap_how = f"{backend_of(hw.device_type)} runs collectives on the training thread: nothing overlaps"
    else:
        dp_exposed = _dp_exposed(layout, dp_c, compute, ga)
        overlap_how = ("TP/SP and PP traffic on the critical path; " + (
            "Megatron's distributed optimizer: every gradient bucket's reduce-scatter but the last overlaps the last "
            "micro-batch's backward, every parameter bucket's all-gather but the first the next step's first forward"
            if traits(layout.backend).distributed_optimizer(layout.zero_stage) else
            "DP traffic issued every micro-step overlaps the backward, boundary traffic only the last micro-batch's "
            "backward, post-step gathers none (ZeRO-3: forward gathers overlap the forward)"))
    offload = _offload_s(layout, params, ga)
    # The hooks run on the host while the device computes what was launched before them: only the host time beyond the
    # device's is exposed. A calibration's measured passes hold them already.
    hooks = 0.0 if compute_c is not None else _zero3_hooks_s(layout, ga)
    engine = max(0.0, hooks - compute)
    total = compute + bubble + tp + pp + dp_exposed + offload + engine
    correction = timing.calibration.correction if compute_c is not None else 1.0
    if correction != 1.0:
        total *= correction
        compute_how += (f"; × {correction:.3f}, the measured/predicted ratio of {len(timing.calibration.verified)} "
                        "verified run(s)")
    parts = found.parts
    return StepTime(
        gemm_s=parts.gemm_s if parts else 0.0, attention_s=parts.attention_s if parts else 0.0,
        memory_s=parts.memory_s if parts else 0.0, optimizer_s=parts.optimizer_s if parts else 0.0,
        recompute_s=parts.recompute_s if parts else 0.0, gemm_peak_share=parts.gemm_peak_share if parts else 0.0,
        model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops, compute_s=compute, bubble_s=bubble,
        tp_comm_s=tp, pp_comm_s=pp, dp_comm_s=dp, dp_exposed_s=dp_exposed, offload_s=offload, engine_s=engine,
        total_s=total,
        tokens_per_s_per_device=tokens / total / g.world if total else 0.0,
        mfu=model_flops / total / g.world / peak if total and peak else 0.0,
        assumptions=f"{compute_how}; {overlap_how}; offload adds PCIe and host-Adam time"
                    + (f"; DeepSpeed ZeRO-3's per-module hooks {hooks * 1e3:.0f} ms on the host, "
                       + (f"{engine * 1e3:.0f} ms of it beyond the device's compute, exposed" if engine else
                          "within the device's compute, hidden") if hooks else "")
                    + ("" if g.pp == 1 else "; bubble " + ("the other stages' first micro-batch" if layout.vpp == 1
                                                          else "(p-1)/v of the slowest stage's micro-batch")
                       + ("; a send and a receive posted together wait once (1F1B)" if layout.vpp == 1 else "")),
        timing=timing.label, correction=correction,
    )


def _calibrated_compute(layout: Layout, comm: list[Comm], timing: Timing, tp: float, ga: int) -> _Compute:
    """The step's compute from the calibration's measured op classes; `tp`: the comm table's TP/SP time, of which the
    measured passes already hold the in-situ share."""
    g, compute_c = layout.grid, timing.calibration.compute
    # Measured op classes: forward and backward of this rank's part of the backend's own model per micro-batch
    # (timed in situ, its TP collectives included), the engine's own cost at this ZeRO stage (what real steps
    # spend beyond the rest of this sum), and Adam over the rank's partition (the whole shard without ZeRO).
    p = compute_c.find_pass(layout.backend, g.tp, layout.sp, layout.micro_batch_size, layout.activation_checkpointing)
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
    part = optimizer_partition(layout)
    data = compute_c.data_s.get(str(layout.micro_batch_size), 0.0)
    compute = ga * (engine + data) + eng.step_s + compute_c.adam_s(part)
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
    how = (f"compute measured ({timing.calibration.created}, {timing.calibration.machine_kind}): forward + "
           f"backward of the {layout.backend} model at tp={g.tp}{' with SP' if layout.sp else ''} in situ"
           + (f", split into {g.pp} pipeline stages by where its forward went (embedding, decoder layers, "
              f"output layer and loss; the slowest, stage {slowest}, sets the pace)" if g.pp > 1 else "")
           + " (its TP collectives included: the "
           f"α–β time of those is shown as TP), micro_batch_size={layout.micro_batch_size}, "
           f"activation_checkpointing={p.activation_checkpointing}, + the engine's own cost at ZeRO-"
           f"{layout.zero_stage} (measured in real steps) + Adam over "
           f"{part:,} parameters + making the micro-batches + {skew * 1e3:.2f} ms "
           f"waiting for the slowest of {n} ranks; collectives on the measured α–β curves (calibrated)")
    return _Compute(compute, tp, bubble, how)


# DeepSpeed ZeRO-3's per-module hooks (each module's parameters fetched, released and prefetched, bookkept in Python)
# run on the host in the critical path: measured once, +237 ms per micro-step for Qwen2.5-0.5B (24 Hugging Face layers
# of 9 modules with parameters, with the embedding, final norm and lm_head: 219) on one H200
# (bench/results/README_history.md, 2026-12-04): per module and pass (forward, backward).
ZERO3_HOOK_S = 0.237 / (2 * 219)
# modules holding parameters in one decoder layer: Hugging Face's q, k, v, o, gate, up, down and two norms; Megatron-
# Core's linear_qkv, linear_proj, linear_fc1, linear_fc2 and two norms
MODULES_PER_LAYER = {True: 9, False: 6}


def _zero3_hooks_s(layout: Layout, ga: int) -> float:
    """The hooks' host time per step on a GPU rank under DeepSpeed's ZeRO-3 (the deepspeed backend, and the megatron
    backend's ZeRO-3): every micro-step's forward and backward pass each module of the rank's stage once. On CPU ranks
    the nominal figures leave it out (the host is the device there; a calibration measures both)."""
    bt = traits(layout.backend)
    if layout.zero_stage != 3 or not bt.uses_deepspeed(3) or layout.hardware.device_type != "cuda":
        return 0.0
    modules = layout.model.num_layers // layout.grid.pp * MODULES_PER_LAYER[bt.hf_modules] + 3
    return ga * 2 * modules * ZERO3_HOOK_S


def _pp_critical_s(layout: Layout, comm: list[Comm], ga: int) -> float:
    """Pipeline sends and receives on the critical path: under 1F1B without interleaving an exchange pairs a send
    with a receive (the comm table lists every call at its own α–β time); interleaved schedules are counted call
    by call. `comm` is stage 0's, as make_plan passes it."""
    exchanges = pipeline_exchanges(layout.grid.pp, 0, ga) if layout.vpp == 1 else None
    return sum(c.time_s * (exchanges / c.calls_per_step if c.collective == "send_recv" and exchanges is not None
                           else 1.0) for c in comm if c.parallelism == "pp")


def _offload_s(layout: Layout, params: int, ga: int) -> float:
    """Host-device copies and the host's Adam step of offloaded state; `params`: pipeline stage 0's."""
    offload = 0.0
    part = params / layout.grid.dp
    if layout.offload_optimizer != "none":
        offload += (2 * part * layout.elem_bytes) / (PCIE_GBps * 1e9) + 16 * 2 * part / (HOST_ADAM_GBps * 1e9)
    if layout.offload_params != "none":
        # Offloaded 16-bit parameter partitions cross PCIe before the forward and again before the backward.
        offload += 2 * ga * part * layout.elem_bytes / (PCIE_GBps * 1e9)
    return offload


def _dp_exposed(layout: Layout, dp_c: list[Comm], compute: float, ga: int) -> float:
    """DP time left on the critical path when collectives overlap compute."""
    forward_win, backward_win = compute / 3, compute * 2 / 3
    after = sum(c.time_s for c in dp_c if c.after_step)  # e.g. the post-step parameter all-gather: never hidden
    if layout.zero_stage == 3:
        gathers = sum(c.time_s for c in dp_c if c.collective == "all_gather" and not c.after_step)
        reduces = sum(c.time_s for c in dp_c if not c.after_step) - gathers
        ahead = _prefetched_share(layout)
        # The gathers are split between the forward and the backward (whose re-gathers the communication plan counts);
        # only the prefetched share of each layer's gather overlaps the layer before it, the rest waits on the
        # critical path. Without overlap_comm the reduce-scatters wait too.
        overlap = not traits(layout.backend).uses_deepspeed(layout.zero_stage) or layout.ds_zero.get("overlap_comm", True) is not False
        hidden_reduces = reduces if overlap else 0.0
        return ((1 - ahead) * gathers + max(0.0, ahead * gathers / 2 - forward_win)
                + max(0.0, ahead * gathers / 2 + hidden_reduces - backward_win) + (reduces - hidden_reduces) + after)
    if traits(layout.backend).distributed_optimizer(layout.zero_stage):
        return _distributed_optimizer_exposed(dp_c, forward_win / ga, backward_win / ga) + after
    # Collectives issued every micro-step can hide behind every backward; one issued at the accumulation
    # boundary only behind the last micro-batch's backward.
    per_micro = sum(c.time_s for c in dp_c if not c.after_step and c.calls_per_step > 1)
    boundary = sum(c.time_s for c in dp_c if not c.after_step and c.calls_per_step <= 1)
    if layout.zero_stage in traits(layout.backend).reduces_after_backward:
        return per_micro + boundary + after
    return max(0.0, per_micro - backward_win) + max(0.0, boundary - backward_win / ga) + after


def _distributed_optimizer_exposed(dp_c: list[Comm], forward_win: float, backward_win: float) -> float:
    """Megatron's overlapped DDP and distributed optimizer: each bucket's reduce-scatter starts when the last
    micro-batch's backward has finished its gradients, so all but the last bucket's hide behind that backward; each
    bucket's parameter all-gather is prefetched while the bucket before it computes the next step's first forward,
    so all but the first bucket's hide behind that forward."""
    exposed = 0.0
    for collective, window in (("reduce_scatter", backward_win), ("all_gather", forward_win)):
        calls = [c for c in dp_c if c.collective == collective and not c.after_step]
        total = sum(c.time_s for c in calls)
        buckets = sum(c.calls_per_step for c in calls)
        if buckets:
            one = total / buckets
            exposed += one + max(0.0, total - one - window)
    return exposed


def _prefetched_share(layout: Layout) -> float:
    """The share of a decoder layer's parameters gathered ahead while the layer before it computes: DeepSpeed's
    stage3_prefetch_bucket_size against one layer on this rank (a smaller bucket leaves the rest of each gather on the
    critical path); FSDP2 prefetches the next block whole."""
    if not traits(layout.backend).uses_deepspeed(layout.zero_stage):
        return 1.0
    return min(1.0, prefetch_bucket(layout) / layer_params_per_rank(layout.model, layout.grid.tp))


def layout_timing(layout: Layout, machine: cal.Machine | None) -> Timing:
    """The calibration of `layout.hardware` when its measured passes cover this layout on `machine` (the collectives
    it did not measure on nominal figures, said); else its fitted figures when it measured this machine at the
    layout's dtype; else nominal; with why. The machine arrives as data (the planner probes none); without one a
    calibration cannot be checked, so it is not used."""
    if layout.hardware.nominal:
        return Timing()
    if machine is None:
        return Timing(None, ("no machine was given to check it against (the plan is for no particular machine)",))
    calib = cal.Calibration.from_dict(layout.hardware.calibration)
    needs = sorted({(c.collective, c.group_size, c.link) for c in communication(layout)})
    missing = tuple(cal.missing_collectives(calib, needs))
    why = cal.problems(calib, machine_kind=machine.kind, versions=machine.versions,
                       model=layout.model.name, dtype=layout.dtype, seq_len=layout.seq_len,
                       ranks_per_node=layout.grid.gpus_per_node, tp=layout.grid.tp, micro_batch_size=layout.micro_batch_size,
                       backend=layout.backend, sp=layout.sp, activation_checkpointing=layout.activation_checkpointing,
                       zero_stage=layout.zero_stage)
    if layout.vpp > 1:
        why.append("it does not time interleaved pipeline stages (vpp > 1)")
    if layout.offload_optimizer != "none" or layout.offload_params != "none":
        why.append("it does not time offloading")
    if adapters.adapted(layout.peft):
        why.append("its passes trained every parameter, not a [peft] fine-tune's adapters")
    if not why:
        return Timing(calib, missing)
    this_machine = not cal.host_problems(calib, machine_kind=machine.kind, versions=machine.versions,
                                         ranks_per_node=layout.grid.gpus_per_node)
    fitted = calib.compute.fitted if calib.compute else None
    return Timing(None, (*why, *missing), calib if this_machine and fitted and fitted.dtype == layout.dtype else None)


@functools.lru_cache(maxsize=None)
def _nominal_profile(name: str) -> HardwareProfile:
    """A shipped profile, read once: step_time asks it for every layout recommend and plan search."""
    return load_profile(name)


def on_figures_of(layout: Layout, timing: Timing) -> Layout:
    """The layout on the hardware figures its timing stands on: a calibrated profile's fitted figures only where the
    calibration measured this machine at the layout's dtype (Timing.fitted_on), else its nominal base profile's."""
    if layout.hardware.nominal or timing.calibration or timing.fitted_on:
        return layout
    return dataclasses.replace(layout, hardware=_nominal_profile(layout.hardware.calibration["base_profile"]))
