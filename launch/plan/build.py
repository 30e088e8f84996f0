"""The plan of a layout: memory of every pipeline stage, the first stage's collectives and the step time, with the
notes that say which accounting and which time source each figure used."""
from __future__ import annotations

from dataclasses import replace

from launch.config import adapters
from launch.config.backends import traits
from launch.config.calibration import Machine
from launch.config.grid import RankGrid
from launch.plan.adapters import NF4_BYTES_PER_PARAM
from launch.plan.checkpoint import checkpoint_cost
from launch.plan.collectives import communication
from launch.plan.layout import CheckpointCost, Comm, Layout, Memory, Plan, RankPlan
from launch.plan.memory import (
    ACCOUNTINGS,
    FRAGMENTATION,
    HOST_BUFFER_FACTOR,
    RUNTIME_ALLOWANCE_CPU,
    RUNTIME_ALLOWANCE_GPU,
    buffers,
    host_bytes_per_node,
    in_flight,
    model_states,
    phased,
    repeats_kv,
    sdpa_kernel,
    stage_activations,
    stage_params,
    torch_phases,
)
from launch.plan.time import layout_timing, step_time
from launch.plan.timing import Timing
from launch.units import GiB

# --------------------------------------------------------------------------- the plan


def implementation_accounting(layout: Layout) -> str:
    """The accounting of what the layout's backend builds at its ZeRO stage: the one its fit check uses."""
    return traits(layout.backend).accounting_at(layout.zero_stage)


def make_plan(layout: Layout, recipe_name: str = "", machine: Machine | None = None) -> Plan:
    """The plan of `layout`; `machine` (launch.config.calibration.Machine) is where it will run, needed only to use a
    calibration (hardware.profile naming a calibration file)."""
    g, hw = layout.grid, layout.hardware
    allowance_fixed = RUNTIME_ALLOWANCE_CPU if hw.device_type == "cpu" else RUNTIME_ALLOWANCE_GPU
    usable = int(hw.memory_bytes * (1 - layout.headroom))
    stages = range(g.pp)
    ranks: list[RankPlan] = []
    for st in stages:
        params, layers = stage_params(layout, st)
        acts = stage_activations(layout, st)
        buf = buffers(layout, params)
        mem = {acc: _memory(layout, params, acc, st, acts, buf, allowance_fixed) for acc in ACCOUNTINGS}
        members = g.stage_span(st)  # a range: a stage of a million ranks is not listed rank by rank
        if g.pp == 1:
            kind = "all ranks"
        else:
            kind = f"pp stage {st}" + (" (first)" if st == 0 else " (last)" if st == g.pp - 1 else "")
        ranks.append(RankPlan(kind, members, st, layers, params, in_flight(layout, st), mem,
                              implementation_accounting(layout), hw.memory_bytes, usable))
    ranks = _merge_identical(ranks)
    timing = layout_timing(layout, machine)
    comm = communication(layout, timing)
    notes = [
        "zero_paper: Rajbhandari et al. 2020 (2 + 2 + 12 B/param, 16-bit); deepspeed: DeepSpeed 0.19.8's "
        "implementation and estimators; megatron: Megatron-Core 0.16.1's DDP and distributed optimizer (the megatron backend's ZeRO-1; "
        "its other stages and the deepspeed backend train through DeepSpeed's ZeRO); torch: PyTorch's DDP and "
        "FSDP2 (fp32 master parameters, gathered units in the compute dtype)",
        f"activations: {layer_name(layout)}, {ATTENTION_NOTE[layout.attention]}"
        + (f" on {sdpa_kernel(layout)}" + (", the K/V heads repeated to every query head before it (it takes no "
                                            "grouped-query attention)" if repeats_kv(layout) else "")
           if layout.attention == "sdpa" else "") + ", "
        f"activation_checkpointing={layout.activation_checkpointing}, sp={layout.sp}",
        f"allowance: {allowance_fixed / GiB:.1f} GiB runtime + {FRAGMENTATION:.0%} fragmentation",
        f"fit check: {implementation_accounting(layout)} accounting against {hw.memory_bytes / GiB:.1f} GiB "
        f"× (1 - headroom {layout.headroom:.0%})",
    ]
    if timing.calibration is not None:
        notes.append(f"time: calibrated on {timing.calibration.machine_kind} at {timing.calibration.created} "
                     f"(hardware.profile is a calibration file)" + (
                         "; on nominal figures, the calls it did not measure: " + "; ".join(timing.why_nominal)
                         if timing.why_nominal else ""))
    elif timing.fitted_on is not None:
        notes.append(f"time: fitted: the compute model on the figures calibrated on {timing.fitted_on.machine_kind} at "
                     f"{timing.fitted_on.created} (GEMM curve, bandwidth, attention) and its collectives' α–β curves "
                     "where it measured the group; its measured passes do not time this layout because "
                     + "; ".join(timing.why_nominal))
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
    if adapters.adapted(layout.peft):
        notes.append(peft_note(layout))
    save = checkpoint_cost(layout, ranks, layout.checkpoint_async)
    # An asynchronous save copies every local rank's part into host memory, where it stays (pinned) between saves.
    staged = save.bytes_held_per_rank if save.asynchronous else 0
    host = host_bytes_per_node(layout, ranks, staged)
    bt = traits(layout.backend)
    builders = (("each local rank's largest tensor whole at a time" if bt.hf_modules else
                 "each local rank's largest tensor or layer whole at a time") + " (a sharded start-up)"
                if bt.host_build == "sharded"
                else "each local rank's largest module at a time (zero.Init)"
                if bt.builds_partitioned(layout.zero_stage, layout.grid.tp)
                else "each local rank's fp32 model built on the host")
    notes.append(f"host check: {host / GiB:.1f} GiB per node = {HOST_BUFFER_FACTOR} × the larger of {builders} and the "
                 f"node's offloaded state (DeepSpeed's estimators)"
                 + (f", or, if more, the latter plus each local rank's asynchronous checkpoint copy "
                    f"({staged / GiB:.1f} GiB)" if staged else "") + ", against "
                 f"{hw.host_memory_bytes / GiB:.0f} GiB × (1 - headroom)")
    notes.append(checkpoint_note(save, layout))
    return Plan(recipe_name, layout.backend, hw.name, g.to_dict(), tuple(ranks), tuple(comm),
                step_time(layout, comm, timing), tuple(notes), host, int(hw.host_memory_bytes * (1 - layout.headroom)),
                save)


