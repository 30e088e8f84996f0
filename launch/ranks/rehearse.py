"""`python -m launch.ranks.rehearse RUN_DIR RANK`: one rank of the torch backend's training step at the recipe's real
shapes, on this CPU, without a GPU and without allocating what the step holds (started by `python -m launch
rehearse`, launch/commands/rehearse.py, which compares what it measures with the plan).

The rank joins a `fake` process group of the recipe's world size (no peers: every collective returns at once) and
builds the backend's own TorchTrainer as training does: the model on `meta`, the mesh, tensor (+ sequence)
parallelism, activation checkpointing and FSDP2 in the trainer's order (train.compile is off: resolved so by the
command). Those run outside fake mode, as they must (FSDP2 flattens the mesh it shares with TP); the parts are then
allocated under FakeTensorMode, where tensors have shapes and no storage, and every step after that is fake too.

Per measured step, three of torch's instruments watch the same ops:
- memory: torch.distributed._tools' FSDPMemTracker (FSDP2) or MemTracker, the peak by kind and when it happened;
- FLOPs: FlopCounterMode at this rank's own tensor shapes; the CPU attention kernel is not in its table, so the
  attention FLOPs come from the formula, from the measured forward calls of each layer;
- collectives: CommDebugMode, each call's kind and message size.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from launch.config.resolve import Resolved
from launch.plan.collectives import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from launch.plan.layout import Plan
from launch.plan.memory import PHASES
from launch.ranks.trainers import adapters
from launch.ranks.trainers.common import RankEnv
from launch.ranks.trainers.loop import start_loss_mean
from launch.ranks.trainers.protocol import BuildContext
from launch.ranks.trainers.torch_backend import TorchTrainer, _wrap_ddp, allocate
from launch.run.rehearsal import Collective, Measured, PhasePeak, measured_path
from launch.run.rundir import RunDir
from launch.torchtools.hf import offline_bitsandbytes
from launch.units import MiB

USAGE = "usage: python -m launch.ranks.rehearse RUN_DIR RANK"
DDP_BUCKET_CAPS_MB = [DDP_FIRST_BUCKET_BYTES // MiB, DDP_BUCKET_BYTES // MiB]
UNMASKED_SDPA = "sdpa_unmasked"  # Hugging Face's sdpa attention function, registered without a mask function
# Collective kinds by the torch op's name (c10d's and the functional collectives'), in the plan's vocabulary
# (launch.plan.layout.Comm.collective); the first prefix that matches names it.
KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
         ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("send", "send_recv"), ("recv", "send_recv"),
         ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce"))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    offline_bitsandbytes()
    run, rank = RunDir.open(argv[0]), int(argv[1])
    resolved = Resolved.load(run.resolved)
    role = next(r.kind for r in Plan.from_json(run.plan.read_text(encoding="utf-8")).ranks if rank in r.ranks)
    # The instruments' hooks make torch warn about hooks it cannot call on Hugging Face's output records: the rank's log
    # keeps them, the terminal keeps the progress bar.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        try:
            measured = rehearse(run, resolved, rank, role)
        except Exception as e:  # noqa: BLE001 - one line for the person, the whole story in the rank's log
            run.write_text_atomic(run.stderr(rank), _warnings(said) + traceback.format_exc())
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"error: rank {rank}: {type(e).__name__}: {first} (traceback in {run.stderr(rank)})", file=sys.stderr)
            return 1
    run.write_text_atomic(run.stderr(rank), _warnings(said))
    run.write_text_atomic(measured_path(run.root, rank), measured.to_json() + "\n")
    return 0


def _warnings(caught: list) -> str:
    return "".join(sorted({f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}\n" for w in caught}))


def rehearse(run: RunDir, resolved: Resolved, rank: int, role: str) -> Measured:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=resolved.world_size, store=FakeStore())
    start = time.perf_counter()
    columns = (TextColumn("rank {task.fields[rank]}: {task.description}"), BarColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns) as progress, contextlib.ExitStack() as fake:
            bar = _Progress(progress, progress.add_task("building the model", total=None, rank=rank))
            env = RankEnv(rank, resolved.world_size, rank % resolved.recipe.hardware.gpus_per_node)
            ctx = BuildContext(run, resolved, env, cuda=False, device=torch.device("cpu"), watchdog=None,
                               resume_from=None, universal=False)
            trainer = RehearsedTrainer(ctx, fake)
            bar.start(trainer)
            _create_optimizer_state(trainer)
            return _measure(trainer, resolved, rank, role, bar, start)
    finally:
        dist.destroy_process_group()


class RehearsedTrainer(TorchTrainer):
    """The backend's trainer whose parts are allocated as fake tensors, after the same parallelisation."""

    def __init__(self, ctx: BuildContext, fake: contextlib.ExitStack) -> None:
        self._fake = fake
        super().__init__(ctx)
        if ctx.resolved.recipe.train.attention == "sdpa":
            _unmasked_sdpa(self.parts)
        for optimizer in self.optimizers:
            # AdamW as a GPU rank steps it: the trainer takes the fused kernel there (one launch, no temporaries) and
            # foreach on CPU ranks, whose temporaries (a copy of the parameters' size) a GPU never holds.
            for group in optimizer.param_groups:
                group["foreach"], group["fused"] = False, True

    def wrap_ddp(self, part, local_rank: int):
        """DDP as training wraps the model, less what reads values fake tensors do not hold: the start-up's shape check
        and broadcast of rank 0's weights (init_sync), the bucket rebuild after the first backward (it broadcasts the
        gradients' arrival order), and the completion of the C++ reducer's all-reduce (a hook runs the same all-reduce
        of each bucket, in place, through torch's dispatcher, where the instruments see it). The buckets are built at
        once with the caps the rebuild uses (1 MiB, then 25 MiB), assigned in the parameters' order (the rebuild would
        assign them in the gradients' arrival order); DDP's first, single bucket lasts until the rebuild, which is
        declined. The
        gradients exist before DDP wraps the model, so that they become views of its buckets, as they are from a
        training step's second on (the first step's no_sync micro-batches make separate ones)."""
        for p in part.parameters():
            if p.requires_grad:  # [peft]'s frozen base has none
                p.grad = torch.zeros_like(p)
        ddp = _wrap_ddp(part, self.mesh, self.cuda, local_rank, init_sync=False, bucket_cap_mb_list=DDP_BUCKET_CAPS_MB)
        bf16 = self.resolved.recipe.precision.grad_reduce_dtype == "bf16"
        ddp.register_comm_hook(None, _all_reduce_bucket_bf16 if bf16 else _all_reduce_bucket)
        ddp.reducer = _BucketsAsBuilt(ddp.reducer)
        return ddp

    def materialise_parts(self, parts: list, device) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # Entered here and left open: everything from now on (optimizer, steps) runs on fake tensors; the caller's
        # ExitStack closes it.
        self._fake.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        for part in parts:
            allocate(part, device)
            adapters.empty_quantized(part, device)


