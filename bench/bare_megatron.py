"""The baseline: the smallest Megatron-Core loop that trains the same model on the same batches with the same
layout and optimizer settings as a layoutlab megatron run (read from its resolved.json), timing each step the
same way: perf_counter around the whole optimizer step, every micro-batch included.

    torchrun --nproc-per-node WORLD bench/bare_megatron.py RUN_DIR OUT.json

Megatron's own data parallelism: its DistributedDataParallel (contiguous fp32 grad buffer, `main_grad`) and
`finalize_model_grads` run by the schedule, then Megatron's clip-by-global-norm (the norm over parameters that
are not TP duplicates, summed over the model-parallel group) and torch.optim.AdamW on `main_grad`, as
/work/shared/probes/mcore_train_probe.py does: unpatched, Megatron's FP32Optimizer and DistributedOptimizer allocate
on 'cuda' (layoutlab's own ZeRO-1 redirects that, launch/ranks/trainers/cpu_compat.py). Only zero_stage 0 is like for
like (DeepSpeed ZeRO-0 over the same DP group on layoutlab's side).
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import datetime as dt
import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from launch.config.resolve import Resolved
from launch.data.rows import micro_batch
from launch.config.schedule import lr_at
from launch.ranks.trainers import cpu_compat
from launch.ranks.trainers import megatron_model as mm
from launch.ranks.data import sources

cpu_compat.apply()  # Megatron-Core on CPU ranks, as the trainer runs it (a no-op with CUDA)

run_dir, out = sys.argv[1], sys.argv[2]
resolved = Resolved.load(os.path.join(run_dir, "resolved.json"))
r, par, t = resolved.recipe, resolved.recipe.parallel, resolved.recipe.train
if par.zero_stage != 0:
    sys.exit(f"bare_megatron: the run has parallel.zero_stage={par.zero_stage}; this baseline has no ZeRO, "
             "so only parallel.zero_stage=0 compares like for like")
opt_cfg = resolved.ds_config["optimizer"]
if opt_cfg["type"] != "AdamW":
    sys.exit(f"bare_megatron: the run's optimizer is {opt_cfg['type']}; this baseline runs torch AdamW")

dist.init_process_group("gloo", timeout=dt.timedelta(seconds=r.run.timeout_s))
ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                             virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None, order="tp-dp-pp")
config = mm.transformer_config(resolved.model, tp=par.tp, pp=par.pp, vpp=par.vpp, sp=par.sp,
                               activation_checkpointing=t.activation_checkpointing, dtype=r.precision.dtype)
chunks = mm.build_chunks(resolved.model, config, seed=t.seed, attention=resolved.recipe.train.attention)
mm.load_hf_state(chunks, mm.hf_reference_state(resolved.model, t.seed), resolved.model)
model = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=c) for c in chunks]
config.finalize_model_grads_func = finalize_model_grads
params = [p for m in model for p in m.parameters()]
hyper = {k: v for k, v in opt_cfg["params"].items() if k in ("lr", "betas", "eps", "weight_decay")}
opt = torch.optim.AdamW(params, **hyper)
grads_for_norm = [p for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]

dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
source = sources(resolved).train
S, MB, GA = r.batch.seq_len, r.batch.micro_batch_size, resolved.grad_accum


def inputs(step, k):
    rows = torch.from_numpy(micro_batch(source, step, global_batch=r.batch.global_batch_size, micro=MB, dp=dp,
                                        dp_rank=dp_rank, micro_step=k))
    labels = torch.roll(rows, -1, dims=1)  # predict token i+1; the last position is masked
    mask = torch.ones_like(rows, dtype=torch.float32)
    mask[:, -1] = 0.0
    return rows, torch.arange(S).unsqueeze(0).expand_as(rows), labels, mask


def loss_func(mask, per_token):
    loss = (per_token.float() * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, m):
    tokens, position_ids, labels, mask = next(data_iterator)
    return m(tokens, position_ids, None, labels=labels), partial(loss_func, mask)


def clip(max_norm):
    """Megatron's clip_grad_norm for a non-distributed optimizer (get_grad_norm_fp32 over the model-parallel
    group, then clip_grad_by_total_norm_fp32), on CPU tensors: those two allocate and assert on 'cuda'."""
    sq = torch.stack(torch._foreach_norm([p.grad for p in grads_for_norm])).square().sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([p.grad for p in params], max_norm / (norm + 1e-6))
    return norm


fwd_bwd = get_forward_backward_func()
times, losses, norms = [], [], []
for step in range(t.steps):
    lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup=t.lr_warmup_steps, total=t.steps, schedule=t.lr_schedule)
    for g in opt.param_groups:
        g["lr"] = lr
    t0 = time.perf_counter()
    for m in model:
        m.zero_grad_buffer()
    batches = [inputs(step, k) for k in range(GA)]
    stored = fwd_bwd(forward_step_func=forward_step,
                     data_iterator=[iter(batches) for _ in model] if len(model) > 1 else iter(batches),
                     model=model if len(model) > 1 else model[0], num_microbatches=GA, seq_length=S,
                     micro_batch_size=MB, forward_only=False)
    for p in params:
        p.grad = p.main_grad  # the DDP buffer, already reduced over DP by finalize_model_grads
    norms.append(clip(t.grad_clip))
    opt.step()
    opt.zero_grad(set_to_none=True)  # before the next backward: DDP's hook adds param.grad into main_grad
    times.append(time.perf_counter() - t0)
    losses.append(torch.stack([d["loss"] for d in stored]).mean() if stored else torch.zeros(()))

# Untimed: every rank's loss as layoutlab records it (the last stage's, averaged over DP).
loss = torch.stack(losses)
if par.pp > 1:
    group = ps.get_pipeline_model_parallel_group()
    dist.broadcast(loss, src=dist.get_process_group_ranks(group)[-1], group=group)
dist.all_reduce(loss, group=ps.get_data_parallel_group())
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"step_time_s": times, "loss": (loss / dp).tolist(), "grad_norm": norms}, f)
dist.barrier()
os._exit(0)
