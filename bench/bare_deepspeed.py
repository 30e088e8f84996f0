"""The baseline: the smallest DeepSpeed loop that trains the same model on the same batches with the same
config as a layoutlab run (read from its resolved.json), timing each step the same way.

    torchrun --nproc-per-node 2 bench/bare_deepspeed.py RUN_DIR OUT.json
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import sys
import time

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build, as in the trainer
import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from launch.config.resolve import Resolved  # noqa: E402
from launch.data.rows import Synthetic, micro_batch  # noqa: E402
from launch.torchtools.hf import hf_config  # noqa: E402

run_dir, out = sys.argv[1], sys.argv[2]
resolved = Resolved.load(os.path.join(run_dir, "resolved.json"))
r = resolved.recipe
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
torch.manual_seed(r.train.seed)
model = AutoModelForCausalLM.from_config(hf_config(resolved.model), dtype=torch.float32, attn_implementation="eager")
model.train()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(resolved.ds_config))
src = Synthetic(resolved.model.vocab_size, r.batch.seq_len, r.train.seed)
times = []
for step in range(r.train.steps):
    t0 = time.perf_counter()
    for k in range(resolved.grad_accum):
        x = torch.from_numpy(micro_batch(src, step, global_batch=r.batch.global_batch_size, micro=r.batch.micro_batch_size,
                                         dp=world, dp_rank=rank, micro_step=k))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    times.append(time.perf_counter() - t0)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"step_time_s": times}, f)
os._exit(0)