def _all_reduce_bucket(state, bucket):
    grads = bucket.buffer()
    dist.all_reduce(grads)
    done = torch.futures.Future()
    done.set_result(grads)
    return done


def _all_reduce_bucket_bf16(state, bucket):
    """What DDP's bf16_compress_hook does (precision.grad_reduce_dtype=bf16), in the dispatcher's sight."""
    grads = bucket.buffer()
    compressed = grads.to(torch.bfloat16)
    dist.all_reduce(compressed)
    grads.copy_(compressed)
    done = torch.futures.Future()
    done.set_result(grads)
    return done


@dataclass(frozen=True)
class _BucketsAsBuilt:
    """DDP's reducer, whose bucket rebuild (DDP._pre_forward asks for it once) is declined."""

    reducer: object

    def __getattr__(self, name: str):
        return getattr(self.reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _unmasked_sdpa(parts: list) -> None:
    """SDPA as training runs it: causal, without a mask. Hugging Face skips the mask once it has read the position ids
    and seen one sequence; fake position ids hold no values, so it would assume packed sequences and build a mask (of
    the local sequence shard under SP, which then fails). The same attention function under a name that has no mask
    function skips the mask unread."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(UNMASKED_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
    for part in parts:
        part.config._attn_implementation = UNMASKED_SDPA


def _create_optimizer_state(trainer: TorchTrainer) -> None:
    """AdamW's state, as every step after the first holds it: one optimizer step on zero gradients (cheaper than a
    step of the model, and the same state)."""
    for part in trainer.parts:
        for p in part.parameters():
            # DDP's are its buckets' views already (RehearsedTrainer.wrap_ddp); [peft]'s frozen base takes none
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
    for optimizer in trainer.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=not trainer.ddp)


@dataclass
class _Progress:
    """The bar: a tick per decoder-layer forward (forward pre-hooks), twice the layers at the end of each backward."""

    progress: object
    task: object

    def start(self, trainer: TorchTrainer) -> None:
        layers = len(trainer.decoder_layers)
        micro_batches = min(trainer.resolved.grad_accum, 2)
        self.progress.update(self.task, total=2 + micro_batches * (1 + 3 * layers), completed=1,
                             description="optimizer state")
        for layer in trainer.decoder_layers:
            layer.register_forward_pre_hook(lambda *_: self.progress.advance(self.task))

    def begin(self, label: str) -> None:
        self.progress.update(self.task, description=label)
        self.progress.advance(self.task)

    def backward_done(self, layers: int) -> None:
        self.progress.advance(self.task, 2 * layers)


@dataclass(frozen=True)
class _Pass:
    label: str
    weight: int  # how many of the step's passes this one stands for
    in_model: bool  # forward and backward (else the step's tail)
    run: Callable[[], None]


def _passes(trainer: TorchTrainer, resolved: Resolved, bar: _Progress) -> list[_Pass]:
    """The measured step: micro-batch 1 (weighed G-1: micro-batches 2..G-1 repeat its work), micro-batch G (the
    gradients of the earlier ones held, as in 2..G-1), then the step's tail as train_step runs it."""
    ga, batch, vocab = resolved.grad_accum, resolved.recipe.batch, resolved.model.vocab_size

    losses = []

    def micro(i: int) -> Callable[[], None]:
        def run() -> None:
            losses.append(trainer.micro_step(torch.randint(0, vocab, (batch.micro_batch_size, batch.seq_len)), i))
            bar.backward_done(len(trainer.decoder_layers))
        return run

    phases = [_Pass(f"micro-batch 1 of {ga}", max(ga - 1, 1), True, micro(0))]
    if ga > 1:
        phases.append(_Pass(f"micro-batch {ga} of {ga}", 1, True, micro(ga - 1)))
    return phases + [_Pass("gradient norm, clipping, optimizer step and the loss mean", 1, False,
                            lambda: _tail(trainer, losses[-1]))]


