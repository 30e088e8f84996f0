"""Every collective a step issues on one rank, with its count, message and time: the one model of collectives that
the plan times and the analysis compares with traces."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from launch.config.backends import SELECTIVE_EVERY, traits
from launch.plan.adapters import adapted, adapter_tensors, rank_split
from launch.plan.layout import (
    ZERO0_BUCKET_ELEMENTS,
    ZERO3_MAX_REUSE_DISTANCE,
    Comm,
    Layout,
    bucket,
    int_or,
    megatron_bucket_elements,
    persistence_threshold,
)
from launch.plan.memory import rank_parameters, stage_params, zero3_fetched
from launch.plan.timing import Timing, bus_factor

# --------------------------------------------------------------------------- communication


def _bw(layout: Layout, group: Sequence[int]) -> tuple[str, float, float]:
    """(link, nominal busbw GB/s, nominal latency µs per call) of a group (a range from the grid's *_span: where its
    members sit is arithmetic, whatever its size)."""
    hw, g = layout.hardware, layout.grid
    if not g.spans_nodes(group):
        return "intra_node", hw.intra_node_busbw_GBps, hw.intra_node_latency_us
    return ("inter_node", min(hw.inter_node_busbw_GBps, hw.nic_GBps_per_device * g.ranks_per_node_in(group)),
            hw.inter_node_latency_us)



def _comm(layout: Layout, timing: Timing, par: str, coll: str, group: Sequence[int], calls: int, msg: float,
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
    norms: int = 0  # one norm weight's gradient each (hidden_size values)


def tp_calls(backend: str, *, sp: bool, layers: int, micro_batches: int, activation_checkpointing: str, first_stage: bool = True,
             last_stage: bool = True) -> list[TpCalls]:
    """The collectives tensor (and sequence) parallelism issues per step on one rank of a pipeline stage that
    holds `layers` decoder layers (the embedding on the first stage; output layer and loss on the last): the one
    model the planner times and the report compares traces with (launch/config/backends.py holds each backend's counts
    per micro-batch)."""
    bt = traits(backend)
    tc = bt.tp_sp if sp else bt.tp
    if tc is None:
        raise ValueError(f'backend "{backend}" has no sequence parallelism')
    # A recomputed layer runs its forward collectives again: every layer under full recompute, every SELECTIVE_EVERY-th
    # block under every_other_block; under the torch backend's op policy every layer its all-gathers alone (it keeps
    # the reductions' outputs); Megatron's selective recomputes no collective.
    again = tc.layer_forward if tc.recompute_forward is None else tc.recompute_forward
    if activation_checkpointing == "full":
        recomputed = layers
    elif activation_checkpointing == "every_other_block":
        recomputed = -(-layers // SELECTIVE_EVERY)
    elif activation_checkpointing == "selective" and bt.selective == "op":
        recomputed, again = layers, {"all_gather": tc.layer_forward.get("all_gather", 0)}
    else:
        recomputed = 0
    head = Counter(tc.embedding if first_stage else {}) + Counter(tc.output if last_stage else {})
    loss = tc.loss_all_reduces if last_stage else 0
    logits = tc.logits_all_gathers if last_stage else 0
    norms = tc.norm_grad_all_reduces * (2 * layers + last_stage)
    out = []
    for coll in sorted(set(tc.layer_forward) | set(tc.layer_backward) | set(head)
                       | ({"all_reduce"} if loss or norms else set()) | ({"all_gather"} if logits else set())):
        in_layers = (tc.layer_forward.get(coll, 0) * layers + again.get(coll, 0) * recomputed
                     + tc.layer_backward.get(coll, 0) * layers)
        out.append(TpCalls(coll, in_layers * micro_batches, head.get(coll, 0) * micro_batches,
                           (loss if coll == "all_reduce" else 0) * micro_batches,
                           (logits if coll == "all_gather" else 0) * micro_batches,
                           (norms if coll == "all_reduce" else 0) * micro_batches))
    return out


def communication(layout: Layout, timing: Timing = Timing(), stage: int = 0) -> list[Comm]:
    """Every collective one rank of pipeline stage `stage` calls per optimizer step, with its count, message and
    time: the data-parallel traffic (DeepSpeed's ZeRO under the deepspeed and megatron backends, but Megatron-Core's
    distributed optimizer at the megatron backend's ZeRO-1; DDP or FSDP2 under the torch backend), the TP/SP calls of
    `tp_calls`, and pipeline sends. The one model of collectives: the plan times the first stage's, the analysis
    compares every stage's with the traces (analysis.analyzers.collective_calls.expected_collectives)."""
    g, m, e = layout.grid, layout.model, layout.elem_bytes
    out: list[Comm] = []
    mbs = layout.grad_accum
    params, layers = stage_params(layout, stage)
    # Gradient reductions and the updated partitions' gathers carry what trains (the adapters under [peft]); ZeRO-3's
    # parameter gathers the whole model.
    trained = rank_split(layout, params).trainable
    act = layout.seq_len * layout.micro_batch_size * m.hidden_size * e
    first = g.rank(0, 0, stage)  # the stage's groups are those of its first rank
    if g.dp > 1 and traits(layout.backend).accounting == "torch":
        out.extend(_torch_dp_traffic(layout, timing, g.dp_span(first), stage))
    elif g.dp > 1 and traits(layout.backend).distributed_optimizer(layout.zero_stage):
        out.extend(_megatron_dp_traffic(layout, timing, g.dp_span(first), trained, stage))
    elif g.dp > 1:
        grp = g.dp_span(first)
        z = layout.zero_stage
        if z == 0:
            # The engine's allreduce_gradients buckets by a fixed element count (engine.py), not reduce_bucket_size.
            calls = -(-trained // ZERO0_BUCKET_ELEMENTS)
            out.append(_comm(layout, timing, "dp", "all_reduce", grp, calls, trained * layout.grad_reduce_bytes / calls,
                             f"gradient all-reduce at the accumulation boundary, one call per {ZERO0_BUCKET_ELEMENTS:,} "
                             "elements"))
        elif z in (1, 2):
            reduce_calls = -(-trained // bucket(layout, "reduce_bucket_size"))
            rs_calls = reduce_calls * (mbs if z == 2 else 1)
            out.append(_comm(layout, timing, "dp", "reduce_scatter", grp, rs_calls,
                             trained * layout.grad_reduce_bytes / reduce_calls,
                             "gradient reduce-scatter per reduce bucket " + ("every micro-step (ZeRO-2)" if z == 2 else
                                                                             "at the boundary (ZeRO-1)")))
            # One all_gather_into_tensor per parameter group (runtime/utils.all_gather_dp_groups): one here.
            out.append(_comm(layout, timing, "dp", "all_gather", grp, 1, trained * e, "updated parameter partitions",
                             after_step=True))
        else:
            out.extend(_zero3_traffic(layout, timing, grp, trained, stage))
        # The loop's data-parallel loss mean, and DeepSpeed's gradient norm (its clip_grad_norm_ averages it over the
        # data-parallel group) unless the backend clips itself at this stage (launch.config.backends.StepCollectives).
        norm = z not in traits(layout.backend).step.clip_zero_stages
        out.append(_comm(layout, timing, "dp", "all_reduce", grp, 1 + norm, 4,
                         "one fp32 each: the logged loss mean (the loop)" + (" and the gradient norm (DeepSpeed)" if norm
                                                                             else ""), after_step=True))
    if g.tp > 1:
        grp = g.tp_span(first)
        sb = layout.seq_len * layout.micro_batch_size
        par = "sp" if layout.sp else "tp"
        for c in tp_calls(layout.backend, sp=layout.sp, layers=layers, micro_batches=mbs, activation_checkpointing=layout.activation_checkpointing,
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
            if c.norms and not adapted(layout):  # frozen under [peft]: no norm gradients to sum
                out.append(_comm(layout, timing, par, c.collective, grp, c.norms, 4 * m.hidden_size,
                                 "sequence-parallel norm weights' gradients, one call per norm every micro-batch"))
        out.extend(_torch_norm_calls(layout, timing, first, "tp"))
    if g.pp > 1:
        grp = g.pp_span(0)[:2]  # every boundary moves the same activations
        msg = act / g.tp if layout.sp else act
        # Each of this stage's model chunks (virtual stage k = v·pp + stage) sends to and receives from the virtual
        # stages next to it: per micro-batch and boundary one call forward (activations), one backward (gradients).
        virtual = g.pp * layout.vpp
        ends = sum((k > 0) + (k < virtual - 1) for k in (v * g.pp + stage for v in range(layout.vpp)))
        out.extend(_torch_norm_calls(layout, timing, first, "pp"))
        out.append(_comm(layout, timing, "pp", "send_recv", grp, 2 * mbs * ends, msg,
                         f"activations forward and gradients backward per micro-batch at {ends} chunk boundaries"
                         + ("; under 1F1B a send and a receive posted together wait once (the step's pp time)"
                            if layout.vpp == 1 else "")))
    out.extend(_step_collectives(layout, timing, stage, first, layers))
    return out


def _megatron_dp_traffic(layout: Layout, timing: Timing, grp: Sequence[int], params: int, stage: int) -> list[Comm]:
    # `params`: the stage's parameters that train (the buffers hold only those: the adapters under [peft])
    """Megatron-Core's DDP and distributed optimizer (launch/ranks/trainers/megatron_distopt.py): one reduce-scatter
    per gradient bucket as the last micro-batch's backward finishes it (no_sync holds the others), in the dtype of
    precision.grad_reduce_dtype; one all-gather per bucket of the updated parameters, each dispatched ahead of the
    next forward's use of its bucket (overlap_param_gather). On the first pipeline stage the first model chunk is cut
    into buckets of `megatron_bucket_elements`; every later virtual-stage chunk, and every chunk of a later pipeline
    stage (whose data-parallel traffic is off the critical path, distributed_data_parallel.py), is one bucket. Then
    the loop's loss mean (the clip's gradient norm spans every rank: `_step_collectives`)."""
    first_chunk = -(-params // layout.vpp)
    buckets = (-(-first_chunk // megatron_bucket_elements(layout.grid.dp)) if stage == 0 else 1) + layout.vpp - 1
    reduced = "bf16" if layout.grad_reduce_bytes == 2 else "fp32"
    return [
        _comm(layout, timing, "dp", "reduce_scatter", grp, buckets, params * layout.grad_reduce_bytes / buckets,
              f"Megatron DDP: {reduced} gradients, {buckets} bucket(s) at the last micro-batch, overlapping its "
              "backward"),
        _comm(layout, timing, "dp", "all_gather", grp, buckets, params * layout.elem_bytes / buckets,
              "distributed optimizer: the updated parameters per bucket, ahead of the next forward"),
        _comm(layout, timing, "dp", "all_reduce", grp, 1, 4, "one fp32: the logged loss mean (the loop)",
              after_step=True),
    ]


def _step_collectives(layout: Layout, timing: Timing, stage: int, first: int, layers: int) -> list[Comm]:
    """What the backend itself issues once per step after the micro-batches (launch.config.backends.StepCollectives), on
    pipeline stage `stage` whose first rank is `first`."""
    g, st = layout.grid, traits(layout.backend).step
    distopt = traits(layout.backend).distributed_optimizer(layout.zero_stage)
    # the gradients' element size: the model's dtype, or under Megatron's DDP its buffer's (grad_reduce_dtype)
    e = layout.grad_reduce_bytes if distopt else layout.elem_bytes
    out = []
    if layout.sp and st.sp_norm_grads and not adapted(layout):  # frozen norms under [peft] have no gradients
        # Two norms per decoder layer, and the final norm on the last stage, each of hidden_size weights.
        norms = 2 * layers + (stage == g.pp - 1)
        out.append(_comm(layout, timing, "sp", "all_reduce", g.tp_span(first), 1,
                         norms * layout.model.hidden_size * e, "the sequence-parallel norm weights' gradients summed "
                         "over TP, one coalesced call", after_step=True))
    if distopt and g.world > 1:
        # Megatron's clip: each rank's squares of its gradient shard summed over grad_stats_parallel_group, every rank
        out.append(_comm(layout, timing, "dp", "all_reduce", range(g.world), 1, 4,
                         f"the gradient norm over every rank ({g.world}), one fp32 value (Megatron's clip)",
                         after_step=True))
    if g.tp * g.pp > 1 and layout.zero_stage in st.clip_zero_stages:
        mp = tuple(g.rank(t, 0, p) for p in range(g.pp) for t in range(g.tp))  # `first` has data-parallel rank 0
        out.append(_comm(layout, timing, "tp", "all_reduce", mp, 1, 8,
                         f"the gradient norm over TP × PP ({len(mp)} ranks), one fp64 value (the backend clips)",
                         after_step=True))
    if g.pp > 1 and st.pp_loss_broadcast:
        out.append(_comm(layout, timing, "pp", "broadcast", g.pp_span(first), 1, 4,
                         "the logged loss, from the last stage to the pipeline group", after_step=True))
    return out




# torch DDP's bucket caps (torch/nn/parallel/distributed.py): the first bucket is small so that the first all-reduce
# starts early in the backward; later ones hold bucket_cap_mb=25 MiB of gradients.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ddp_buckets(tensors: list[int], elem_bytes: int = 4) -> list[int]:
    """Bytes of each DDP reduce bucket: gradients taken in reverse parameter order (the order the backward makes them),
    a bucket closing once it reaches its cap (torch's _compute_bucket_assignment_by_size)."""
    out, size = [], 0
    for n in reversed(tensors):
        size += n * elem_bytes
        if size >= (DDP_FIRST_BUCKET_BYTES if not out else DDP_BUCKET_BYTES):
            out.append(size)
            size = 0
    return out + ([size] if size else [])


def _torch_dp_traffic(layout: Layout, timing: Timing, grp: Sequence[int], stage: int) -> list[Comm]:
    """The torch backend over the data-parallel group (counted in traces: tests/dist/test_torch_collectives.py). DDP:
    one all-reduce per bucket of gradients (precision.grad_reduce_dtype) at the last micro-batch (the others run under
    no_sync). FSDP2, every
    micro-batch: one all-gather per unit (each decoder block and the root) before its forward, again before its
    backward at stage 3, and one fp32 reduce-scatter per unit after its backward. Then the loop's loss mean and the
    gradient norm's reductions (`_torch_norm_calls`)."""
    g, e, mbs, layers = layout.grid, layout.elem_bytes, layout.grad_accum, layout.model.num_layers // layout.grid.pp
    grb = layout.grad_reduce_bytes
    reduced_dtype = "bf16" if grb == 2 else "fp32"
    tensors = rank_parameters(layout, stage)
    params = sum(tensors)
    # What trains: every parameter, or under [peft] the adapters alone (DDP buckets only parameters that need a
    # gradient; FSDP2 reduce-scatters a unit's gradients, and the root unit, all frozen then, has none).
    trained = adapter_tensors(layout, stage) if adapted(layout) else tensors
    out = []
    if layout.zero_stage == 0:
        sizes = ddp_buckets(trained)
        # buckets are cut by the fp32 gradients' bytes; the bf16 compression hook (grad_reduce_dtype) halves each call
        out.append(_comm(layout, timing, "dp", "all_reduce", grp, len(sizes), sum(sizes) / len(sizes) * grb / 4,
                         f"DDP: {reduced_dtype} gradients, {len(sizes)} bucket(s) at the last micro-batch, overlapping "
                         "the backward"))
    else:
        # Roots with parameters: one without a pipeline; with one, the parts of this stage that hold the embedding
        # (virtual stage 0) or the output layer (the last virtual stage).
        virtual = [v * g.pp + stage for v in range(layout.vpp)]
        roots = 1 if g.pp == 1 else sum(k in (0, g.pp * layout.vpp - 1) for k in virtual)
        units = layers + roots
        reduced_units = layers if adapted(layout) else units
        z3 = layout.zero_stage == 3
        if g.pp == 1:
            gathers, scatters = mbs * units * (2 if z3 else 1), mbs * reduced_units
            how = (f"FSDP2: each of {layers} blocks and the root before its forward"
                   + (", each again before its backward" if z3 else "") + " every micro-batch")
            reduced = "every micro-batch"
        else:
            # torch.distributed.pipelining keeps gradients unreduced and parameters gathered from the first backward
            # to the last (set_requires_gradient_sync, set_reshard_after_backward).
            gathers, scatters = units * (mbs + 1 if z3 else 1), reduced_units
            how = (f"FSDP2 under the pipeline: each of {units} units before each micro-batch's forward and once more "
                   "for the backwards" if z3 else f"FSDP2 under the pipeline: each of {units} units once, at the first "
                   "forward")
            reduced = "at the last micro-batch"
        hybrid = layout.hpz
        shard_grp = grp[:hybrid] if hybrid > 1 else grp  # the data-parallel group's first shard group
        whole = params + (sum(trained) if adapted(layout) else 0)  # the units gathered: with their adapters
        per_unit_grads = sum(trained) / reduced_units
        out.append(_comm(layout, timing, "dp", "all_gather", shard_grp, gathers, e * whole / units, how))
        out.append(_comm(layout, timing, "dp", "reduce_scatter", shard_grp, scatters, grb * per_unit_grads,
                         f"FSDP2: {reduced_dtype} gradients, one call per unit after its backward, {reduced}"))
        if hybrid > 1:
            out.append(_comm(layout, timing, "dp", "all_reduce", grp[::hybrid], scatters, grb * per_unit_grads / hybrid,
                             f"hybrid sharding: each reduced shard all-reduced across the {len(grp) // hybrid} "
                             f"replicas, {reduced}"))
    out.append(_comm(layout, timing, "dp", "all_reduce", grp, 1, 4, "one fp32: the logged loss mean (the loop)",
                     after_step=True))
    if layout.dtype == "fp16" and layout.zero_stage > 0:
        # ShardedGradScaler.unscale_, per optimizer (one per model part): DTensor's unscale kernel reduces the
        # found-inf flag over the gradients' mesh, then unscale_ all-reduces it over dp (counted by the rehearsal).
        out.append(_comm(layout, timing, "dp", "all_reduce", grp, 2 * layout.vpp, 4,
                         "fp16: ShardedGradScaler's found-inf flag, twice per optimizer", after_step=True))
    return out + _torch_norm_calls(layout, timing, g.rank(0, 0, stage), "dp")


def _torch_norm_calls(layout: Layout, timing: Timing, first: int, over: str) -> list[Comm]:
    """The torch backend's gradient norm: each mesh's partial norm reduced over each of its sharded dimensions
    (DTensor.full_tensor, one fp32 call per dimension). FSDP2 shards over dp; TP puts every TP'd parameter on the
    dp × tp mesh, and without SP the norms stay on the dp mesh alone, a second call over dp. DDP's are whole."""
    g = layout.grid
    if traits(layout.backend).accounting != "torch" or layout.zero_stage == 0:
        return []
    if over == "tp":
        return [_comm(layout, timing, "tp", "all_reduce", g.tp_span(first), 1, 4,
                      "the gradient norm's partial sum over TP", after_step=True)] if g.tp > 1 else []
    if over == "pp":
        return [_comm(layout, timing, "pp", "all_reduce", g.pp_span(first), 1, 4,
                      "the gradient norm's squares summed over the pipeline stages", after_step=True)] if g.pp > 1 else []
    calls = 1 + (g.tp > 1 and not layout.sp)
    grp = g.dp_span(first)[:layout.hpz] if layout.hpz > 1 else g.dp_span(first)  # hybrid: the shard group's only
    # get_total_norm reduces every gradient tensor's partial norm, one fp32 each, in one call per mesh.
    stage = g.coords(first)[2]
    tensors = len(adapter_tensors(layout, stage) if adapted(layout) else rank_parameters(layout, stage))
    return [_comm(layout, timing, "dp", "all_reduce", grp, calls, 4 * tensors / calls,
                  "the gradient norm's partial sums over dp" + (", one per mesh" if calls > 1 else ""),
                  after_step=True)] if g.dp > 1 else []


def _zero3_traffic(layout: Layout, timing: Timing, grp: Sequence[int], trained: int, stage: int) -> list[Comm]:
    """DeepSpeed ZeRO-3 (partition_parameters.py, stage3.py; counted in traces of 0.19.8 on gloo): parameters at or
    below stage3_param_persistence_threshold stay whole and are re-gathered one call each after every optimizer step;
    the others are gathered one call each before their module's forward in every micro-step, and again before its
    backward when the stage holds more than stage3_max_reuse_distance parameters (otherwise they are still there);
    gradients (`trained`: of the parameters that train) leave in one reduce-scatter per bucket per micro-step."""
    zo, e, mbs = layout.ds_zero, layout.elem_bytes, layout.grad_accum
    threshold = persistence_threshold(layout)
    tensors = rank_parameters(layout, stage)
    persistent = [n for n in tensors if n <= threshold]
    fetched = zero3_fetched(layout, stage)
    params = sum(tensors)
    out = []
    if fetched:
        again = params > int_or(zo.get("stage3_max_reuse_distance"), ZERO3_MAX_REUSE_DISTANCE)
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
    reduce_calls = -(-trained // bucket(layout, "reduce_bucket_size"))
    out.append(_comm(layout, timing, "dp", "reduce_scatter", grp, mbs * reduce_calls,
                     trained * layout.grad_reduce_bytes / reduce_calls,
                     "ZeRO-3: gradients every micro-step, one call per reduce bucket"))
    if persistent:
        out.append(_comm(layout, timing, "dp", "all_gather", grp, len(persistent), e * sum(persistent) / len(persistent),
                         f"ZeRO-3: the {len(persistent)} persistent parameters (<= {threshold:,} elements), one gather "
                         "each after the optimizer step", after_step=True))
    return out



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

