"""The one training loop every backend runs on (`python -m launch.ranks.train RUN_DIR`, through launch/ranks/train.py).

It owns everything that does not depend on how the model is parallelised: per-rank logs, the stall
watchdog, the rank-0 resume decision, metrics records, TensorBoard, the profiler, the progress line,
the learning-rate schedule, the asynchronous data-parallel mean of the loss, checkpoint cadence and
completion markers, the stop with a checkpoint that the launcher's stop signal asks for (SLURM's time-limit
warning), failure reporting and teardown. The backend (launch/ranks/trainers/protocol.py) builds
the model and runs one optimizer step.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.config import adapters
from launch.config.backends import traits
from launch.config.resolve import Resolved
from launch.plan.time import model_flops_per_token
from launch.ranks.data import Sources, sources
from launch.config.schedule import lr_at
from launch.ranks.trainers import common
from launch.ranks.trainers.protocol import BuildContext, Trainer
from launch.run import checkpoints
from launch.run import metrics as M
from launch.run.rankenv import RESUME_PINNED, STOP_SIGNAL
from launch.run.rundir import RunDir


def main(run_dir: str) -> int:
    return common.run_rank(run_dir, _train_and_exit)


def _train_and_exit(run: RunDir, resolved: Resolved, env: common.RankEnv, terminal, cuda: bool, watchdog) -> int:
    rc = _train(run, resolved, env, terminal, cuda, watchdog)
    # Every record, checkpoint and marker is on disk and all ranks passed the final barrier. Leave without
    # interpreter teardown: DeepSpeed/gloo background threads have aborted a finished ZeRO-3 run there
    # ("terminate called without an active exception"), turning success into failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


@dataclass
class _Finished:
    """A step whose loss reduction may still be in flight; its record is written one step later."""

    step: int  # 0-based
    lr: float
    seconds: float
    grad_norm: float | None
    loss: Any  # tensor, summed over the data-parallel group once `work` completes
    work: Any  # the async all-reduce, or None
    memory: dict[str, int | None]
    tokens: int  # trained on, over the data-parallel ranks
    data_seconds: float  # this rank's time making micro-batches
    valid_loss: float | None
    loss_scale: float | None  # fp16 loss scaling: the scale in effect, and whether the step was skipped
    skipped_step: bool | None


@dataclass(frozen=True)
class _Built:
    """The build phase's outcome: this rank's trainer (model, optimizer, backend), restored when resuming."""

    trainer: Trainer
    device: Any  # torch.device
    resume_from: checkpoints.Checkpoint | None
    start_step: int  # steps already trained: 0 unless resumed


@dataclass(frozen=True)
class _Training:
    """What the step, evaluate, checkpoint and finish phases share, set up once before the first step."""

    run: RunDir
    resolved: Resolved
    env: common.RankEnv
    terminal: Any  # rank 0's terminal stream, None elsewhere
    cuda: bool
    watchdog: common.Watchdog
    trainer: Trainer
    device: Any  # torch.device
    start_step: int
    data: Sources
    flops_per_token: float
    peak: float  # FLOP/s per device at the recipe's dtype
    writer: M.MetricsWriter
    tb: Any  # rank 0's TensorBoard SummaryWriter, None elsewhere
    prof: Any  # the torch profiler, None unless run.profile asks for it
    nsys: range  # the steps Nsight Systems records
    traced: range  # the steps a profiler records
    vote: common.StopVote
    progress: common.ProgressLine
    saving: list[_Saving]  # asynchronous checkpoints still being written (at most one)


@dataclass
class _Saving:
    """An asynchronous checkpoint being written behind training (run.checkpoint_async): its marker follows it."""

    tag: str
    step: int
    future: Any  # concurrent.futures.Future of torch.distributed.checkpoint.async_save


@dataclass
class _Feed:
    """One step's micro-batches for this rank, counting the rows handed out and the time spent making them."""

    s: _Training
    step: int  # 0-based
    rows: int = 0
    seconds: float = 0.0

    def __call__(self, micro: int):
        s = self.s
        t = time.perf_counter()
        rows = common.micro_batch_tensor(s.data.train, self.step, s.resolved, s.trainer.dp_rank, micro, s.device)
        self.rows += rows.numel()
        self.seconds += time.perf_counter() - t
        return rows


