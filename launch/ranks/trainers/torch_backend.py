"""Torch-native backend: PyTorch's own DDP, FSDP2 (`fully_shard`) and DTensor tensor + sequence parallelism on a
Hugging Face causal LM, composed the way torchtitan's `parallelize_llama` composes them. No DeepSpeed.

Parallelism is applied one function per dimension, in this order, from the rank grid in resolved.json:
  1. `_mesh`: the device mesh ("pp", "dp", "tp"), laid out in the grid's rank order (tp fastest), so the loop's
     data-parallel coordinates hold;
  2. `_split_pp`: with pipelining, this rank's chunks (one per virtual stage) under the model's own parameter names;
     each chunk then takes the dimensions below as a whole model would, and `_pipeline` runs them with
     torch.distributed.pipelining (1F1B, interleaved 1F1B with parallel.vpp > 1);
  3. `_apply_tp`: tensor (+ sequence) parallelism, torchtitan's Llama plan through `parallelize_module`; the output
     layer keeps its logits split over the vocabulary and the loss is computed in `loss_parallel`;
  4. `_apply_ac`: activation checkpointing, each chosen block wrapped in `checkpoint_wrapper`: `full` (every block),
     `selective` (torchtitan's op policy on every block: `op_policy`) or `every_other_block` (torchtitan's layer
     policy with n = 2, SELECTIVE_EVERY);
  5. `_apply_compile`: every block compiled in place (`Module.compile`), so parameter names, and with them
     checkpoints, are the eager model's;
  6. `_apply_dp`: zero_stage 0 torch DDP (bucketed all-reduce overlapped with the backward), 2 FSDP2 keeping the
     gathered parameters from forward to backward (`reshard_after_forward=False`), 3 FSDP2 full sharding, or with
     parallel.zero_hpz_partition_size > 1 hybrid sharding (shard within groups of that many, replicate across).

Steps 2-6 apply to a skeleton on the meta device (DDP wraps the materialised model afterwards). Each rank then allocates
only its own shards and fills them from the starting weights (the recipe's, or the seeded random init every backend
starts from), which it makes itself one whole tensor at a time (common.initial_tensors): no rank ever holds the whole
model, and nothing is sent.

Checkpoints are `torch.distributed.checkpoint` folders of the sharded model and AdamW state: they load onto any
tp, pp, dp or zero stage of this backend (DCP reshards), every tensor's shape checked first.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from launch.config import adapters as config_adapters
from launch.config.backends import SELECTIVE_EVERY
from launch.config.resolve import Resolved
from launch.config.schema import ADAM_EPS
from launch.plan.memory import chunk_layers
from launch.torchtools.hf import hf_config
from launch.ranks.trainers import adapters, common
from launch.ranks.trainers.protocol import BuildContext, StepOutput
from launch.torchtools.untrusted import (
    DCP_METADATA,
    DCP_MODEL_KEY,
    DCP_MODEL_PREFIX,
    UntrustedFileError,
    dcp_reader,
    mismatch_text,
    read_dcp_metadata,
    shape_mismatches,
)
from launch.run.checkpoints import Checkpoint, ResumeError
from launch.run.rundir import RECOMPUTE_REGION


def init_distributed(resolved: Resolved, cuda: bool) -> None:
    common.init_process_group(cuda, resolved.recipe.run.timeout_s, deepspeed_comm=False)


def _mesh(resolved: Resolved, cuda: bool):
    """The grid as a DeviceMesh: row-major over (pp, dp, tp) is the grid's tp-fastest order (launch/config/grid.py).
    Hybrid sharding splits dp into ("dp_replicate", "dp_shard"), the shard groups of consecutive data-parallel ranks,
    and names their product "dp" again."""
    from torch.distributed.device_mesh import init_device_mesh

    g, hybrid = resolved.grid, resolved.recipe.parallel.zero_hpz_partition_size
    device = "cuda" if cuda else "cpu"
    if hybrid == 1:
        return init_device_mesh(device, (g.pp, g.dp, g.tp), mesh_dim_names=("pp", "dp", "tp"))
    mesh = init_device_mesh(device, (g.pp, g.dp // hybrid, hybrid, g.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def _layers(part) -> dict:
    """A model part's decoder blocks by their index in the whole model: the Hugging Face model's ModuleList, or a
    pipeline chunk's ModuleDict (keyed by that index, so that parameter names stay the model's)."""
    layers = part.model.layers
    return {int(k): v for k, v in layers.items()} if isinstance(layers, torch.nn.ModuleDict) else dict(enumerate(layers))


def _set_layer(part, index: int, module) -> None:
    layers = part.model.layers
    layers[str(index) if isinstance(layers, torch.nn.ModuleDict) else index] = module


class _Chunk(torch.nn.Module):
    """One pipeline chunk of a Hugging Face causal LM under the model's own parameter names (model.embed_tokens,
    model.layers.<i>, model.norm, lm_head: checkpoints of every pipeline layout are interchangeable), as torchtitan
    splits its models: the first chunk keeps the embedding, the last the final norm and the output layer."""

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = torch.nn.Module()
        inner.embed_tokens = model.model.embed_tokens if first else None
        inner.layers = torch.nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        inner.norm = model.model.norm if last else None
        inner.rotary_emb = model.model.rotary_emb
        self.model = inner
        self.lm_head = model.lm_head if last else None
        self.config = model.config
        self.positions = self.mask = None  # set by the trainer once they exist on the device

    def forward(self, x):
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        rope = self.model.rotary_emb(h, self.positions)
        for layer in self.model.layers.values():
            out = layer(h, attention_mask=self.mask, position_ids=self.positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.model.norm(h)) if self.lm_head is not None else h


def _split_pp(model, resolved: Resolved, pp_rank: int) -> list:
    """This rank's chunks: one per virtual stage v·pp + pp_rank, each holding that virtual stage's blocks (the
    planner's launch.plan.memory.chunk_layers, Megatron's interleaved assignment)."""
    par = resolved.recipe.parallel
    virtual = par.pp * par.vpp
    return [_Chunk(model, layers, first=v * par.pp + pp_rank == 0, last=v * par.pp + pp_rank == virtual - 1)
            for v, layers in enumerate(chunk_layers(resolved.model.num_layers, par.pp, par.vpp, pp_rank))]


def _apply_tp(part, tp_mesh, sp: bool) -> None:
    """torchtitan's Llama plan on Hugging Face module names. With SP the residual stream between blocks is split
    along the sequence (Shard(1)), the norms run on their shard, and attention and MLP gather it on entry. The output
    layer leaves its logits split over the vocabulary (as a local shard: TorchTrainer._cross_entropy wraps it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sp else Replicate()
    top = {}
    if part.model.embed_tokens is not None:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if part.lm_head is not None:
        top["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1))
        if sp:
            top["model.norm"] = SequenceParallel()
    if top:
        parallelize_module(part, tp_mesh, top)
    for layer in _layers(part).values():
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=between),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=between)}
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                # Hugging Face's decoder layer passes the attention input by keyword, the MLP's by position.
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(layer, tp_mesh, plan)
    if part.config.tie_word_embeddings and part.lm_head is not None and part.model.embed_tokens is not None:
        # parallelize_module replaced each module's parameter on its own; both are Shard(0) over the vocabulary.
        part.lm_head.weight = part.model.embed_tokens.weight


