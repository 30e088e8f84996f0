"""The baseline: the smallest FSDP2 loop that trains the same model on the same batches with the same layout and
optimizer settings as a layoutlab torch run at parallel.tp=1 (read from its resolved.json), timing each step the
same way: perf_counter around the whole optimizer step, every micro-batch included.

    torchrun --nproc-per-node WORLD bench/bare_fsdp2.py RUN_DIR OUT.json

Every rank builds the seeded model (the same weights as layoutlab's ranks start from), `fully_shard` on each decoder
block and then the root (reshard_after_forward as parallel.zero_stage says), AdamW, Hugging Face's own loss (labels),
torch's clip_grad_norm_, the recipe's learning-rate schedule.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from launch.config.resolve import Resolved
from launch.config.schema import ADAM_EPS
from launch.data.rows import Synthetic, micro_batch
from launch.torchtools.hf import hf_config
from launch.config.schedule import lr_at

run_dir, out = sys.argv[1], sys.argv[2]
resolved = Resolved.load(os.path.join(run_dir, "resolved.json"))
r, t = resolved.recipe, resolved.recipe.train
assert r.backend == "torch" and r.parallel.tp == 1 and r.parallel.zero_stage in (2, 3), "a torch FSDP2 run at tp=1"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(t.seed)
model = AutoModelForCausalLM.from_config(hf_config(resolved.model), dtype=torch.float32, attn_implementation="eager")
model.config.use_cache = False
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, reshard_after_forward=r.parallel.zero_stage == 3)
fully_shard(model, mesh=mesh, reshard_after_forward=r.parallel.zero_stage == 3)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=ADAM_EPS,
                        weight_decay=t.weight_decay, foreach=True)
src = Synthetic(resolved.model.vocab_size, r.batch.seq_len, t.seed)
positions = torch.arange(r.batch.seq_len).unsqueeze(0)
times, losses, norms = [], [], []
for step in range(t.steps):
    for g in opt.param_groups:
        g["lr"] = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup=t.lr_warmup_steps, total=t.steps, schedule=t.lr_schedule)
    t0 = time.perf_counter()
    total = torch.zeros(())
    for k in range(resolved.grad_accum):
        x = torch.from_numpy(micro_batch(src, step, global_batch=r.batch.global_batch_size, micro=r.batch.micro_batch_size,
                                         dp=world, dp_rank=rank, micro_step=k))
        loss = model(input_ids=x, labels=x, position_ids=positions).loss
        (loss / resolved.grad_accum).backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True).full_tensor()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
    dist.all_reduce(total)
    losses.append(float(total) / resolved.grad_accum / world)
    norms.append(float(norm))
if rank == 0:
    with open(out, "w") as f:
        json.dump({"step_time_s": times, "loss": losses, "grad_norm": norms}, f)
# Leave without interpreter teardown: gloo's background threads have aborted a finished run there ("terminate called
# without an active exception"), as the trainer's loop notes.
os._exit(0)