def _measure(trainer: TorchTrainer, resolved: Resolved, rank: int, role: str, bar: _Progress,
             start: float) -> Measured:
    propagation = _Propagation()
    tracker = (_FSDPTracker(trainer.parts[0], trainer.optimizers[0]) if isinstance(trainer.parts[0], FSDPModule)
               else _Tracker())
    tracker.track_external(trainer.model, *trainer.optimizers)  # FSDPMemTracker: a no-op, it finds them itself
    tracker.propagation, tracker.phase_peaks = propagation, {}
    flops = _RankFlops(propagation)
    counted, attention, messages = 0.0, 0.0, Counter()
    with propagation, tracker, flops:
        for step_pass in _passes(trainer, resolved, bar):
            tracker.reset_mod_stats()  # per-module stats of one pass at a time (FSDPMemTracker's rule); the peak stays
            bar.begin(step_pass.label)
            tracker.pass_label, tracker.in_model = step_pass.label, step_pass.in_model
            flops_before, calls_before = flops.get_total_flops(), list(trainer.layer_calls)
            # A CommDebugMode per pass: its module tracker registers a forward hook at every call of a module and
            # removes them only on exit, so a second pass through the same modules in one context breaks it.
            with _Collectives() as comms:
                step_pass.run()
            counted += step_pass.weight * (flops.get_total_flops() - flops_before)
            attention += step_pass.weight * _attention_flops(trainer, resolved, calls_before)
            messages.update({k: step_pass.weight * n for k, n in comms.messages.items()})
    peak: Counter = Counter()
    for kinds in tracker.get_tracker_snapshot("peak").values():
        peak.update({getattr(kind, "value", kind): n for kind, n in kinds.items()})
    total = peak.pop(_TOTAL, 0)
    optimizer = trainer.optimizers[0]
    return Measured(
        rank=rank, role=role, peak_bytes=total, peak_by_kind={k: n for k, n in peak.items() if n},
        peak_at=tracker.peak_at, phase_peaks=tuple(tracker.phase_peaks[p] for p in PHASES if p in tracker.phase_peaks),
        flops_counted=counted, flops_attention=attention, attention_note=ATTENTION_NOTE,
        collectives=tuple(Collective(kind, size, n) for (kind, size), n in sorted(messages.items())),
        micro_batches_run=min(resolved.grad_accum, 2), micro_batches_per_step=resolved.grad_accum,
        tracker=type(tracker).__bases__[-1].__name__,
        optimizer=f"{type(optimizer).__name__} ({'fused' if optimizer.param_groups[0]['fused'] else 'foreach'})",
        seconds=time.perf_counter() - start)