def op_policy():
    """torchtitan's selective op policy (its `_op_sac_save_list` and `_custom_policy`): a checkpointed block keeps the
    outputs of its matmuls but every second one, of attention and of the collectives that reduce (so the backward
    never repeats a reduction); everything else (norms, RoPE, SwiGLU's elementwise ops, the other matmuls, the
    all-gathers of sequence parallelism) is recomputed. `_scaled_dot_product_flash_attention_for_cpu` is the CPU
    ranks' attention kernel; `all_reduce` is what TP without sequence parallelism reduces with (torchtitan always
    runs SP). A fresh count per checkpoint context, the forward's and the recomputation's apart."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy

    ops = torch.ops.aten
    save = {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention.default, ops._scaled_dot_product_cudnn_attention.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_reduce.default,
            ops.max.default}
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == ops.mm.default:
            meta[key] += 1
        keep = func in save and not (func == ops.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Both:
    """Two context managers entered as one (the op policy's recompute context inside the named range)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


def _apply_ac(part, mode: str, marked: bool, cuda: bool, random: bool = False) -> None:
    """Checkpoint every block ("full"), every block under the op policy ("selective"), or every SELECTIVE_EVERY-th
    ("every_other_block"); `marked`: each recomputation runs inside the named range RECOMPUTE_REGION, which the
    traces show (not under train.compile: Dynamo traces no context function but selective checkpointing's);
    `random`: the blocks draw random numbers ([peft]'s adapter dropout), which the recomputation must draw again
    exactly (the base model has no dropout, so its blocks skip saving the generators' state)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "none":
        return

    def context():
        forward, recompute = (create_selective_checkpoint_contexts(op_policy()) if mode == "selective"
                              else (contextlib.nullcontext(), contextlib.nullcontext()))
        return forward, (_Both(common.region(RECOMPUTE_REGION, cuda), recompute) if marked else recompute)

    # Under train.compile a context function must return dispatch modes (the op policy's); the named range is not one.
    kw = {"context_fn": context} if mode == "selective" or marked else {}
    every = SELECTIVE_EVERY if mode == "every_other_block" else 1
    for i, layer in _layers(part).items():
        if i % every == 0:
            _set_layer(part, i, checkpoint_wrapper(layer, preserve_rng_state=random, **kw))


def _apply_compile(part, on: bool) -> None:
    if on:
        for layer in _layers(part).values():
            layer.compile()


def _apply_dp(part, mesh, resolved: Resolved, cuda: bool) -> None:
    """FSDP2 over the data-parallel mesh (each block, then the part); DDP is applied after loading (`_wrap_ddp`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    par, dtype = resolved.recipe.parallel, common.torch_dtype(resolved.recipe.precision.dtype)
    if par.zero_stage == 0:
        return
    # hybrid sharding: a 2-D mesh, FSDP2 shards over its second dimension and replicates over its first
    dp_mesh = mesh["dp_replicate", "dp_shard"] if par.zero_hpz_partition_size > 1 else mesh["dp"]
    kw = {"mesh": dp_mesh, "reshard_after_forward": par.zero_stage == 3}
    if dtype != torch.float32:
        reduce = common.torch_dtype(resolved.recipe.precision.grad_reduce_dtype)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
    if par.offload_params != "none":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    for layer in _layers(part).values():
        fully_shard(layer, **kw)
    fully_shard(part, **kw)


def _bf16_all_reduce(group, bucket):
    """precision.grad_reduce_dtype=bf16 under DDP: the bucket's fp32 gradients (DDP's autocast keeps fp32 parameters)
    averaged in bf16, then copied back; torch's own bf16_compress_hook does the same but runs only over NCCL."""
    grads = bucket.buffer()
    compressed = grads.to(torch.bfloat16).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def back(_):
        return grads.copy_(compressed)

    return work.get_future().then(back)


def _wrap_ddp(model, mesh, cuda: bool, local_rank: int, **rehearsal):
    """`rehearsal`: DistributedDataParallel's own keywords, which launch.ranks.rehearse sets where fake tensors need."""
    from torch.nn.parallel import DistributedDataParallel

    # A frozen parameter ([peft]'s base) is left to itself: every rank built the same values, so DDP's start-up
    # broadcast of a whole base from rank 0 would move the model's bytes for nothing (and a 4-bit weight's scales
    # live beside its tensor, where no broadcast reaches).
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, p in model.named_parameters() if not p.requires_grad])
    # Gradients as views of the reduce buckets: one copy of them, not two.
    # No buffer broadcast before every forward: the only buffers are the rotary frequencies, equal on every rank.
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group(), gradient_as_bucket_view=True,
                                   broadcast_buffers=False, device_ids=[local_rank] if cuda else None, **rehearsal)