def _resume_choice(run: RunDir, resolved: Resolved, terminal) -> checkpoints.Checkpoint | None:
    """On rank 0: this run's own newest checkpoint (torchrun restarted the group), else the one run.sh chose and
    checked (RESUME_PINNED), else, launched by hand, the one run.resume names now, said on the terminal."""
    own = checkpoints.complete_checkpoints(run.checkpoints)
    if own:
        return own[-1]
    pinned = os.environ.get(RESUME_PINNED)
    if pinned is not None:
        return checkpoints.explicit_resume(Path(pinned), resolved) if pinned else None
    chosen = checkpoints.choose_resume(resolved, run.root.parent)
    for line in chosen.lines:
        print(line, file=terminal, flush=True)
    return chosen.checkpoint


def _train(run: RunDir, resolved: Resolved, env: common.RankEnv, terminal, cuda: bool, watchdog) -> int:
    built = _build(run, resolved, env, terminal, cuda, watchdog)
    steps = resolved.recipe.train.steps
    if built.start_step >= steps:  # launched again after it finished (by hand: accelerate launch, twice)
        if env.rank == 0:
            print(f"nothing to do: {built.resume_from.dir} already holds step {built.start_step} of train.steps="
                  f"{steps}; start a new run (a constant train.lr_schedule continues with more train.steps)",
                  file=terminal, flush=True)
        return 0
    s = _start(run, resolved, env, terminal, cuda, watchdog, built, sources(resolved, run.data))
    _finish(s, _steps(s))
    return 0