def _tail(trainer: TorchTrainer, loss) -> None:
    """train_step after the micro-batches, without its host syncs (fake tensors hold no values): the scaler's unscale,
    the clipped gradient norm, each optimizer's step (GradScaler.step would first read whether the gradients
    overflowed) and zero_grad; then the loop's data-parallel loss mean."""
    if trainer.scaler is not None:
        for optimizer in trainer.optimizers:
            trainer.scaler.unscale_(optimizer)
    trainer.clipped_norm()
    for optimizer in trainer.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=not trainer.ddp)
    start_loss_mean(trainer, loss)


ATTENTION_NOTE = ("FlopCounterMode has no formula for the CPU kernel of scaled_dot_product_attention: added from the "
                  "formula, 4·b·s²·(heads/tp)·head_dim per layer forward (the forward calls counted, recomputation "
                  "included but the op policy's, which keeps attention's output) and twice that per backward, as the "
                  "plan's 12·L·heads·head_dim·s per token")


def _attention_flops(trainer: TorchTrainer, resolved: Resolved, calls_before: list[int]) -> float:
    forwards = sum(trainer.layer_calls) - sum(calls_before)
    backwards = sum(1 for now, then in zip(trainer.layer_calls, calls_before, strict=True) if now > then)
    if resolved.recipe.train.activation_checkpointing == "selective":
        forwards = backwards  # the op policy keeps attention's output: a block's recomputation runs no attention
    m, b = resolved.model, resolved.recipe.batch
    per_pass = 4 * b.micro_batch_size * b.seq_len ** 2 * (m.num_heads // resolved.grid.tp) * m.head_dim
    return per_pass * (forwards + 2 * backwards)


class _Propagation:
    """Marks DTensor's sharding propagation, which under a fake mode (where it never caches) runs each op again at its
    global shapes, on fake tensors made for the purpose, to learn the output's metadata: no rank holds or computes
    those, so the instruments skip them. ShardingPropagator._fake_mode_lock is the context torch enters around exactly
    that run (a nullcontext, or a lock in torch's multi-threaded tests); it is this object's marker while the step is
    measured."""

    def __init__(self) -> None:
        self.active = False
        self._saved = None

    def __enter__(self) -> "_Propagation":
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._saved, ShardingPropagator._fake_mode_lock = ShardingPropagator._fake_mode_lock, _Marking(self)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._fake_mode_lock = self._saved


@dataclass
class _Marking:
    propagation: _Propagation

    def __enter__(self) -> None:
        self.propagation.active = True

    def __exit__(self, *exc) -> None:
        self.propagation.active = False


class _NoHook:
    """What the tracker removes on exit for a parameter it never hooked."""

    @staticmethod
    def remove() -> None:
        pass


_NO_HOOK = _NoHook()


class _PeakMoment:
    """A memory tracker that skips DTensor's propagation (_Propagation) and remembers when in the step its peak was
    reached (the pass, forward or backward, and the innermost module running), and the peak of each of the plan's
    phases (launch.plan.memory.PHASES: forward with the loss, backward, optimizer step) with the kinds held then."""

    pass_label, in_model, peak_at = "", False, ""
    propagation: _Propagation
    phase_peaks: dict

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.propagation.active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # A frozen parameter ([peft]'s base) takes no gradient hook (torch refuses one, and it never has a gradient):
        # an entry that stands for its hooks keeps the tracker from trying, while its bytes are counted as any
        # parameter's.
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        backward = self._mod_tracker.is_bw
        if self._peak_mem != before:
            self.peak_at = (f"{self.pass_label}, {'backward' if backward else 'forward'}, in {self._innermost()}"
                            if self.in_model else self.pass_label)
        step_phase = ("backward" if backward else "forward") if self.in_model else "optimizer step"
        now = sum(snap[_TOTAL] for snap in self._curr_mem_snap.values())
        held = self.phase_peaks.get(step_phase)
        if held is None or now > held.bytes:
            kinds: Counter = Counter()
            for snap in self._curr_mem_snap.values():
                kinds.update({getattr(k, "value", k): n for k, n in snap.items() if k != _TOTAL and n})
            at = f"{self.pass_label}, in {self._innermost()}" if self.in_model else self.pass_label
            self.phase_peaks[step_phase] = PhasePeak(step_phase, now, dict(kinds), at)

    def _innermost(self) -> str:
        where = max(self._mod_tracker.parents, key=lambda name: name.count("."))
        return "the loss, outside the model's modules" if where == "Global" else where


class _FSDPTracker(_PeakMoment, FSDPMemTracker):
    """Where FSDP2 shards the model: its kinds name sharded and unsharded parameters, all-gather and reduce-scatter
    buffers."""


class _Tracker(_PeakMoment, MemTracker):
    """Without FSDP2 (one data-parallel rank): parameters, gradients, activations, temporaries and optimizer state."""


class _LocalFlopMode(_FlopCounterMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here at this rank's shapes
        if self.counter.propagation.active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _RankFlops(FlopCounterMode):
    """FlopCounterMode at this rank's own shapes, in total. As shipped it counts an op on DTensors at their global
    shapes (the whole TP group's matmul) and never sees the local op that runs; its mode here lets DTensor desugar
    first, as torch's memory trackers and CommDebugMode do, and skips DTensor's propagation (_Propagation). Its
    per-module breakdown is left off: the ModTracker behind it kept the recomputed activations of checkpointed layers
    alive from one micro-batch to the next (0.4 GiB a layer at Llama-2-7B's shapes, seen by the memory tracker)."""

    def __init__(self, propagation: _Propagation) -> None:
        super().__init__(display=False, custom_mapping=_bitsandbytes_flops())
        self.propagation = propagation

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _LocalFlopMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.mode = None


def _bitsandbytes_flops() -> dict:
    """A formula for bitsandbytes' fused 4-bit matmul (QLoRA's frozen linears: the NF4 weight dequantized, then the
    GEMM), which FlopCounterMode's table lacks: 2·M·N·K, as for the GEMM. None where bitsandbytes is not loaded."""
    try:
        gemm_4bit = torch.ops.bitsandbytes.gemm_4bit  # FlopCounterMode looks ops up by their overload packet
    except (AttributeError, RuntimeError):
        return {}

    def formula(a_shape, b_shape, shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * math.prod(a_shape[:-1]) * shape[0] * shape[1]

    return {gemm_4bit: formula}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(y) for y in x) if isinstance(x, (list, tuple)) else 0


class _Collectives(CommDebugMode):
    """CommDebugMode, each collective also recorded by (kind, message bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops):
            name = packet._qualified_op_name.split("::")[-1].replace("_", "")
            kind = next(k for prefix, k in KINDS if name.startswith(prefix))
            # nccl-tests' S: the larger side, the gathered output of an all-gather, the input of a reduce-scatter
            self.messages[(kind, max(_nbytes(a) for a in (*args, out)))] += 1
        return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