def _skeleton(resolved: Resolved):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(resolved.model), dtype=torch.float32,
                                                 attn_implementation=resolved.recipe.train.attention)
    model.config.use_cache = False
    return model


def allocate(part, device) -> None:
    """This rank's shards of `part`, unfilled, and the non-persistent buffers (the rotary frequencies), which no state
    dict carries, recomputed."""
    from torch.distributed.fsdp import FSDPModule

    with adapters.quantized_kept(part):
        part.to_empty(device=device)
    if part.config.tie_word_embeddings and not isinstance(part, FSDPModule):
        # to_empty gives plain (not FSDP2-managed) tied parameters two storages: tie them again. This part is the
        # whole Hugging Face model: the resolver refuses tied embeddings with a pipeline.
        part.tie_weights()
    rotary = part.model.rotary_emb
    with torch.device("cpu"):
        fresh = type(rotary)(part.config)
    for name, buf in fresh.named_buffers():
        rotary.get_buffer(name).copy_(buf)


def _materialise(parts: list, resolved: Resolved, device, progress: Callable[[int, int], None]) -> None:
    """Allocate this rank's shards and fill each from its parameter's whole tensor, which every rank makes (reads or
    seeds: common.initial_tensors) one tensor at a time, concurrently, with no collective: no rank holds the whole
    model, and nothing waits on a rank that builds. `progress(done, total)` after each tensor."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor, distribute_tensor

    for part in parts:
        allocate(part, device)
    # The model's own names (a checkpointed block's parameters carry its wrapper's prefix, a weight peft wraps its
    # base_layer; a tied lm_head is listed once, under its embedding's name), with the part and name that hold them
    mine = {config_adapters.base_name(name.replace(_CHECKPOINT_PREFIX, "")): (part, name, p)
            for part in parts for name, p in part.named_parameters()}
    filled: set[str] = set()
    total = len(resolved.model.parameters()) + len(config_adapters.adapter_parameters(resolved.model,
                                                                                       resolved.recipe.peft))
    with torch.no_grad():
        starting = itertools.chain(common.initial_tensors(resolved), adapters.initial_tensors(resolved))
        for seen, (name, whole) in enumerate(starting, 1):
            if name in mine:
                part, held, p = mine[name]
                if adapters.is_quantized(p):  # QLoRA: quantized to NF4 from the whole tensor, on the device
                    adapters.fill_quantized(part, held, whole, device)
                else:
                    whole = whole.to(device)
                    if isinstance(p, DTensor):  # this rank's shard, cut from the whole tensor here (src_data_rank=None)
                        whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    _local(p).copy_(whole)
                filled.add(name)
            progress(seen, total)  # every tensor passes every rank, its own or not (a pipeline stage keeps some)
    if set(mine) - filled:  # to_empty's garbage must never train
        raise RuntimeError(f"the start-up left {sorted(set(mine) - filled)[:3]} unfilled")


class TorchTrainer:
    def __init__(self, ctx: BuildContext) -> None:
        resolved, par, train = ctx.resolved, ctx.resolved.recipe.parallel, ctx.resolved.recipe.train
        self.resolved, self.cuda, self.device = resolved, ctx.cuda, ctx.device
        self.dtype = common.torch_dtype(resolved.recipe.precision.dtype)
        self.mesh = _mesh(resolved, ctx.cuda)
        pp_rank = self.mesh["pp"].get_local_rank()
        model = _skeleton(resolved)
        adapters.apply(model, resolved)  # [peft]: before any parallelism, which then takes the adapters as its own
        # Counting is a Python side effect inside each block: compiled, it would break the graphs of checkpointed blocks.
        self.layer_calls = [] if train.compile else common.count_layer_calls(model)
        # The pipeline split comes first: each of this rank's chunks then takes the dimensions below as a model would.
        parts = _split_pp(model, resolved, pp_rank) if par.pp > 1 else [model]
        for part in parts:
            if par.tp > 1:
                _apply_tp(part, self.mesh["tp"], par.sp)
            _apply_ac(part, train.activation_checkpointing, marked=not train.compile, cuda=ctx.cuda,
                      random=config_adapters.draws_random(resolved.recipe.peft))
            _apply_compile(part, train.compile)
            _apply_dp(part, self.mesh, resolved, ctx.cuda)
        self._progress = common.StartupProgress(ctx.watchdog, "every rank cuts its shards")
        with common.model_build(ctx.run, ctx.env.rank):  # the meta skeleton costs nothing; this is where memory comes
            self.materialise_parts(parts, torch.device("cpu") if par.offload_params != "none" else ctx.device)
        for part in parts:
            part.train()  # transformers builds models in eval mode
        self.parts = parts
        self.decoder_layers = [layer for part in parts for layer in _layers(part).values()]
        self.ddp = par.zero_stage == 0 and resolved.grid.dp > 1  # the resolver refuses DDP with TP or PP
        self.model = self.wrap_ddp(parts[0], ctx.env.local_rank) if self.ddp else parts[0]
        dp_mesh = self.mesh["dp"]
        self.dp_rank, self.dp_world = dp_mesh.get_local_rank(), dp_mesh.size()
        self.dp_group = dp_mesh.get_group() if self.dp_world > 1 else None
        self.param_numel_local = sum(_local(p).numel() for part in parts for p in part.parameters())
        # One AdamW per part (torchtitan's): each part's state dict names its own parameters. On GPUs the fused kernel
        # (one launch for all of a part's parameters, torchtitan's default); on CPU ranks and offloaded, foreach.
        fused = ctx.cuda and par.offload_params == "none"
        self.optimizers = [torch.optim.AdamW([p for p in part.parameters() if p.requires_grad], lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                             eps=ADAM_EPS, weight_decay=train.weight_decay,
                                             **({"fused": True} if fused else {"foreach": True}))
                           for part in parts]
        self.scaler = None
        if self.dtype == torch.float16:  # the T4 has no bf16: loss scaling, sharded where the gradients are
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            device_type, scale = ctx.device.type, 2.0 ** resolved.recipe.precision.initial_loss_scale_power
            self.scaler = (torch.amp.GradScaler(device_type, init_scale=scale) if par.zero_stage == 0
                           else ShardedGradScaler(device_type, init_scale=scale, process_group=dp_mesh.get_group()))
        seq = resolved.recipe.batch.seq_len
        self.positions = torch.arange(seq, device=ctx.device).unsqueeze(0)
        self.compile_pending = train.compile
        # The vocabulary-split cross entropy's forward and backward run DTensor's loss_parallel handlers; they are
        # installed for the trainer's life (they apply to DTensor log-softmax and NLL only, which nothing else here
        # calls), so that the backward of `loss()` works wherever its caller runs it (launch calibrate).
        self._contexts = contextlib.ExitStack()
        if par.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            self._contexts.enter_context(loss_parallel())
        # Eager attention takes a materialised causal mask, which Hugging Face sizes from the embedding's output: under
        # SP that is the local sequence shard, while attention runs on the whole sequence. A 4-D mask of the whole
        # sequence is used as given. SDPA needs none: it runs causal on what it sees.
        self.mask = None
        if train.attention == "eager":
            self.mask = torch.full((seq, seq), torch.finfo(torch.float32).min, device=ctx.device).triu(1)[None, None]
        self.schedule = self._pipeline(pp_rank) if par.pp > 1 else None
        # A checkpoint thread's collectives must not share training's group: save_async makes one of their own.
        self.checkpoint_group = None  # save_async's, made at the first save (every rank saves at the same step)
        self.stager = None  # DCP's default: unpinned host copies
        if resolved.recipe.run.checkpoint_async and ctx.cuda:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Pinned host buffers, kept from one save to the next (torchtitan's async_with_pinned_mem): the copy runs at
            # PCIe speed, which is what the plan's host_copy_GBps assumes. Held for the run's life.
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=False))
        self._alone = False  # loss() has set FSDP2 to compute without data-parallel traffic
        self.checkpointed = _checkpointed(resolved)

    def materialise_parts(self, parts: list, device) -> None:
        """The seam between the build and its memory: launch.ranks.rehearse allocates the parts as fake tensors here
        instead, after the same parallelisation."""
        _materialise(parts, self.resolved, device, self._progress)

    def wrap_ddp(self, part, local_rank: int):
        """The seam where DDP takes the model: launch.ranks.rehearse wraps it without the start-up's value checks,
        which fake tensors cannot answer."""
        ddp = _wrap_ddp(part, self.mesh, self.cuda, local_rank)
        if self.resolved.recipe.precision.grad_reduce_dtype == "bf16":
            ddp.register_comm_hook(self.mesh["dp"].get_group(), _bf16_all_reduce)
        return ddp

    def _pipeline(self, pp_rank: int):
        """torch.distributed.pipelining over this rank's chunks: 1F1B, interleaved 1F1B with parallel.vpp > 1. The
        schedule splits the step's rows into grad_accum micro-batches, the ones the loop would give one by one, and
        scales each micro-batch's gradients by 1/grad_accum."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        par = self.resolved.recipe.parallel
        group = self.mesh["pp"].get_group()
        stages = []
        for v, part in enumerate(self.parts):
            part.positions, part.mask = self.positions, self.mask
            stages.append(PipelineStage(part, v * par.pp + pp_rank, par.pp * par.vpp, self.device, group=group))
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)
        ga = self.resolved.grad_accum
        if par.vpp > 1:
            return ScheduleInterleaved1F1B(stages, n_microbatches=ga, loss_fn=self._cross_entropy)
        return Schedule1F1B(stages[0], n_microbatches=ga, loss_fn=self._cross_entropy)

    def set_lr(self, lr: float) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def _autocast(self):
        # FSDP2 casts the parameters itself (MixedPrecisionPolicy); DDP trains fp32 parameters under autocast.
        if self.dtype != torch.float32 and self.resolved.recipe.parallel.zero_stage == 0:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def _cross_entropy(self, logits, rows):
        """Next-token cross entropy over positions 0..s-2 (Hugging Face's shift). Under TP the logits are this rank's
        vocabulary shard, wrapped as a DTensor for loss_parallel."""
        if self.resolved.grid.tp > 1:
            from torch.distributed.tensor import DTensor, Shard

            logits = DTensor.from_local(logits, self.mesh["tp"], [Shard(-1)])
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), rows[:, 1:].flatten())

    def _loss(self, model, rows):
        """Positions are passed explicitly: under SP the model would take them from its local sequence shard."""
        with self._autocast():
            logits = model(input_ids=rows, position_ids=self.positions, attention_mask=self.mask).logits
        return self._cross_entropy(logits, rows)

    def train_step(self, micro_batch: Callable) -> StepOutput:
        cuda = self.cuda
        losses = self._pipelined(micro_batch) if self.schedule is not None else self._accumulated(micro_batch)
        scaled = None
        with common.region("optimizer", cuda):
            if self.scaler is not None:
                for optimizer in self.optimizers:
                    self.scaler.unscale_(optimizer)
            norm = self._clip()
            for optimizer in self.optimizers:
                if self.scaler is not None:
                    self.scaler.step(optimizer)
                else:
                    optimizer.step()
                # DDP keeps its gradients as views of the reduce buckets, which live on whatever is done here.
                optimizer.zero_grad(set_to_none=not self.ddp)
            if self.scaler is not None:
                # The scaler skips the optimizer step when the scaled gradients held an inf or NaN (agreed over the
                # data-parallel group: DDP's reduced gradients, ShardedGradScaler's all-reduce), and only then does
                # update() lower the scale (backoff 0.5; growth doubles it, after 2000 clean steps): a scale that
                # dropped is a skipped step. Two host syncs per step, fp16 only.
                scale = self.scaler.get_scale()
                self.scaler.update()
                scaled = (scale, self.scaler.get_scale() < scale)
        if self.compile_pending:  # after the first step has compiled every block: say what was compiled, in the rank log
            from torch._dynamo.utils import counters

            self.compile_pending = False
            breaks = counters["graph_break"]
            print(f"torch.compile: {counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks"
                  + "".join(f"\n  graph break ×{n}: {why}" for why, n in breaks.items()), flush=True)
        loss = torch.stack(losses).mean()
        return StepOutput(loss, norm) if scaled is None else StepOutput(loss, norm, *scaled)

    def _accumulated(self, micro_batch: Callable) -> list:
        """Without pipelining: forward and backward of each micro-batch in turn (DDP reduces at the last)."""
        return [self.micro_step(micro_batch(micro), micro) for micro in range(self.resolved.grad_accum)]

    def micro_step(self, rows, micro: int):
        """Forward and backward of the step's micro-batch `micro` (launch.ranks.rehearse runs them one by one)."""
        ga, cuda = self.resolved.grad_accum, self.cuda
        sync = self.model.no_sync() if self.ddp and micro < ga - 1 else contextlib.nullcontext()
        with sync:
            with common.region("forward", cuda):
                loss = self._loss(self.model, rows)
            with common.region("backward", cuda):
                scaled = loss / ga
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return _local(loss.detach()).float()  # a replicated DTensor under loss_parallel

    def _pipelined(self, micro_batch: Callable) -> list:
        """The step's micro-batches through the schedule; the last stage's mean loss goes to every stage (the loop
        logs it on every rank)."""
        rows = torch.cat([micro_batch(i) for i in range(self.resolved.grad_accum)])
        losses: list = []
        with common.region("forward-backward", self.cuda):
            self.schedule.step(*((rows,) if self.first else ()),
                               **({"target": rows, "losses": losses} if self.last else {}))
        pp = self.mesh["pp"]
        loss = (torch.stack([_local(x.detach()).float() for x in losses]).mean() if self.last
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, group=pp.get_group(), group_src=pp.size() - 1)
        return [loss]

    def _params(self):
        return [p for part in self.parts for p in part.parameters()]

    def _clip(self) -> float:
        return float(self.clipped_norm())

    def clipped_norm(self):
        """The whole gradient's L2 norm, then clipping to train.grad_clip; the norm stays a tensor (no host sync:
        launch.ranks.rehearse runs this on fake tensors). Gradients live on different meshes (with TP but no SP the
        norms' are sharded over dp alone, the rest over dp × tp): each mesh's norm is reduced over it, the parts are
        combined, and with pipelining the stages' squares are summed over pp."""
        from torch.distributed.tensor import DTensor

        by_mesh: dict = {}
        for p in self._params():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        parts = []
        for params in by_mesh.values():
            part = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
            parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
        squares = torch.stack(parts).float().pow(2).sum() if parts else torch.zeros((), device=self.device)
        if self.schedule is not None:
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        norm = squares.sqrt()
        clip = self.resolved.recipe.train.grad_clip
        if clip > 0:
            for params in by_mesh.values():  # foreach kernels take one mesh at a time
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        return norm

    def evaluate(self, micro_batch: Callable, count: int):
        """Forward only under no_grad; with pipelining, the schedule's eval() one global batch (its grad_accum
        micro-batches, the shapes its stages were built for) at a time."""
        with torch.no_grad(), common.evaluating(self.parts):
            if self.schedule is None:
                return torch.stack([_local(self._loss(self.model, micro_batch(i))).float() for i in range(count)]).mean()
            ga, losses = self.resolved.grad_accum, []
            for first in range(0, count, ga):
                rows = torch.cat([micro_batch(first + i) for i in range(ga)])
                batch: list = []  # the schedule clears the list it is given at every call
                self.schedule.eval(*((rows,) if self.first else ()),
                                   **({"target": rows, "losses": batch} if self.last else {}))
                losses += batch
        pp = self.mesh["pp"]
        loss = (torch.stack([_local(x.detach()).float() for x in losses]).mean() if self.last
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, group=pp.get_group(), group_src=pp.size() - 1)
        return loss

    def loss(self, rows):
        """The protocol's model alone (launch calibrate, pp = 1): FSDP2 keeps its parameters gathered and its gradients
        unreduced from the first call on, so the timed passes carry no data-parallel traffic."""
        from torch.distributed.fsdp import FSDPModule

        part = self.parts[0]
        if isinstance(part, FSDPModule) and not self._alone:
            self._alone = True
            part.set_reshard_after_forward(False)
            part.set_reshard_after_backward(False)
            part.set_requires_gradient_sync(False)
        return self._loss(part, rows)

    def _state(self) -> dict:
        """Every part's model and optimizer state under the model's own parameter names (the optimizer's flattened by
        name, torchtitan's way), so that checkpoints of every layout are interchangeable."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = {}, {}
        # [peft]: the adapters and their optimizer state alone; the frozen base is rebuilt from the recipe at start-up
        options = StateDictOptions(flatten_optimizer_state_dict=True,
                                   ignore_frozen_params=config_adapters.adapted(self.resolved.recipe.peft))
        for part, optimizer in zip(self._wrapped(), self.optimizers, strict=True):
            m, o = get_state_dict(part, optimizer, options=options)
            model_sd.update(m)
            optim_sd.update(o)
        if self.checkpointed is not None:  # a QLoRA base's 4-bit layers add their scales' state beside their weights
            model_sd = {k: v for k, v in model_sd.items() if k in self.checkpointed}
        state = {DCP_MODEL_KEY: model_sd, "optim": optim_sd}
        if self.scaler is not None:  # fp16: the loss scale and its growth tracker resume too
            state["scaler"] = self.scaler.state_dict()
        return state

    def _wrapped(self) -> list:
        return [self.model] if self.ddp else self.parts

    def save(self, checkpoints: Path, tag: str, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(checkpoints / tag))

    def save_async(self, checkpoints: Path, tag: str, step: int):
        """torch.distributed.checkpoint's async_save (torchtitan's async mode): the state is copied to host memory
        here, then written by a thread whose collectives run on a gloo group of their own, apart from training's."""
        import torch.distributed.checkpoint as dcp

        if self.checkpoint_group is None:  # every rank at once: the first save is at the same step on each
            self.checkpoint_group = dist.new_group(backend="gloo")
        return dcp.async_save(self._state(), checkpoint_id=str(checkpoints / tag), process_group=self.checkpoint_group,
                              async_stager=self.stager)

    def load(self, ckpt: Checkpoint) -> int:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._state()
        _check_shapes(ckpt, state[DCP_MODEL_KEY])
        _dcp_load(state, ckpt)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        adapted = config_adapters.adapted(self.resolved.recipe.peft)
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=len(self.parts) == 1 and not adapted,
                                   ignore_frozen_params=adapted)
        for part, optimizer in zip(self._wrapped(), self.optimizers, strict=True):
            set_state_dict(part, optimizer, model_state_dict=state[DCP_MODEL_KEY], optim_state_dict=state["optim"],
                           options=options)
        return ckpt.step

    def state_bytes(self) -> dict[str, int]:
        """Bytes held between steps, each storage once: the (sharded) parameters (fp32; under [peft] the frozen base in its
        own dtype), the gradients (DDP's reduce buckets; FSDP2 frees its sharded gradients in zero_grad), and AdamW's
        state."""
        seen: set[int] = set()
        params = self._params()
        weights = common.storage_bytes(params, seen)
        grads = common.storage_bytes((p.grad for p in params), seen)
        optimizer = common.storage_bytes((v for opt in self.optimizers for st in opt.state.values() for v in st.values()
                                          if torch.is_tensor(v)), seen)
        return {"weights": weights, "grads": grads, "optimizer": optimizer}


