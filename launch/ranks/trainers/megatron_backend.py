"""Megatron-Core backend: Megatron's tensor, sequence and pipeline parallel GPT layers; over the data-parallel group
Megatron-Core's own distributed optimizer at ZeRO-1 (launch/ranks/trainers/megatron_distopt.py), DeepSpeed's ZeRO at
the other stages.

Why two data-parallel routes: ZeRO-1 is how NeMo and Megatron-LM train (gradients reduce-scattered in bf16 or fp32,
fp32 main parameters and Adam's moments sharded), and the plan must account it as they run it; DeepSpeed's engine
gives ZeRO-0, ZeRO-2 and ZeRO-3 (the flagship layout), which Megatron-Core's DDP does not. DeepSpeed sees Megatron's
groups through `MegatronMPU`; without it DeepSpeed would shard over every rank and silently train the wrong thing.
On CPU ranks both run on gloo: launch/ranks/trainers/cpu_compat.py redirects what Megatron places on CUDA.

Parallelism is applied one dimension at a time, in this order, from the rank grid in resolved.json:
  1. process groups: Megatron's tp-dp-pp grid, the same order as launch/config/grid.py (checked rank by rank);
  2. tensor (+ sequence) parallelism and the pipeline split: this rank's model chunk(s), one per virtual
     stage, built by launch/ranks/trainers/megatron_model.py, which then loads one canonical set of weights (a
     Hugging Face state dict: `model.weights`, or the seeded random init) so every layout starts equal;
  3. activation recompute: Megatron's own (`full`: every layer; `selective`: core attention);
  4. data parallelism: ZeRO-1 Megatron's DDP and distributed optimizer over the chunks; other stages the DeepSpeed
     engine over them.

A step runs one of three ways:
  * zero_stage 1 (any pp): Megatron's schedule runs every micro-batch of the step through the DDP-wrapped chunks,
    whose hooks reduce-scatter each gradient bucket as the last micro-batch's backward finishes it; its
    finalize_model_grads sums the sequence-parallel norm gradients over TP; the distributed optimizer clips, steps
    its shard and all-gathers the parameters (ahead of the next forward).
  * zero_stage 0 (any pp): Megatron's schedule (no pipelining, 1F1B, or interleaved) runs every
    micro-batch of the step; then sequence-parallel norm gradients are summed over TP in one call, the
    engine reduces over DP, the backend clips and the engine steps.
  * zero_stage 2/3 (pp = 1, no SP; the resolver refuses the rest): the engine's own forward and backward
    per micro-batch, since ZeRO-2/3 partition gradients inside DeepSpeed's backward.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from launch.config.resolve import Resolved
from launch.config.backends import traits
from launch.ranks.trainers import common, megatron_distopt
from launch.ranks.trainers.protocol import BuildContext, StepOutput
from launch.run.checkpoints import Checkpoint, ResumeError


def _eager(model: Callable | None = None, **_options) -> Callable:
    """torch.compile's signature, compiling nothing: `@_eager` and `_eager(**options)(fn)` both give fn."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_eager() -> None:
    """Import Megatron-Core with its jit fusions left as plain functions (CPU ranks).

    megatron.core.jit binds jit_fuser = torch.compile when it is imported, and some twenty functions are
    decorated with it as their modules import, which pulls in torch._dynamo and torch._inductor: 2.4 s of every
    rank's start-up on a CPU core (measured: megatron.core imports in 4.8 s, 2.1 s without), though none of
    those functions runs in the layers built here (the bias fusions are off: megatron_model.py), and inductor
    would need a C++ compiler on a CPU rank the first time one did. Megatron's own disable_jit_fuser() comes too
    late: the decorators have run by the time megatron.core.jit can be imported. So torch.compile is the
    identity for exactly as long as that module imports; jit_fuser keeps it, nothing else does."""
    import sys

    if "megatron.core.jit" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _eager
    try:
        import megatron.core.jit  # noqa: F401  (imports megatron.core, whose modules decorate with jit_fuser)
    finally:
        torch.compile = compile_


