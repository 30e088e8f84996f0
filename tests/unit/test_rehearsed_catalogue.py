"""The plan against torch's own memory tracker at full size, for every torch-backend GPU recipe of the catalogue.

recipes/rehearsed.json records what `python -m launch rehearse` measured over each recipe's real step (torch's
FSDPMemTracker / MemTracker on a fake process group, one rank per role: bench/rehearse_catalogue.py writes it, about
ten minutes for the whole catalogue). The plan, as the code computes it now, must stay within 5% of each recorded
peak before its allowance: a change to the planner that moves it away fails here, without rehearsing again."""
import json

import pytest

from launch.commands.catalogue import entries
from launch.run.rehearsal import CATALOGUE, CATALOGUE_SCHEMA
from tests.conftest import RECIPES

RECORD = json.loads((RECIPES / CATALOGUE).read_text())
TORCH_GPU = {e.name: e for e in entries(RECIPES) if e.resolved.recipe.backend == "torch" and not e.on_cpu}


def test_every_torch_gpu_recipe_is_rehearsed_and_nothing_else():
    assert RECORD["schema"] == CATALOGUE_SCHEMA
    assert sorted(RECORD["recipes"]) == sorted(TORCH_GPU)


@pytest.mark.parametrize("name", sorted(TORCH_GPU))
def test_the_plan_is_within_five_percent_of_the_rehearsed_peak(name):
    plan = TORCH_GPU[name].plan
    for rank in RECORD["recipes"][name]["ranks"]:
        rp = next(r for r in plan.ranks if rank["rank"] in r.ranks)
        mem = rp.memory[rp.implementation]
        planned, measured = mem.total - mem.allowance, rank["peak_bytes"]
        assert 0.95 <= planned / measured <= 1.05, (name, planned / 2**30, measured / 2**30)
        # and phase by phase, where the plan has phases (the torch accounting without a pipeline)
        for phase, got in rank["phases"].items():
            assert 0.95 <= mem.phases[phase] / got <= 1.05, (name, phase, mem.phases[phase] / 2**30, got / 2**30)