def _build(run: RunDir, resolved: Resolved, env: common.RankEnv, terminal, cuda: bool, watchdog) -> _Built:
    """Start the process groups, agree on the checkpoint to continue, and have the backend build this rank's model
    and optimizer (and restore them from that checkpoint)."""
    import torch
    import torch.distributed as dist

    r = resolved.recipe
    watchdog.start_by(r.run.startup_timeout_s)
    backend = traits(r.backend).rank_module()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    backend.init_distributed(resolved, cuda)
    if dist.get_world_size() != resolved.world_size:
        raise RuntimeError(f"started with {dist.get_world_size()} ranks but resolved.json expects {resolved.world_size}")
    if env.rank == 0:
        print("\n".join(resolved.grid.describe()), flush=True)

    # Rank 0 decides which checkpoint to continue and tells the others: ranks reading a shared file system
    # on their own could disagree (attribute caches) and then hang or diverge.
    choice = [_resume_choice(run, resolved, terminal) if env.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    resume_from = choice[0]
    universal = False
    if resume_from is not None:
        universal = checkpoints.check_resume_compatible(resume_from, resolved)
        if universal:
            if env.rank == 0:
                checkpoints.to_universal(resume_from)  # normally done by run.sh before launch; cached, so a check
            dist.barrier()

    watchdog.beat(0, "model build")
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    trainer: Trainer = backend.build(BuildContext(run, resolved, env, cuda, device, watchdog, resume_from, universal))
    grid_coords = resolved.grid.coords(env.rank)
    if (trainer.dp_rank, trainer.dp_world) != (grid_coords[1], resolved.grid.dp):
        raise RuntimeError(f"{r.backend} placed rank {env.rank} at data-parallel rank {trainer.dp_rank}/"
                           f"{trainer.dp_world}; the rank grid expects {grid_coords[1]}/{resolved.grid.dp}")
    start_step = 0
    if resume_from is not None:
        watchdog.beat(0, "checkpoint load")
        start_step = trainer.load(resume_from)
        if env.rank == 0:
            print(f"resumed from {resume_from.dir} at step {start_step}" + (" (universal)" if universal else ""),
                  flush=True)
    return _Built(trainer, device, resume_from, start_step)


def _start(run: RunDir, resolved: Resolved, env: common.RankEnv, terminal, cuda: bool, watchdog, built: _Built,
           data: Sources) -> _Training:
    """Open what the steps report to: the metrics records (the meta record first), TensorBoard on rank 0, the
    profilers, the stop vote and the progress line."""
    r = resolved.recipe
    start_step, resume_from = built.start_step, built.resume_from
    flops_per_token = model_flops_per_token(resolved.model, r.batch.seq_len, r.peft)
    split = adapters.parameter_split(resolved.model, r.peft)
    peak = resolved.hardware.peak_flops(r.precision.dtype)
    par = r.parallel
    meta = M.MetaRecord(
        schema_version=M.SCHEMA_VERSION, rank=env.rank, world_size=resolved.world_size, tp=par.tp, pp=par.pp, dp=par.dp,
        recipe=resolved.recipe_name, backend=r.backend, hardware_profile=resolved.hardware.name,
        device="cuda" if cuda else "cpu", peak_flops_per_device=peak, flops_per_token=flops_per_token,
        flops_formula=M.flops_formula(adapters.adapted(r.peft)), tokens_per_step=resolved.tokens_per_step, warmup_steps=r.train.warmup_steps,
        zero_stage=par.zero_stage, dtype=r.precision.dtype, micro_batch_size=r.batch.micro_batch_size,
        global_batch_size=r.batch.global_batch_size, seq_len=r.batch.seq_len,
        param_numel_local=built.trainer.param_numel_local, start_step=start_step,
        resumed_from=str(resume_from.dir) if resume_from else None, startup_s=time.monotonic() - watchdog.started,
        trainable_params=split.trainable, frozen_params=split.frozen)
    writer = M.MetricsWriter(run.metrics(env.rank), meta)
    tb = None
    if env.rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(log_dir=str(run.tensorboard))
    prof = common.make_profiler(resolved, run, env.rank, cuda, start_step)
    if prof is not None:
        prof.start()
    # Nsight Systems records only between cudaProfilerStart and Stop (launch/run/launcher.py: its capture range): the
    # steps the torch profiler would record, not start-up and every step after.
    nsys = common.profiled_steps(resolved, start_step) if r.run.profile == "nsys" and cuda else range(0)
    # A profiled step's trace holds what runs after the previous step too, and the report compares its collectives
    # with the layout's: no stop vote is posted into those steps (a stop waits for them to pass).
    traced = common.profiled_steps(resolved, start_step) if r.run.profile != "none" else range(0)
    vote = common.StopVote(built.device)
    progress = common.ProgressLine(terminal, r.train.steps, start_step, resolved.recipe_name)
    return _Training(run=run, resolved=resolved, env=env, terminal=terminal, cuda=cuda, watchdog=watchdog,
                     trainer=built.trainer, device=built.device, start_step=start_step, data=data,
                     flops_per_token=flops_per_token, peak=peak, writer=writer, tb=tb, prof=prof, nsys=nsys,
                     traced=traced, vote=vote, progress=progress, saving=[])


def _steps(s: _Training) -> int | None:
    """Train from start_step to train.steps, saving checkpoints at their cadence; returns the step at which the stop
    signal ended training early (after saving there), None when every step ran."""
    r = s.resolved.recipe
    pending: _Finished | None = None
    stopped_at = None
    try:
        for step in range(s.start_step, r.train.steps):
            pending = _step(s, step, pending)
            every = r.train.checkpoint_every
            last = step + 1 == r.train.steps
            stopping = s.vote.agreed() and not last  # after the last step nothing is left to stop
            if not (stopping or last or step + 1 in s.traced):
                s.vote.post()
            if stopping or (every and (step + 1) % every == 0) or (last and r.run.save_final):
                _emit(s, pending)  # a checkpoint never runs ahead of the metrics on disk
                pending = None
                _save(s, step + 1)
            if stopping:
                stopped_at = step + 1
                break
    except BaseException:
        with contextlib.suppress(Exception):  # an asynchronous save already written keeps its marker
            _complete_saves(s, wait=False)
        # Keep the last finished step's record: its loss reduction normally completes at once; if a peer
        # is gone it cannot, and a short bounded wait gives up instead of hanging the failure path.
        if pending is not None:
            try:
                if pending.work is None or pending.work.wait(timeout=dt.timedelta(seconds=5)):
                    _emit(s, pending, wait=False)
            except Exception:  # noqa: BLE001 - the original failure is what must surface
                pass
        raise
    _emit(s, pending)
    return stopped_at


def _step(s: _Training, step: int, pending: _Finished | None) -> _Finished:
    """One optimizer step (0-based `step`). The previous step's record is written after it, once this step's
    compute has hidden that step's loss reduction; this step's is returned, to be written one step later."""
    import torch

    r = s.resolved.recipe
    _complete_saves(s, wait=False)
    s.watchdog.beat(step + 1, "step")
    common.inject_fault(s.env.rank, step + 1, s.run)
    lr = lr_at(step, lr=r.train.lr, min_lr=r.train.min_lr, warmup=r.train.lr_warmup_steps,
               total=r.train.steps, schedule=r.train.lr_schedule)
    s.trainer.set_lr(lr)
    if adapters.draws_random(r.peft):
        common.seed_step(r.train.seed, step, s.trainer.dp_rank)
    feed = _Feed(s, step)
    if s.cuda:
        torch.cuda.synchronize()
        if s.nsys and step == s.nsys.start:
            torch.cuda.profiler.start()
    t0 = time.perf_counter()
    with common.region(f"step {step + 1}", s.cuda):
        out = s.trainer.train_step(feed)
    if s.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if s.nsys and step == s.nsys.stop - 1:
        torch.cuda.profiler.stop()
    if s.prof is not None:
        s.prof.step()
    if step == s.start_step:
        # Once per run, after the first step has created the optimizer state: what the planner's
        # weights/grads/optimizer predict, as held between steps (sizes only, no device sync).
        s.run.write_text_atomic(s.run.state_bytes(s.env.rank),
                                json.dumps({**s.trainer.state_bytes(), "after_step": step + 1}))
    loss, work = start_loss_mean(s.trainer, out.loss)
    valid_loss = _evaluate(s, step)
    _emit(s, pending)
    return _Finished(step, lr, seconds, out.grad_norm, loss, work, common.memory_fields(s.cuda),
                     feed.rows * s.trainer.dp_world, feed.seconds, valid_loss, out.loss_scale, out.skipped)


def start_loss_mean(trainer, loss):
    """(the loss as a 4-byte scalar, the all-reduce summing it over data parallelism, or None alone). The mean is
    reduced asynchronously and written one step later, so that the collective overlaps the next step's compute
    instead of sitting on every step's critical path. launch.ranks.rehearse runs it after the step it measures."""
    import torch.distributed as dist

    loss = loss.detach().float().reshape(())
    return loss, (dist.all_reduce(loss, group=trainer.dp_group, async_op=True) if trainer.dp_world > 1 else None)


def _emit(s: _Training, f: _Finished | None, wait: bool = True) -> None:
    """Write a finished step's record; TensorBoard and the progress line every run.log_every steps (evaluations:
    each)."""
    if f is None:
        return
    if f.work is not None and wait:
        f.work.wait()
    r, tokens, world = s.resolved.recipe, s.resolved.tokens_per_step, s.resolved.world_size
    loss = float(f.loss) / s.trainer.dp_world
    tflops = s.flops_per_token * tokens / f.seconds / world / 1e12
    rec = M.StepRecord(
        # Counted from this run's first step: after a resume the first steps are cold again.
        step=f.step + 1, warmup=f.step < s.start_step + r.train.warmup_steps, loss=loss, lr=f.lr,
        grad_norm=f.grad_norm, step_time_s=f.seconds, tokens_per_s=tokens / f.seconds,
        tokens_per_s_per_device=tokens / f.seconds / world, tflops_per_device=tflops,
        mfu=tflops * 1e12 / s.peak if s.peak else 0.0, **f.memory, tokens=f.tokens, data_time_s=f.data_seconds,
        valid_loss=f.valid_loss, loss_scale=f.loss_scale, skipped_step=f.skipped_step)
    s.writer.step(rec)
    if s.tb is not None and rec.valid_loss is not None and math.isfinite(rec.valid_loss):
        s.tb.add_scalar("valid/loss", rec.valid_loss, rec.step)
    if rec.step % r.run.log_every and rec.step != r.train.steps and rec.valid_loss is None:
        return
    if s.tb is not None:
        for k in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s_per_device", "mfu", "loss_scale"):
            v = getattr(rec, k)
            if v is not None and math.isfinite(v):
                s.tb.add_scalar(f"train/{k}", v, rec.step)
    s.progress.update(f.step + 1, f"loss {rec.loss:.4f}  " + ("" if f.valid_loss is None else
                                  f"valid {f.valid_loss:.4f}  ") + f"{rec.step_time_s * 1e3:.0f} ms/step  "
                                  f"{rec.tokens_per_s_per_device:,.0f} tok/s/dev")


def _evaluate(s: _Training, step: int) -> float | None:
    """After every train.eval_every-th step and the last, where there are validation rows (None otherwise): the mean
    loss over the first train.eval_batches global batches of the validation rows (the same rows at every evaluation,
    each data-parallel rank its share as in training), averaged over data-parallel ranks."""
    import torch.distributed as dist

    r, valid, trainer = s.resolved.recipe, s.data.valid, s.trainer
    every = r.train.eval_every
    if valid is None or not every or ((step + 1) % every != 0 and step + 1 != r.train.steps):
        return None
    s.watchdog.beat(step + 1, "evaluation")
    with common.region("evaluation", s.cuda):
        ga, gb = s.resolved.grad_accum, r.batch.global_batch_size
        batches = min(r.train.eval_batches, valid.rows_per_epoch() // gb)

        def micro_batch(k: int):
            return common.micro_batch_tensor(valid, k // ga, s.resolved, trainer.dp_rank, k % ga, s.device)

        counted = list(trainer.layer_calls)  # the layer-call counts are training's (they show recomputation)
        loss = trainer.evaluate(micro_batch, batches * ga).detach().float().reshape(())
        trainer.layer_calls[:] = counted
        if trainer.dp_world > 1:
            dist.all_reduce(loss, group=trainer.dp_group)
        return float(loss) / trainer.dp_world


def _save(s: _Training, step: int) -> None:
    """Save, then mark complete. A save killed half-way leaves a folder without the marker, which resume ignores.
    Asynchronously (run.checkpoint_async), training goes on once the state is copied to host memory; the marker is
    written when the files are (_complete_saves). Each save's blocked time is recorded after its step's record."""
    import torch.distributed as dist

    s.watchdog.beat(step, "checkpoint save")
    tag = f"step{step}"
    t0 = time.perf_counter()
    if s.resolved.recipe.run.checkpoint_async:
        _complete_saves(s, wait=True)  # one save in flight: the next waits for the previous one's files
        s.saving.append(_Saving(tag, step, s.trainer.save_async(s.run.checkpoints, tag, step)))
    else:
        s.trainer.save(s.run.checkpoints, tag, step)
        dist.barrier()
        if dist.get_rank() == 0:
            checkpoints.write_marker(s.run.checkpoints, tag, checkpoints.marker_info(s.resolved, step))
        dist.barrier()
    s.writer.checkpoint(M.CheckpointRecord(step=step, asynchronous=s.resolved.recipe.run.checkpoint_async,
                                           blocked_s=time.perf_counter() - t0))


def _complete_saves(s: _Training, wait: bool) -> None:
    """Mark the asynchronous checkpoints whose files are written: waiting for them, or only those already done.
    torch.distributed.checkpoint's save ends with every rank's write results gathered on rank 0, which then writes
    the metadata: rank 0's future completing means every rank's files are on disk, so rank 0 writes the marker
    without a barrier. A save that failed raises here, on the rank it failed on."""
    for saving in list(s.saving):
        if not (wait or saving.future.done()):
            continue
        saving.future.result()
        if s.env.rank == 0:
            checkpoints.write_marker(s.run.checkpoints, saving.tag, checkpoints.marker_info(s.resolved, saving.step))
        s.saving.remove(saving)


def _finish(s: _Training, stopped_at: int | None) -> None:
    """Close the records and profiler, wait for every rank, and say on rank 0's terminal how training ended."""
    import torch.distributed as dist

    r = s.resolved.recipe
    s.progress.close()
    if s.saving:
        s.watchdog.beat(s.watchdog.step, "checkpoint save")
        _complete_saves(s, wait=True)
    common.write_layer_calls(s.run, s.env.rank, s.trainer.layer_calls)
    if s.prof is not None:
        s.prof.stop()
    s.writer.close()
    if s.tb is not None:
        s.tb.close()
    dist.barrier()
    if s.env.rank == 0 and stopped_at is not None:
        print(f"stopped at step {stopped_at} of {r.train.steps} on {STOP_SIGNAL.name} (SLURM's time-limit warning): "
              f"checkpoint {s.run.checkpoints / f'step{stopped_at}'}; started again (a requeued job is), the run "
              "continues from it", file=s.terminal, flush=True)
    elif s.env.rank == 0:
        print(f"done: {r.train.steps} steps; run directory {s.run.root}", file=s.terminal, flush=True)