def init_distributed(resolved: Resolved, cuda: bool) -> None:
    if not cuda:
        import_megatron_eager()
    from launch.ranks.trainers.cpu_compat import apply as cpu_compat

    cpu_compat(cuda=cuda)  # on GPUs only the SP-norm patch: no CUDA call is redirected there
    common.no_jit_comm_op()
    from megatron.core import parallel_state as ps

    par = resolved.recipe.parallel
    common.init_process_group(cuda, resolved.recipe.run.timeout_s)
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                 virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
                                 order="tp-dp-pp")


def model_parallel_rank(tp_rank: int, pp_rank: int, tp: int) -> int:
    """The rank DeepSpeed names checkpoint files by (mp_rank_XX): unique over the TP × PP grid."""
    return pp_rank * tp + tp_rank


class MegatronMPU:
    """DeepSpeed's view of Megatron's groups. 'Model parallel' is TP × PP (gradient norms are summed over
    it), the tensor-parallel rank is what DeepSpeed deduplicates replicated parameters by, and the
    data-parallel group is what ZeRO partitions over."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.ps = ps

    def get_model_parallel_rank(self) -> int:
        ps = self.ps
        return model_parallel_rank(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                   ps.get_tensor_model_parallel_world_size())

    def get_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size() * self.ps.get_pipeline_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist

        return dist.get_process_group_ranks(self.ps.get_data_parallel_group())


def _check_grid(resolved: Resolved, rank: int) -> None:
    """Megatron's groups must be the rank grid the plan describes (launch/config/grid.py), rank by rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    g = resolved.grid
    want = {"tp": g.tp_group(rank), "dp": g.dp_group(rank), "pp": g.pp_group(rank)}
    have = {"tp": tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
            "dp": tuple(dist.get_process_group_ranks(ps.get_data_parallel_group())),
            "pp": tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))}
    if have != want:
        raise RuntimeError(f"Megatron placed rank {rank} in groups {have}; the rank grid expects {want}")


