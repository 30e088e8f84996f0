"""Every shipped recipe resolves, and its folder name agrees with its fields."""
import re

import pytest

from launch.config.resolve import resolve_path
from tests.conftest import RECIPES

SHIPPED = sorted(p.parent for p in RECIPES.glob("*/recipe.toml"))
SIZE = {"7b": ("llama-2-7b", "qwen2.5-7b"), "8b": ("llama-3.1-8b",), "0.5b": ("qwen2.5-0.5b",),
        "1.1b": ("tinyllama-1.1b",), "1b": ("tinyllama-1.1b",), "tiny": ("tiny-llama", "tiny-qwen2")}


def test_there_are_recipes():
    assert {p.name for p in SHIPPED} >= {"base", "7b_tp2_zero3"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_recipe_resolves(path):
    r = resolve_path(path)
    assert r.world_size == r.grid.tp * r.grid.pp * r.grid.dp
    assert r.recipe.batch.global_batch_size == r.recipe.batch.micro_batch_size * r.grad_accum * r.grid.dp


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name != "base"], ids=lambda p: p.name)
def test_folder_name_agrees_with_fields(path):
    r = resolve_path(path)
    par = r.recipe.parallel
    tokens = path.name.split("_")
    assert r.model.name in SIZE[tokens[0]], f"{path.name}: size token {tokens[0]} vs model {r.model.name}"
    seen = {}
    for tok in tokens[1:]:
        m = re.fullmatch(r"(tp|pp|dp|vpp|zero)(\d+)", tok)
        if m:
            seen[m.group(1)] = int(m.group(2))
        elif tok == "sp":
            seen["sp"] = True
        elif tok in ("ac", "acsel"):
            seen["ac"] = "full" if tok == "ac" else "selective"
        elif tok in ("offload", "nvme"):
            seen["offload"] = tok
        elif tok == "t4":
            assert r.recipe.hardware.profile == "t4", f"{path.name}: names the T4"
        elif tok in ("ddp", "fsdp2"):  # the torch backend's data parallelism: DDP is stage 0, FSDP2 full sharding 3
            seen["backend"] = "torch"
            seen.setdefault("zero", 0 if tok == "ddp" else 3)
        else:
            pytest.fail(f"{path.name}: unknown name token {tok!r}")
    if "backend" in seen:
        assert r.recipe.backend == seen["backend"]
    assert seen.get("tp", 1) == par.tp
    assert seen.get("pp", 1) == par.pp
    assert seen.get("vpp", 1) == par.vpp
    assert seen.get("zero", 0) == par.zero_stage
    assert seen.get("sp", False) == par.sp
    if "dp" in seen:
        assert seen["dp"] == par.dp
    if "offload" in seen:
        want = "nvme" if seen["offload"] == "nvme" else "cpu"
        assert want in (par.offload_optimizer, par.offload_params)
    else:
        assert par.offload_optimizer == par.offload_params == "none"
