"""The plan against torch's own memory tracker at full size, for every torch-backend GPU recipe of the catalogue.

recipes/rehearsed.json records what `python -m launch rehearse` measured over each recipe's real step (torch's
FSDPMemTracker / MemTracker on a fake process group, one rank per role: bench/rehearse_catalogue.py writes it, about
ten minutes for the whole catalogue). The plan, as the code computes it now, must stay within 5% of each recorded
peak before its allowance: a change to the planner that moves it away fails here, without rehearsing again."""
import json

import pytest

from launch.commands.catalogue import entries
from launch.commands.rehearse import rehearsable
from launch.errors import ConfigError
from launch.run.rehearsal import CATALOGUE, CATALOGUE_SCHEMA, recorded_peaks
from tests.conftest import RECIPES

RECORD = json.loads((RECIPES / CATALOGUE).read_text())
TORCH_GPU = {e.name: e for e in entries(RECIPES)
             if e.resolved.recipe.backend == "torch" and not e.on_cpu and rehearsable(e.resolved)}


def test_every_torch_gpu_recipe_is_rehearsed_and_nothing_else():
    assert RECORD["schema"] == CATALOGUE_SCHEMA
    assert sorted(RECORD["recipes"]) == sorted(TORCH_GPU)


@pytest.mark.parametrize("name", sorted(TORCH_GPU))
def test_the_plan_is_within_five_percent_of_the_rehearsed_peak(name):
    plan = TORCH_GPU[name].plan
    for rank in RECORD["recipes"][name]["ranks"]:
        rp = next(r for r in plan.ranks if rank["rank"] in r.ranks)
        mem = rp.memory[rp.implementation]
        planned, measured = mem.before_allowance, rank["peak_bytes"]
        assert 0.95 <= planned / measured <= 1.05, (name, planned / 2**30, measured / 2**30)
        # and phase by phase: every catalogue torch recipe is planned so (no pipeline, no offload)
        assert set(mem.phases) == set(rank["phases"]) == {"forward", "backward", "optimizer step"}, name
        for phase, got in rank["phases"].items():
            assert 0.95 <= mem.phases[phase] / got <= 1.05, (name, phase, mem.phases[phase] / 2**30, got / 2**30)


@pytest.mark.parametrize("damage", ["truncated", "schema", "nan", "no ranks"])
def test_a_damaged_record_is_refused_in_one_line_naming_it(damage, tmp_path):
    text = (RECIPES / CATALOGUE).read_text()
    record = json.loads(text)
    name = sorted(record["recipes"])[0]
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "schema":
        text = json.dumps({**record, "schema": "someone else's"})
    elif damage == "nan":
        record["recipes"][name]["ranks"][0]["peak_bytes"] = float("nan")
        text = json.dumps(record)
    else:
        del record["recipes"][name]["ranks"]
        text = json.dumps(record)
    path = tmp_path / CATALOGUE
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        recorded_peaks(path)
    message = str(e.value)
    assert str(path) in message and "python bench/rehearse_catalogue.py" in message and "\n" not in message
    assert path.read_text() == text  # nothing written over