class MegatronTrainer:
    def __init__(self, ctx: BuildContext) -> None:
        import deepspeed
        from megatron.core import parallel_state as ps

        from launch.ranks.trainers import megatron_model as mm

        resolved, r = ctx.resolved, ctx.resolved.recipe
        par = r.parallel
        self.resolved, self.cuda, self.device = resolved, ctx.cuda, ctx.device
        # 1. process groups
        _check_grid(resolved, ctx.env.rank)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        # 2 + 3. tensor/sequence parallel layers, the pipeline split and recompute, then the canonical weights
        self.config = mm.transformer_config(resolved.model, cuda=ctx.cuda, tp=par.tp, pp=par.pp, vpp=par.vpp,
                                            sp=par.sp, activation_checkpointing=r.train.activation_checkpointing,
                                            dtype=r.precision.dtype)
        common.import_model_class(resolved)  # the starting weights are made by transformers' own init
        with common.model_build(ctx.run, ctx.env.rank):
            self.chunks = mm.build_chunks(resolved.model, self.config, seed=r.train.seed, attention=r.train.attention)
            _load_initial_state(resolved, self.chunks, common.StartupProgress(ctx.watchdog, "every rank cuts its shards"))
        if ctx.cuda:
            for c in self.chunks:
                c.cuda(ctx.device)
        self.layer_calls = _count_layer_calls(self.chunks, resolved.model.num_layers)
        self.decoder_layers = [layer for chunk in self.chunks for layer in chunk.decoder.layers]
        built = _layout_record(ctx.env.rank, self.chunks)
        ctx.run.write_text_atomic(ctx.run.layout(ctx.env.rank), json.dumps(built, indent=1) + "\n")
        for v, layers in enumerate(built["chunk_layers"]):  # for people; the record above is for programs
            print(f"rank {ctx.env.rank} pp stage {self.pp_rank}: chunk {v} layers {layers[0]}-{layers[-1]}", flush=True)
        # 4. data parallelism
        self.module = _Chunks(self.chunks)
        self.engine, self.distopt = None, None
        if traits("megatron").distributed_optimizer(par.zero_stage):
            self.distopt = megatron_distopt.wrap(resolved, self.config, self.chunks)
            if ctx.env.rank == 0:
                reduced = "fp32" if self.distopt.chunks[0].ddp_config.grad_reduce_in_fp32 else r.precision.dtype
                print(f"megatron: distributed optimizer, data-parallel gradients reduce-scattered in {reduced}",
                      flush=True)
        else:
            self.engine, _, _, _ = deepspeed.initialize(model=self.module, model_parameters=self.module.parameters(),
                                                        config=json.loads(json.dumps(resolved.ds_config)),
                                                        mpu=MegatronMPU())
            common.say_reduce_dtype(self.engine)
            if self.engine.dp_world_size != self.dp_world:
                raise RuntimeError(f"DeepSpeed formed data-parallel groups of {self.engine.dp_world_size} ranks; "
                                   f"Megatron's grid has {self.dp_world}")
        # What the schedule runs: under the distributed optimizer the DDP-wrapped chunks, on which the schedule's
        # no_sync and its finalize_model_grads (finish_grad_sync) are called.
        self.runnable = self.distopt.chunks if self.distopt else self.chunks
        self.param_numel_local = common.local_param_numel(self.module)
        self.schedule_path = par.zero_stage <= 1
        self.sp_params = [p for p in self.module.parameters() if getattr(p, "sequence_parallel", False)]
        self.seq_len = r.batch.seq_len

    # ------------------------------------------------------------------ protocol

    def set_lr(self, lr: float) -> None:
        for group in (self.distopt or self.engine.optimizer).param_groups:
            group["lr"] = lr

    def state_bytes(self) -> dict[str, int]:
        return self.distopt.state_bytes() if self.distopt else common.model_state_bytes(self.engine)

    def loss(self, rows):
        if len(self.chunks) != 1:
            raise RuntimeError("a micro-batch's loss on one rank needs the whole model: pp = 1, vpp = 1")
        tokens, position_ids, labels, mask = self._inputs(rows)
        return self._loss(mask, self.chunks[0](tokens, position_ids, None, labels=labels))[0]

    def evaluate(self, micro_batch: Callable, count: int):
        """Forward only, under no_grad as Megatron's own evaluate(): through the schedule (the pipeline's stages, the
        last stage's loss sent to the others) or the engine (ZeRO 2/3)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [self._inputs(micro_batch(i)) for i in range(count)]
        with torch.no_grad(), common.evaluating(self.chunks):
            if not self.schedule_path:
                return torch.stack([self._loss(mask, self.engine(tokens, position_ids, None, labels=labels))[0].float()
                                    for tokens, position_ids, labels, mask in batches]).mean()
            iters = [iter(batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(batches)
            stored = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iters,
                model=self.runnable if len(self.chunks) > 1 else self.runnable[0], num_microbatches=count,
                seq_length=self.seq_len, micro_batch_size=self.resolved.recipe.batch.micro_batch_size,
                forward_only=True)
        loss = torch.stack([d["loss"] for d in stored]).float().mean() if stored else torch.zeros((), device=self.device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast(loss, src=dist.get_process_group_ranks(group)[-1], group=group)
        return loss

    def train_step(self, micro_batch: Callable) -> StepOutput:
        if self.schedule_path:
            return self._schedule_step(micro_batch)
        return self._engine_step(micro_batch)

    def save(self, checkpoints: Path, tag: str, step: int) -> None:
        if self.distopt:
            self._save_distributed(checkpoints / tag, step)
            return
        self.engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"step": step}, save_latest=False)

    def _save_distributed(self, folder: Path, step: int) -> None:
        """The model's chunks once per model-parallel rank (data-parallel rank 0: the parameters are equal across the
        group once gathered), as DeepSpeed names and lays them out, then the optimizer's state."""
        mp = model_parallel_rank(self.tp_rank, self.pp_rank, self.resolved.recipe.parallel.tp)
        folder.mkdir(parents=True, exist_ok=True)
        self.distopt.sync_params()  # the step's updates gathered into every rank's parameters before they are written
        if self.dp_rank == 0:
            # clone: each parameter is a view of DDP's buffer, and torch.save would write the whole buffer per view
            module = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in self.module.state_dict().items()}
            torch.save({"module": module, "step": step}, folder / megatron_distopt.model_states_name(mp))
        self.distopt.save(folder, mp, self.dp_rank)

    def load(self, ckpt: Checkpoint) -> int:
        self._check_saved_shapes(ckpt)
        if self.distopt:
            mp = model_parallel_rank(self.tp_rank, self.pp_rank, self.resolved.recipe.parallel.tp)
            saved = torch.load(ckpt.dir / megatron_distopt.model_states_name(mp), map_location="cpu", weights_only=True)
            self.module.load_state_dict(saved["module"])
            self.distopt.load(ckpt.dir, mp, self.dp_rank)
            return int(saved["step"])
        path, client = self.engine.load_checkpoint(str(ckpt.path), tag=ckpt.tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if path is None:
            raise ResumeError(f"{ckpt.dir}: DeepSpeed could not load this checkpoint")
        return int((client or {}).get("step", ckpt.step))

    def _check_saved_shapes(self, ckpt: Checkpoint) -> None:
        """Every parameter this rank is about to load was saved with the live parameter's shape, before DeepSpeed or
        the distributed optimizer loads anything (and the distributed optimizer's shard of this rank is there). Its module load is strict for ZeRO 0-2, but under ZeRO-3 the saved module holds 0-element
        placeholders and the weights come from flat fp32 partitions copied without their shapes: measured on
        DeepSpeed 0.19.8, a partition saved for a [6, 4] weight loads silently into a [4, 6] one, and a changed
        element count fails with a bare tensor-size error. Each rank checks its own file, then all ranks agree,
        so the job stops with one ResumeError (exit 2) rather than one rank failing inside a collective."""
        import torch.distributed as dist

        mp = model_parallel_rank(self.tp_rank, self.pp_rank, self.resolved.recipe.parallel.tp)
        name = (f"zero_pp_rank_{self.dp_rank}_mp_rank_{mp:02d}_model_states.pt"
                if self.resolved.recipe.parallel.zero_stage == 3 else megatron_distopt.model_states_name(mp))
        live = {k: tuple(getattr(p, "ds_shape", p.shape)) for k, p in self.module.named_parameters()}
        problem = _shape_mismatch(ckpt.dir / name, live)
        shard = ckpt.dir / megatron_distopt.optimizer_shard_name(mp, self.dp_rank)
        if self.distopt and not problem and not shard.is_file():
            problem = (f"{shard}: missing; a ZeRO-1 checkpoint of the megatron backend holds every rank's shard of the "
                       "distributed optimizer (one written before this format, or by DeepSpeed's ZeRO, does not); set "
                       "run.resume=never to start fresh")
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first:
            raise ResumeError(first)

    # ------------------------------------------------------------------ steps

    @staticmethod
    def _inputs(rows):
        """Megatron's inputs for HF-style rows: predict token i+1 from tokens <= i, the last position masked
        (so the loss is the Hugging Face model's and the sequence keeps its length for SP)."""

        labels = torch.roll(rows, -1, dims=1)
        mask = torch.ones_like(rows, dtype=torch.float32)
        mask[:, -1] = 0.0
        position_ids = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0).expand_as(rows)
        return rows, position_ids, labels, mask

    @staticmethod
    def _loss(mask, per_token):
        loss = (per_token.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place by the micro-batches

    def _forward_step(self, data_iterator, model):
        tokens, position_ids, labels, mask = next(data_iterator)
        with common.region("forward", self.cuda):
            out = model(tokens, position_ids, None, labels=labels)
        return out, partial(self._loss, mask)

    def _schedule_step(self, micro_batch: Callable) -> StepOutput:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ga = self.resolved.grad_accum
        batches = [self._inputs(micro_batch(i)) for i in range(ga)]
        iters = [iter(batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(batches)
        r = self.resolved.recipe
        if self.distopt:
            self.distopt.zero_grad()
        with common.region("forward-backward", self.cuda):
            stored = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iters,
                model=self.runnable if len(self.chunks) > 1 else self.runnable[0], num_microbatches=ga,
                seq_length=self.seq_len, micro_batch_size=r.batch.micro_batch_size, forward_only=False)
        if self.distopt:
            # the schedule's finalize_model_grads has reduced the gradients (and summed SP's norm gradients over TP)
            with common.region("optimizer", self.cuda):
                norm = self.distopt.step()
        else:
            norm = self._step_engine()
        if stored:
            loss = torch.stack([d["loss"] for d in stored]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            # Only the last stage computes the loss; every rank records the same value.
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast(loss, src=dist.get_process_group_ranks(group)[-1], group=group)
        return StepOutput(loss, norm)

    def _step_engine(self) -> float | None:
        """After the schedule at ZeRO-0: the SP norm gradients summed over TP, the engine's data-parallel reduction,
        the backend's clipping and the engine's step; returns the pre-clipping gradient norm."""
        with common.region("optimizer", self.cuda):
            self._sum_sequence_parallel_grads()
            if self.dp_world > 1:
                # Without data parallelism ZeRO-0 has nothing to reduce, yet DeepSpeed flattens, all-reduces over the
                # group of one and copies back every gradient (measured: 2 ms of a tiny model's 13 ms step). Its one
                # other effect, a zero gradient for a parameter that got none, does not arise: every parameter of a
                # rank's chunks takes part in its loss.
                self.engine.allreduce_gradients()
            norm = self._clip(self.resolved.recipe.train.grad_clip)
            self.engine.step()
        return norm

    def _engine_step(self, micro_batch: Callable) -> StepOutput:

        losses = []
        for i in range(self.resolved.grad_accum):
            tokens, position_ids, labels, mask = self._inputs(micro_batch(i))
            with common.region("forward", self.cuda):
                loss, _ = self._loss(mask, self.engine(tokens, position_ids, None, labels=labels))
            with common.region("backward", self.cuda):
                self.engine.backward(loss)
            with common.region("optimizer", self.cuda):
                self.engine.step()  # steps the optimizer only at the accumulation boundary
            losses.append(loss.detach())
        gn = self.engine.get_global_grad_norm()
        return StepOutput(torch.stack(losses).mean(), None if gn is None else float(gn))

    def _sum_sequence_parallel_grads(self) -> None:
        """Under SP each TP rank normalises only its part of the sequence: sum the norm weights' gradients over
        TP in one coalesced all-reduce, as Megatron's finalize_model_grads does."""
        if not self.sp_params:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.sp_params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(new)

    def _clip(self, max_norm: float) -> float:
        """Pre-clipping L2 norm of the whole (data-parallel averaged) gradient, then clip. A parameter that is
        the same on every TP rank (not `tensor_model_parallel`) is counted on TP rank 0 only; the sum runs
        over TP × PP, so every rank gets the norm of the whole model."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        params = [p for p in self.module.parameters() if p.grad is not None]
        for p in params:
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.detach().double().pow(2).sum()
        group = ps.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in params:
                p.grad.detach().mul_(scale)
        return norm


class _Chunks(torch.nn.ModuleList):
    """The module the DeepSpeed engine wraps: this rank's model chunks. Its forward is the single chunk's, for
    the engine's own forward (zero_stage >= 2 runs without pipelining, so with one chunk)."""

    def forward(self, *args, **kwargs):
        (chunk,) = self
        return chunk(*args, **kwargs)


def _layout_record(rank: int, chunks) -> dict:
    """What this rank built, from Megatron's own state: its process groups, each chunk's global layer numbers,
    and its seeds (the default generator's, and the TP RNG tracker's record: data-parallel, expert and the
    tensor-model-parallel stream that must differ across TP ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "rank": rank,
        "groups": {"tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
                   "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
                   "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())},
        "chunk_layers": [[layer.layer_number - 1 for layer in c.decoder.layers] for c in chunks],
        "seeds": {"default": torch.initial_seed(), "rng_tracker": sorted(get_cuda_rng_tracker().seeds_)},
    }


def _load_initial_state(resolved: Resolved, chunks, progress) -> None:
    """Every rank makes the canonical starting weights itself (common.initial_tensors: the local safetensors read, or
    the seeded init that the other backends start from, one whole tensor at a time) and cuts its own shards as each
    layer's tensors are there (megatron_model.load_hf_streamed): no rank holds the whole model, and no rank waits on
    another, so a slow build is no collective's timeout. Both sources give the tensors in spec.parameters()' order,
    the order load_hf_streamed asks for them; one arriving before its turn would wait in `early`."""
    from launch.ranks.trainers import megatron_model as mm

    spec = resolved.model
    stream = common.initial_tensors(resolved)
    early: dict = {}
    done = [0]

    def fetch(name: str, shape: tuple[int, ...]):
        while name not in early:
            got = next(stream, None)
            if got is None:
                raise ValueError(f"{spec.name}: the starting weights lack {name}")
            early[got[0]] = got[1]
        t = early.pop(name)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{spec.name}: the starting weights give {name} as {tuple(t.shape)}, the model needs "
                             f"{tuple(shape)}")
        done[0] += 1
        progress(done[0], len(spec.parameters()))
        return t.contiguous()

    mm.load_hf_streamed(chunks, spec, fetch)


def _count_layer_calls(chunks, num_layers: int) -> list[int]:
    """Forward calls of each decoder layer's MLP, by global layer number: under full recompute every layer runs
    twice per micro-batch (the forward, then the recompute in backward), which proves recomputation happened."""
    counts = [0] * num_layers
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            inner = layer.mlp.forward
            index = layer.layer_number - 1  # Megatron numbers layers globally, from 1

            def counted(*args, _inner=inner, _i=index, **kwargs):
                counts[_i] += 1
                return _inner(*args, **kwargs)

            layer.mlp.forward = counted
    return counts


def build(ctx: BuildContext) -> MegatronTrainer:
    return MegatronTrainer(ctx)


def _saved_param_shapes(state: dict) -> dict[str, tuple[int, ...]]:
    """The full (TP-local) shape of every parameter in one DeepSpeed model-states file. ZeRO-3 saves 0-element
    placeholders in `module` and the shapes (each parameter's ds_shape) in `param_shapes`, one dict per
    parameter group; the other stages save the tensors themselves, which `module` also mixes with buffers."""
    buffers = set(state.get("buffer_names") or ())
    shapes = {k: tuple(v.shape) for k, v in state["module"].items()
              if isinstance(v, torch.Tensor) and k not in buffers}
    for group in state.get("param_shapes") or ():
        shapes.update((k, tuple(v)) for k, v in group.items())
    shapes.update((k, tuple(v)) for k, v in (state.get("frozen_param_shapes") or {}).items())
    return shapes


def _shape_mismatch(path: Path, live: dict[str, tuple[int, ...]]) -> str | None:
    """Why the model-states file at `path` cannot fill parameters of these shapes, or None when it can."""
    if not path.is_file():
        return f"{path}: missing; this checkpoint has no part for this rank's model shard"
    saved = _saved_param_shapes(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    problems = [f"{k} was saved with shape {list(saved[k])}, this run's model has {list(v)}"
                for k, v in live.items() if k in saved and saved[k] != v]
    problems += [f"{k} of this run's model is not in it" for k in live if k not in saved]
    problems += [f"it holds {k}, which this run's model does not have" for k in saved if k not in live]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"{path}: {problems[0]}{more}; the checkpoint does not fit the model in resolved.json; "
            "set run.resume=never to start fresh")


def _zero3_module_state(ckpt: Checkpoint, mp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """One model-parallel rank's full fp32 module state from a ZeRO-3 checkpoint: its `dp` partitions joined.

    DeepSpeed's get_fp32_state_dict_from_zero_checkpoint globs every `*_optim_states.pt` of the folder, so with
    TP or PP (files of several mp ranks) it counts tp × pp × dp partitions where each rank wrote dp, and fails;
    the helpers it is built from take the files of one mp rank, listed here in data-parallel rank order."""
    import contextlib
    import sys

    from deepspeed.utils import zero_to_fp32 as z2f

    model_files, optim_files = [], []
    for dp_rank in range(dp):
        stem = f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}"
        model = ckpt.dir / f"{stem}_model_states.pt"
        optim = [f for f in (ckpt.dir / f"{stem}_optim_states.pt", ckpt.dir / f"bf16_{stem}_optim_states.pt")
                 if f.is_file()]  # bf16 runs prefix the optimizer partition's name
        if not model.is_file() or len(optim) != 1:
            raise ResumeError(f"{ckpt.dir}: expected {model.name} and one {stem}_optim_states.pt (found "
                              f"{len(optim)}); a ZeRO-3 checkpoint holds both for every data-parallel rank (dp={dp}) "
                              "and model-parallel rank")
        model_files.append(model)
        optim_files += optim
    # DeepSpeed reports its progress on stdout, which `launch export` keeps for the folder it wrote.
    with contextlib.redirect_stdout(sys.stderr):
        model_states = z2f.parse_model_states([str(f) for f in model_files])
        stage, world, flat_groups, _ = z2f.parse_optim_states([str(f) for f in optim_files], str(ckpt.dir))
        if (stage, world) != (3, dp):
            raise ResumeError(f"{optim_files[0]}: holds a ZeRO-{stage} partition of {world}; the marker says "
                              f"ZeRO-3 over dp={dp}")
        lazy = z2f._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states,
                                                              exclude_frozen_parameters=False)
        return z2f.to_torch_tensor(lazy)


def export_hf_state(resolved: Resolved, ckpt: Checkpoint) -> dict:
    """Every (pipeline stage, virtual chunk, TP rank)'s module state from the checkpoint's model-parallel
    files, joined into one Hugging Face state dict by launch/ranks/trainers/megatron_model.py. ZeRO 0-2 files hold
    the module itself; ZeRO-3 spreads each mp rank's fp32 weights over dp partitions, joined first. The
    layout is the one the marker records, which wrote the files."""
    import_megatron_eager()  # export joins tensors on the host: Megatron's fusions are not needed here either
    from launch.ranks.trainers import megatron_model as mm

    tp, pp, vpp, dp = (int(ckpt.info[k]) for k in ("tp", "pp", "vpp", "dp"))
    local = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            mp_rank = model_parallel_rank(tp_rank, pp_rank, tp)
            if ckpt.info["zero_stage"] == 3:
                module = _zero3_module_state(ckpt, mp_rank, dp)
            else:
                f = ckpt.dir / megatron_distopt.model_states_name(mp_rank)
                module = torch.load(f, map_location="cpu", weights_only=True)["module"]
            for chunk in range(vpp):
                prefix = f"{chunk}."
                local[mm.Place(pp_rank, chunk, tp_rank)] = {k[len(prefix):]: v.float() for k, v in module.items()
                                                            if k.startswith(prefix) and isinstance(v, torch.Tensor)}
    return mm.gather_hf_state(local, resolved.model, tp=tp, pp=pp, vpp=vpp)
