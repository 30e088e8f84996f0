"""torchtitan's op policy (train.activation_checkpointing="selective" on the torch backend) planned as torch measures it.

The oracle: `python -m launch rehearse recipes/NAME train.activation_checkpointing=selective` on 2026-12-06 (torch
2.13.0+cpu, transformers 5.24.0): FSDPMemTracker's peak over the real 7B step on a fake process group, FlopCounterMode's
count (attention from the formula, the CPU kernel being uncounted) and the collectives traced by kind, recorded here
as measured (rehearsal.json's peak_bytes_measured, flops_measured)."""
import pytest

from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from launch.plan.collectives import tp_calls
from tests.unit.test_compute_model import REPO

MEASURED = {  # recipe: (peak bytes before the allowance, FLOPs per step)
    "7b_tp2_fsdp2": (36_011_198_108, 837_518_622_720_000.0),
    "7b_tp2_fsdp2_sp": (34_350_237_340, 837_518_622_720_000.0),
}


@pytest.mark.parametrize("recipe", sorted(MEASURED))
def test_the_plan_holds_what_torchs_tracker_measured(recipe):
    peak, flops = MEASURED[recipe]
    resolved = resolve_path(REPO / "recipes" / recipe, ["train.activation_checkpointing=selective"])
    plan = plan_resolved(resolved)
    worst = plan.worst()
    assert worst.memory[worst.implementation].before_allowance == pytest.approx(peak, rel=0.01)
    assert plan.step.hardware_flops_per_step / resolved.world_size == pytest.approx(flops, rel=1e-4)  # per rank


def test_the_op_policy_sits_between_no_checkpointing_and_full():
    def peak(ac):
        plan = plan_resolved(resolve_path(REPO / "recipes/7b_tp2_fsdp2_sp", [f"train.activation_checkpointing={ac}"]))
        return plan.worst().memory[plan.worst().implementation].before_allowance, plan.step

    (none, s_none), (op, s_op), (full, s_full) = (peak(ac) for ac in ("none", "selective", "full"))
    assert full < op < none
    assert s_none.recompute_s == 0 < s_op.recompute_s < s_full.recompute_s


def test_its_recomputation_repeats_the_all_gathers_and_no_reduction():
    """Counted in the traces by tests/dist/test_torch_collectives.py; here the model's answer per micro-batch and layer."""
    def calls(ac):
        return {c.collective: c.layers for c in tp_calls("torch", sp=True, layers=1, micro_batches=1,
                                                          activation_checkpointing=ac, first_stage=False,
                                                          last_stage=False)}

    plain, op = calls("none"), calls("selective")
    assert op["all_gather"] == plain["all_gather"] + 2 and op["reduce_scatter"] == plain["reduce_scatter"]