def _checkpointed(resolved: Resolved) -> set[str] | None:
    """[peft]: the model tensors a checkpoint holds, the adapters (None: every one the model's state dict has)."""
    peft = resolved.recipe.peft
    return ({p.name for p in config_adapters.checkpointed_parameters(resolved.model, peft)}
            if config_adapters.adapted(peft) else None)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _dcp_load(state: dict, ckpt: Checkpoint, **kwargs) -> None:
    """dcp.load through the guarded reader. A damaged data file or a refused object is one line (ResumeError or
    UntrustedFileError): DCP itself wraps what its reader raised, per rank, in a CheckpointException."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=dcp_reader(ckpt.dir), **kwargs)
    except CheckpointException as e:
        cause = next(iter(e.failures.values()), None)  # per rank: (the exception, its stack)
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, UntrustedFileError):
            raise cause from None
        said = (str(cause).strip().splitlines() or [""])[0]
        raise ResumeError(f"{ckpt.dir}: torch.distributed.checkpoint could not read it ({type(cause).__name__}"
                          f"{': ' + said if said else ''}); the checkpoint is damaged: resume or export an earlier "
                          "one, or set run.resume=never") from None


def _check_shapes(ckpt: Checkpoint, model_sd: dict) -> None:
    """Every tensor this model loads must exist in the checkpoint with the same global shape: DCP would otherwise load
    a slice of a different model, or fail deep inside its planner."""
    metadata = read_dcp_metadata(ckpt.dir / DCP_METADATA)  # damage: UntrustedFileError, one line
    wrong = shape_mismatches(metadata, {DCP_MODEL_PREFIX + name: tuple(t.shape) for name, t in model_sd.items()})
    if wrong:
        raise ResumeError(mismatch_text(ckpt.dir, wrong))


def build(ctx: BuildContext) -> TorchTrainer:
    return TorchTrainer(ctx)


def export_hf_state(resolved: Resolved, ckpt: Checkpoint) -> dict:
    """The model half of a DCP checkpoint, every tensor whole in fp32, read without a process group. A fine-tune's
    ([peft]) holds its adapters alone (under peft's names): the frozen base it trained on is added, made again as the
    run's start-up made it (the recipe's weights or its seeded init; under QLoRA each block's linear weights as their
    NF4 values)."""
    adapted = config_adapters.adapted(resolved.recipe.peft)
    want = {p.name: p.numel for p in config_adapters.checkpointed_parameters(resolved.model, resolved.recipe.peft)}
    if resolved.model.tie_word_embeddings and not adapted:  # the state dict names the tied matrix twice
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    state = {}
    for key, meta in read_dcp_metadata(ckpt.dir / DCP_METADATA).state_dict_metadata.items():
        if key.startswith(DCP_MODEL_PREFIX) and hasattr(meta, "size"):
            name = key.removeprefix(DCP_MODEL_PREFIX)
            if want.get(name) != math.prod(meta.size):  # before allocating what the metadata claims
                raise ResumeError(f"{ckpt.dir}: holds {name} of shape {tuple(meta.size)}, which "
                                  f"{resolved.model.name} does not have; export the run that wrote it")
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    _dcp_load(state, ckpt, no_dist=True)
    out = {k.removeprefix(DCP_MODEL_PREFIX): v.float() for k, v in state.items()}
    if adapted:
        out.update(adapters.base_as_trained(resolved))
    return out
