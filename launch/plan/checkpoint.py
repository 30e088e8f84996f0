"""What one checkpoint save costs: its bytes, the time its files take to write, and how long training stands still for
it: the whole write when it is synchronous; with run.checkpoint_async (DCP's async_save), only the copy of each rank's
state to host memory, the files then being written behind training."""
from __future__ import annotations

from typing import Sequence

from launch.config import adapters
from launch.config.backends import traits
from launch.plan.adapters import rank_split
from launch.plan.layout import CheckpointCost, Layout, RankPlan

ADAM_MOMENT_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32, per parameter
MASTER_BYTES = 4  # an fp32 copy of a parameter


def bytes_per_parameter(layout: Layout) -> int:
    """Per parameter that trains (under [peft] the adapters: the base is rebuilt from the recipe's weights at start-up,
    so a save holds the adapters and their optimizer state alone). DCP (torch): the fp32 parameters and AdamW's
    moments. DeepSpeed's files and Megatron's distributed optimizer's: the model in the compute dtype, beside the fp32
    master copy and the moments."""
    if traits(layout.backend).checkpoint_format == "dcp":
        return MASTER_BYTES + ADAM_MOMENT_BYTES
    return layout.elem_bytes + MASTER_BYTES + ADAM_MOMENT_BYTES


def _held(layout: Layout, params: int) -> int:
    """One rank's part of the checkpoint, as the rank holds it: sharded where ZeRO / FSDP2 shards it. `params`: the
    rank's parameters (the base's under [peft], whose adapters are what it saves)."""
    params = rank_split(layout, params).trainable
    z, d = layout.zero_stage, layout.grid.dp
    shard = layout.hpz if layout.hpz > 1 else d
    if traits(layout.backend).checkpoint_format == "dcp":  # FSDP2 shards parameters and moments alike, DDP neither
        return -(-(MASTER_BYTES + ADAM_MOMENT_BYTES) * params // (shard if z >= 2 else 1))
    model = layout.elem_bytes * params // (shard if z == 3 else 1)
    return model + -(-(MASTER_BYTES + ADAM_MOMENT_BYTES) * params // (d if z >= 1 else 1))


def checkpoint_cost(layout: Layout, ranks: Sequence[RankPlan], asynchronous: bool) -> CheckpointCost:
    hw, g = layout.hardware, layout.grid
    per = bytes_per_parameter(layout)
    total = per * adapters.parameter_split(layout.model, layout.peft).trainable
    held = max(_held(layout, r.params) for r in ranks)
    write = total / (g.nodes * hw.checkpoint_write_GBps * 1e9) if hw.checkpoint_write_GBps else 0.0
    copy = held / (hw.host_copy_GBps * 1e9) if hw.host_copy_GBps else 0.0
    return CheckpointCost(total, per, held, write, copy if asynchronous else write, asynchronous)