def peft_note(layout: Layout) -> str:
    """What the plan of a [peft] fine-tune counts (launch.plan.adapters)."""
    peft, split = layout.peft, adapters.parameter_split(layout.model, layout.peft)
    base = (f"{layout.dtype}, the blocks' linear weights in NF4 ({NF4_BYTES_PER_PARAM:.4f} B a parameter, "
            "bitsandbytes with double quantization)" if peft.method == "qlora" else layout.dtype)
    return (f"fine-tune: peft.method={peft.method}, rank {peft.rank} on {', '.join(peft.target_modules)}: "
            f"{split.trainable:,} trainable parameters ({split.trainable / split.frozen:.2%} of the base's "
            f"{split.frozen:,}), which alone hold gradients, fp32 master and optimizer state and are reduced and saved; "
            f"the frozen base in {base}; model FLOPs 4·N + 6·adapters + attention per token (a frozen matmul makes no "
            "weight gradient)")


def checkpoint_note(save: CheckpointCost, layout: Layout) -> str:
    hw = layout.hardware
    per = "trained parameter (the adapters)" if adapters.adapted(layout.peft) else "parameter"
    head = (f"checkpoint: {save.bytes_total / GiB:.1f} GiB a save ({save.bytes_per_parameter} B per {per}), the "
            f"busiest rank's part {save.bytes_held_per_rank / GiB:.2f} GiB")
    if not hw.checkpoint_write_GBps:
        return head + f"; the {hw.name} profile has no write bandwidth, so no time is planned"
    written = f"written in {save.write_s:.1f} s at {hw.checkpoint_write_GBps:g} GB/s per node"
    if not save.asynchronous:
        return f"{head}; {written}, all of it blocking training (run.checkpoint_async=true blocks only for the copy " \
               "to host memory where the backend has it)"
    return (f"{head}; asynchronous: training blocked {save.blocked_s:.2f} s a save (that part copied to host memory at "
            f"{hw.host_copy_GBps:g} GB/s), the files {written} behind training")


