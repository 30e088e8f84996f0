"""DeepSpeed backend: ZeRO 0-3, CPU/NVMe offload and AutoTP on a Hugging Face causal LM.

One code path for CPU ranks (gloo, DS_ACCELERATOR=cpu) and GPUs (NCCL). Parallelism is applied in
a fixed order from the rank grid in resolved.json: (1) tensor parallelism — AutoTP shards the decoder
Linear layers over consecutive ranks; (2) data parallelism — ZeRO partitions optimizer state,
gradients and (stage 3) parameters over the remaining data-parallel group.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from launch import metrics as M
from launch.planner import model_flops_per_token
from launch.resolve import Resolved
from launch.rundir import RunDir
from launch.schedule import lr_at
from launch.trainers import common
from launch.trainers.common import ResumeError, check_resume_compatible


def _no_jit_comm_op() -> None:
    # DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce op (minutes of C++ compile)
    # the first time comm initialises; gloo does the job without it, so mark the op incompatible.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def to_universal(ckpt: common.Checkpoint) -> Path:
    """Convert a checkpoint to DeepSpeed's universal format once (cached beside it)."""
    out = ckpt.path / f"{ckpt.tag}_universal"
    done = out / "layoutlab_converted"
    if done.is_file():
        return out
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt.dir),
           "--output_folder", str(out)]
    if ckpt.info["zero_stage"] in (1, 2):
        cmd.append("--inject_missing_state")  # ZeRO-1/2 shards lack what the universal loader expects
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ResumeError(f"{ckpt.dir}: ds_to_universal failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    done.write_text("ok")
    return out


def main(run_dir: str) -> int:
    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)
    r = resolved.recipe
    env = common.rank_env()
    terminal = common.redirect_logs(run, env.rank)
    cuda = resolved.hardware.name != "cpu"
    if cuda:
        os.environ.setdefault("NCCL_DEBUG_FILE", str(run.nccl_log(env.rank)))
    watchdog = common.Watchdog(env.rank, float(r.run.timeout_s), terminal if env.rank == 0 else None)
    step = 0
    try:
        rc = _train(run, resolved, env, terminal if env.rank == 0 else None, cuda, watchdog)
        # Every record, checkpoint and marker is on disk and all ranks passed the final barrier. Leave
        # without interpreter teardown: DeepSpeed/gloo background threads have aborted a finished
        # ZeRO-3 run there ("terminate called without an active exception"), turning success into failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    except ResumeError as e:
        print(f"layoutlab: {e}", file=sys.stderr)
        if env.rank == 0:
            print(f"layoutlab: {e}", file=terminal)
        return 2
    except BaseException as e:  # noqa: BLE001 - name the rank and step, then let torchrun stop the others
        msg = common.fail_message(env.rank, watchdog.step or step, e)
        print(msg, file=sys.stderr, flush=True)
        print(msg, file=terminal, flush=True)
        raise
    finally:
        watchdog.stop()


