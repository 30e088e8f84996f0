"""Model-state bytes every rank holds (logs/state_bytes_rank{R}.json, written by the loop after the first
optimizer step through launch/ranks/trainers/common.py `model_state_bytes`) against plan.json's implementation
accounting (`ranks[...].memory[implementation]`), within 2%. All runs are fp32 on gloo CPU ranks.

The plan's weights, grads and optimizer are what a rank holds at its peak, during the backward and the step;
the measurement is what DeepSpeed 0.19.8 (or Megatron-Core's distributed optimizer, at the megatron backend's
ZeRO-1, exactly as planned) keeps between steps. Where the two differ by design, the expected
value is the plan's adjusted by a named term, so that a change on either side fails here:
  * grads, ZeRO 0-2: DeepSpeed frees every gradient inside the step (the engine's zero_grad; the ZeRO-1/2
    optimizer's free_grad_in_param_list and `.grad = None` of the fp32 partition), so none are held between
    steps. ZeRO-3 keeps its fp32 gradient partition buffer (grad_partitions_flat_buffer): the plan's 4 B/N.
  * ZeRO-3 weights and grads: the plan adds the largest layer gathered (its parameters × the element size,
    each), alive only while that layer runs; it is not held between steps.
  * ZeRO-3 weights: DeepSpeed keeps parameters of at most stage3_param_persistence_threshold elements gathered
    in full beside their partition, which the plan does not count; in the tiny model that is every parameter.
"""
from __future__ import annotations

import json

import pytest

from launch.config.backends import traits
from launch.plan.layout import Layout

from launch.plan.memory import fsdp_gathered, largest_layer_params, rank_parameters
from launch.config.resolve import Resolved
from tests.dist.conftest import DS_DP2, MEGATRON, MEGATRON_LAYOUTS, SHORT, TINY, TORCH, TORCH_LAYOUTS, two_ranks_first

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CATEGORIES = ("weights", "grads", "optimizer")
# The parity tests' runs of these layouts: the state after the first step does not depend on how many follow.
RUNS = {
    "megatron_tp2_sp_zero0": (MEGATRON, (*SHORT, *MEGATRON_LAYOUTS["tp2_sp"])),
    "megatron_dp2_zero1": (MEGATRON, (*SHORT, *MEGATRON_LAYOUTS["dp2_zero1"])),
    "megatron_tp2_dp2_zero3": (MEGATRON, (*SHORT, *MEGATRON_LAYOUTS["tp2_dp2_zero3"])),
    "deepspeed_dp2_zero2": (TINY, DS_DP2[2]),
    "torch_ddp": (TORCH, (*SHORT, *TORCH_LAYOUTS["ddp"])),
    "torch_fsdp2_z3": (TORCH, (*SHORT, *TORCH_LAYOUTS["fsdp2_z3"])),
    "torch_tp2_dp2_sp": (TORCH, (*SHORT, *TORCH_LAYOUTS["tp2_dp2_sp"])),
    "torch_pp2_dp2_z2": (TORCH, (*SHORT, *TORCH_LAYOUTS["pp2_dp2_z2"])),
    "torch_hsdp": (TORCH, (*SHORT, *TORCH_LAYOUTS["hsdp"])),
}


def between_steps(memory: dict, layout: Layout, params: int, stage: int) -> dict[str, int]:
    """The plan's model states as DeepSpeed holds them between steps (the terms in the module docstring)."""
    want = {k: memory[k] for k in CATEGORIES}
    if layout.backend == "torch":
        return torch_between_steps(want, layout, params, stage)
    if traits(layout.backend).distributed_optimizer(layout.zero_stage):
        return want  # Megatron's DDP keeps its gradient buffer between steps; the optimizer shards as planned
    if layout.zero_stage <= 2:
        want["grads"] = 0
        return want
    gathered = layout.elem_bytes * largest_layer_params(layout)
    threshold = int(layout.ds_zero.get("stage3_param_persistence_threshold", 100_000))
    # Megatron fuses at most three of the planner's tensors (QKV); every fused tensor stays under the threshold.
    assert 3 * max(rank_parameters(layout, 0)) <= threshold, "not every parameter persists: adjust this test"
    want["weights"] = memory["weights"] - gathered + layout.elem_bytes * params
    want["grads"] = memory["grads"] - gathered
    return want


@pytest.mark.parametrize("name", two_ranks_first({n: o for n, (_, o) in RUNS.items()}))
def test_state_bytes_match_plan(shared_run, name):
    recipe, overrides = RUNS[name]
    run = shared_run(*overrides, recipe=recipe)
    plan = json.loads((run.root / "plan.json").read_text())
    layout = Layout.from_resolved(Resolved.load(run.root / "resolved.json"))
    assert layout.dtype == "fp32"
    rows, bad = [], []
    for rp in plan["ranks"]:
        memory = rp["memory"][rp["implementation"]]
        want = between_steps(memory, layout, rp["params"], rp["pp_stage"])
        for rank in rp["ranks"]:
            have = json.loads((run.root / "logs" / f"state_bytes_rank{rank}.json").read_text())
            assert have["after_step"] == 1
            for k in CATEGORIES:
                rows.append(f"rank {rank} {k}: measured {have[k]}, plan {memory[k]}, expected {want[k]}")
                if abs(have[k] - want[k]) > 0.02 * want[k]:
                    bad.append(rows[-1])
    assert not bad, "\n".join(bad + ["all:"] + rows)


def torch_between_steps(want: dict[str, int], layout: Layout, params: int, stage: int) -> dict[str, int]:
    """The torch accounting as PyTorch holds it between steps. DDP: as planned (fp32 parameters, the reduce buckets its
    gradients are views of, AdamW's m and v; these runs are fp32, so no autocast copies). FSDP2: the plan's gathered
    units (`fsdp_gathered`, alive only while they compute) are resharded, and zero_grad frees the sharded gradients.
    Without a pipeline the plan's kinds are those of its peak phase (launch.plan.memory.torch_phases), where what is
    gathered depends on the phase: between steps a rank holds its fp32 shard, 4 B a parameter over the shard group."""
    if layout.zero_stage == 0:
        return want
    if layout.grid.pp == 1:
        shard = -(-params // (layout.hpz if layout.hpz > 1 else layout.grid.dp))  # FSDP2 shards over dp (or hpZ)
        return {**want, "weights": 4 * shard, "grads": 0}
    return {**want, "weights": want["weights"] - layout.elem_bytes * fsdp_gathered(layout, params, stage), "grads": 0}