def _memory(layout: Layout, params: int, accounting: str, stage: int, acts: int, buf: int, allowance_fixed: int) -> Memory:
    """One rank's memory in one accounting: the torch backend's step phase by phase where it is planned so (no
    pipeline, nothing offloaded), its peak phase's kinds; otherwise each kind's own peak, added. The allowance is
    computed on what it is added to."""
    w, gr, o, host = model_states(layout, params, accounting, stage)
    if accounting == "torch" and phased(layout):
        phases = torch_phases(layout, params, stage)
        peak = max(phases, key=lambda ph: ph.total)
        return Memory(peak.weights, peak.grads, peak.optimizer, peak.activations, 0,
                      allowance_fixed + int(FRAGMENTATION * peak.total), host,
                      {ph.phase: ph.total for ph in phases}, peak.phase)
    body = w + gr + o + acts + buf
    return Memory(w, gr, o, acts, buf, allowance_fixed + int(FRAGMENTATION * body), host)


def placement_notes(layout: Layout, timing: Timing, comm: list[Comm]) -> list[str]:
    """A TP group that spans nodes, with the numbers: its collectives' time per step on the inter-node link, against
    the same calls inside one node (the grid redrawn as one node of world-size ranks)."""
    g = layout.grid
    if g.tp <= 1 or not g.spans_nodes(g.tp_span(0)):
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



ATTENTION_NOTE = {"sdpa": "fused attention (train.attention=sdpa: scaled_dot_product_attention, no s×s scores kept)",
                  "eager": "unfused attention (train.attention=eager: the s×s softmax kept, fp32 and its cast)",
                  "te": "Transformer Engine's fused attention (train.attention=te, planned as sdpa: no s×s scores "
                        "kept; its layer norms fused into the linear layers that follow)"}


def layer_name(layout: Layout) -> str:
    """The decoder layer the backend trains, whose saved tensors the activation terms count."""
    arch = layout.model.architecture
    if traits(layout.backend).hf_modules:
        return f"Hugging Face {arch} decoder layer (unfused RMSNorm)"
    return f"Megatron-Core GPT layer, local spec ({arch}'s weights)"


def _merge_identical(ranks: list[RankPlan]) -> list[RankPlan]:
    """Middle pipeline stages with identical numbers are shown once, listing all their ranks."""
    out: list[RankPlan] = []
    for rp in ranks:
        prev = out[-1] if out else None
        if (prev and 0 < prev.pp_stage and rp.kind.startswith("pp stage") and "(" not in rp.kind and "(" not in prev.kind
                and prev.memory == rp.memory):
            out[-1] = RankPlan(prev.kind.split(" stage")[0] + f" stages {prev.pp_stage}-{rp.pp_stage}",
                               _joined(prev.ranks, rp.ranks), prev.pp_stage, prev.layers, prev.params,
                               prev.micro_batches_in_flight, prev.memory, prev.implementation,
                               prev.device_memory_bytes, prev.usable_bytes)
        else:
            out.append(rp)
    return out


def _joined(a, b):
    """Two stages' ranks as one: a range where they follow each other (they do: stages are consecutive)."""
    if isinstance(a, range) and isinstance(b, range) and a.step == b.step == 1 and a.stop == b.start:
        return range(a.start, b.stop)
    return tuple(a) + tuple(b)


def plan_resolved(resolved, machine: Machine | None = None) -> Plan:
    return make_plan(Layout.from_resolved(resolved), resolved.recipe_name, machine)