def _train(run: RunDir, resolved: Resolved, env: common.RankEnv, terminal, cuda: bool, watchdog) -> int:
    import torch

    _no_jit_comm_op()
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    r = resolved.recipe
    par = r.parallel
    if cuda:
        torch.cuda.set_device(env.local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo",
                               timeout=dt.timedelta(seconds=r.run.timeout_s))
    if dist.get_world_size() != resolved.world_size:
        raise RuntimeError(f"started with {dist.get_world_size()} ranks but resolved.json expects {resolved.world_size}")
    if env.rank == 0:
        print("\n".join(resolved.grid.describe()), flush=True)

    ds_config = json.loads(json.dumps(resolved.ds_config))
    start_step = 0
    # Rank 0 decides which checkpoint to continue and tells the others: ranks reading a shared file system
    # on their own could disagree (attribute caches) and then hang or diverge.
    choice = [common.find_resume(run.root.parent, resolved)[0] if r.run.resume == "auto" and env.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    resume_from = choice[0]
    universal = False
    if resume_from is not None:
        universal = check_resume_compatible(resume_from, resolved)
        if universal:
            if env.rank == 0:
                to_universal(resume_from)  # normally done by run.sh before launch; cached, so this is a check
            dist.barrier()
            ds_config.setdefault("checkpoint", {})["load_universal"] = True

    watchdog.beat(0, "model build")
    model = common.build_model(resolved, cuda)
    if r.train.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()  # transformers builds models in eval mode, where it silently skips gradient checkpointing
    layer_calls = common.count_layer_calls(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    # Step 1 of the fixed order happened inside initialize (AutoTP), step 2 (ZeRO) too; log the result.
    if par.tp > 1:
        dp_rank, dp_world = groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
        dp_group = groups.get_data_parallel_group()
    else:
        dp_rank, dp_world, dp_group = dist.get_rank(), dist.get_world_size(), None
    grid_coords = resolved.grid.coords(env.rank)
    if (dp_rank, dp_world) != (grid_coords[1], resolved.grid.dp):
        raise RuntimeError(f"DeepSpeed placed rank {env.rank} at data-parallel rank {dp_rank}/{dp_world}; the rank grid "
                          f"expects {grid_coords[1]}/{resolved.grid.dp}")

    if resume_from is not None:
        watchdog.beat(0, "checkpoint load")
        load_dir = resume_from.path
        tag = f"{resume_from.tag}_universal" if universal else resume_from.tag
        path, client = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise ResumeError(f"{resume_from.dir}: DeepSpeed could not load this checkpoint")
        start_step = int((client or {}).get("step", resume_from.step))
        if env.rank == 0:
            print(f"resumed from {resume_from.dir} at step {start_step}" + (" (universal)" if universal else ""),
                  flush=True)

    source = common.data_source(resolved)
    flops_per_token = model_flops_per_token(resolved.model, r.batch.seq_len)
    peak = resolved.hardware.peak_flops(r.precision.dtype)
    meta = M.MetaRecord(
        schema_version=M.SCHEMA_VERSION, rank=env.rank, world=resolved.world_size, tp=par.tp, pp=par.pp, dp=par.dp,
        recipe=resolved.recipe_name, backend="deepspeed", hardware_profile=resolved.hardware.name,
        device="cuda" if cuda else "cpu", peak_flops_per_device=peak, flops_per_token=flops_per_token,
        flops_formula=M.FLOPS_FORMULA, tokens_per_step=resolved.tokens_per_step, warmup_steps=r.train.warmup_steps,
        zero_stage=par.zero_stage, dtype=r.precision.dtype, micro_batch_size=r.batch.micro_batch_size,
        global_batch_size=r.batch.global_batch_size, seq_len=r.batch.seq_len,
        param_numel_local=local_param_numel(engine.module), start_step=start_step,
        resumed_from=str(resume_from.dir) if resume_from else None)
    writer = M.MetricsWriter(run.metrics(env.rank), meta)
    tb = None
    if env.rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(log_dir=str(run.tensorboard))
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    prof = common.make_profiler(resolved, run, env.rank, cuda, start_step)
    if prof is not None:
        prof.start()
    progress = common.ProgressLine(terminal, r.train.steps, start_step, resolved.recipe_name)
    ga = resolved.grad_accum
    tokens = resolved.tokens_per_step
    pending = None

    def emit(p) -> None:
        if p is None:
            return
        step_, lr_, seconds, gn, mean, work, mem = p
        if work is not None:
            work.wait()
        loss = float(mean) / dp_world
        tflops = flops_per_token * tokens / seconds / resolved.world_size / 1e12
        rec = M.StepRecord(
            # Counted from this run's first step: after a resume the first steps are cold again.
            step=step_ + 1, warmup=step_ < start_step + r.train.warmup_steps, loss=loss, lr=lr_,
            grad_norm=None if gn is None else float(gn), step_time_s=seconds, tokens_per_s=tokens / seconds,
            tokens_per_s_per_device=tokens / seconds / resolved.world_size, tflops_per_device=tflops,
            mfu=tflops * 1e12 / peak if peak else 0.0, **mem)
        writer.step(rec)  # every step; TensorBoard and the progress line every run.log_every steps
        if rec.step % r.run.log_every and rec.step != r.train.steps:
            return
        if tb is not None:
            for k in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s_per_device", "mfu"):
                v = getattr(rec, k)
                if v is not None and math.isfinite(v):
                    tb.add_scalar(f"train/{k}", v, rec.step)
        progress.update(step_ + 1, f"loss {rec.loss:.4f}  {rec.step_time_s * 1e3:.0f} ms/step  "
                                   f"{rec.tokens_per_s_per_device:,.0f} tok/s/dev")

    try:
        for step in range(start_step, r.train.steps):
            watchdog.beat(step + 1, "step")
            common.inject_fault(env.rank, step + 1)
            lr = lr_at(step, lr=r.train.lr, min_lr=r.train.min_lr, warmup=r.train.lr_warmup_steps,
                       total=r.train.steps, schedule=r.train.lr_schedule)
            for group in engine.optimizer.param_groups:
                group["lr"] = lr
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses = []
            own_norm = None
            with common.region(f"step {step + 1}", cuda):
                for micro in range(ga):
                    batch = common.micro_batch_tensor(source, step, resolved, dp_rank, micro, device)
                    with common.region("forward", cuda):
                        loss = engine(input_ids=batch, labels=batch).loss
                    with common.region("backward", cuda):
                        engine.backward(loss)
                    if micro == ga - 1 and par.zero_stage == 0 and par.tp == 1:
                        own_norm = _grad_norm(engine.module)  # DeepSpeed reports none without ZeRO
                    with common.region("optimizer", cuda):
                        engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
                    losses.append(loss.detach().float())
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if prof is not None:
                prof.step()
            # The data-parallel mean of the loss is reduced asynchronously and written one step later, so
            # the collective overlaps the next step's compute instead of sitting on every step's critical path.
            mean = torch.stack(losses).mean()
            work = dist.all_reduce(mean, group=dp_group, async_op=True) if dp_world > 1 else None
            gn = engine.get_global_grad_norm()
            gn = own_norm if gn is None else gn
            emit(pending)
            pending = (step, lr, seconds, gn, mean, work, common.memory_fields(cuda))
            every = r.train.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == r.train.steps:
                emit(pending)  # a checkpoint never runs ahead of the metrics on disk
                pending = None
                watchdog.beat(step + 1, "checkpoint save")
                save(engine, run, resolved, step + 1, dist)
    except BaseException:
        # Keep the last finished step's record: its loss reduction normally completes at once; if a peer
        # is gone it cannot, and a short bounded wait gives up instead of hanging the failure path.
        if pending is not None:
            try:
                if pending[5] is None or pending[5].wait(timeout=dt.timedelta(seconds=5)):
                    emit((*pending[:5], None, pending[6]))
            except Exception:  # noqa: BLE001 - the original failure is what must surface
                pass
        raise
    emit(pending)
    progress.close()
    common.write_layer_calls(run, env.rank, layer_calls)
    if prof is not None:
        prof.stop()
    writer.close()
    if tb is not None:
        tb.close()
    dist.barrier()
    if env.rank == 0:
        print(f"done: {r.train.steps} steps; run directory {run.root}", file=terminal, flush=True)
    return 0


def _grad_norm(module) -> float:
    """Pre-clipping L2 norm of the (already data-parallel averaged) gradients of an unsharded model."""
    import torch

    sq = sum(float(p.grad.detach().float().pow(2).sum()) for p in module.parameters() if p.grad is not None)
    return float(torch.tensor(sq).sqrt())


def local_param_numel(module) -> int:
    """Elements this rank stores: a ZeRO-3 parameter's own partition (ds_tensor), else the tensor."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())


def save(engine, run: RunDir, resolved: Resolved, step: int, dist) -> None:
    """Save, then mark complete. A save killed half-way leaves a folder without the marker, which resume ignores."""
    tag = f"step{step}"
    engine.save_checkpoint(str(run.checkpoints), tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        par = resolved.recipe.parallel
        common.write_marker(run.checkpoints, tag, {
            "step": step, "backend": "deepspeed", "tp": par.tp, "pp": par.pp, "dp": par.dp,
            "zero_stage": par.zero_stage, "model": resolved.model.name,
            "identity": common.training_identity(resolved),
        })
    dist.barrier()
