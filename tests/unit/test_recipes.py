"""Every shipped recipe resolves, its folder name agrees with its fields, every GPU recipe fits its own plan (or
says it is shipped to show that it does not), and each has a tiny twin whose layout is its own."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from tests.conftest import REPO, RECIPES

SHIPPED = sorted(p.parent for p in RECIPES.glob("*/recipe.toml"))
SIZE = {"7b": ("llama-2-7b", "qwen2.5-7b"), "8b": ("llama-3.1-8b",), "70b": ("llama-3.1-70b",),
        "0.5b": ("qwen2.5-0.5b",), "1.1b": ("tinyllama-1.1b",), "1b": ("tinyllama-1.1b",),
        "tiny": ("tiny-llama", "tiny-qwen2", "tiny-llama2")}
# A twin is named tiny_<sibling>; its name's layout tokens are its sibling's, checked through the sibling.
TWINS = {p: RECIPES / p.name.removeprefix("tiny_") for p in SHIPPED
         if p.name.startswith("tiny_") and (RECIPES / p.name.removeprefix("tiny_") / "recipe.toml").is_file()}
GPU = [p for p in SHIPPED if p.name != "base" and resolve_path(p).recipe.hardware.profile != "cpu"]


def test_there_are_recipes():
    assert {p.name for p in SHIPPED} >= {"base", "7b_tp2_zero3"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_recipe_resolves(path):
    r = resolve_path(path)
    assert r.world_size == r.grid.tp * r.grid.pp * r.grid.dp
    assert r.recipe.batch.global_batch_size == r.recipe.batch.micro_batch_size * r.grad_accum * r.grid.dp


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name != "base" and p not in TWINS], ids=lambda p: p.name)
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
            seen["activation_checkpointing"] = "full" if tok == "ac" else "selective"
        elif tok in ("offload", "nvme"):
            seen["offload"] = tok
        elif tok == "t4":
            assert r.recipe.hardware.profile == "t4", f"{path.name}: names the T4"
        elif tok in ("ddp", "fsdp2"):  # the torch backend's data parallelism: DDP is stage 0, FSDP2 full sharding 3
            seen["backend"] = "torch"
            seen.setdefault("zero", 0 if tok == "ddp" else 3)
        elif tok in ("lora", "qlora"):
            seen["peft"] = tok
        elif m := re.fullmatch(r"(\d+)gpus?", tok):
            assert r.world_size == int(m.group(1)), f"{path.name}: {tok} vs world size {r.world_size}"
        elif m := re.fullmatch(r"(\d+)gb", tok):  # the card's memory, as its datasheet rounds it
            assert round(r.hardware.memory_bytes / 1e9) == int(m.group(1)), f"{path.name}: {tok}"
        else:
            pytest.fail(f"{path.name}: unknown name token {tok!r}")
    if "backend" in seen:
        assert r.recipe.backend == seen["backend"]
    assert seen.get("tp", 1) == par.tp
    assert seen.get("pp", 1) == par.pp
    assert seen.get("vpp", 1) == par.vpp
    assert seen.get("zero", 0) == par.zero_stage
    assert seen.get("sp", False) == par.sp
    assert seen.get("activation_checkpointing", "none") == r.recipe.train.activation_checkpointing
    assert seen.get("peft", "none") == r.recipe.peft.method
    if "dp" in seen:
        assert seen["dp"] == par.dp
    if "offload" in seen:
        want = "nvme" if seen["offload"] == "nvme" else "cpu"
        assert want in (par.offload_optimizer, par.offload_params)
    else:
        assert par.offload_optimizer == par.offload_params == "none"


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.name)
def test_gpu_recipe_fits_its_own_plan_or_says_it_does_not(path):
    """Planned as `run.sh` plans it: a recipe that does not fit is refused by the run, so a shipped one either fits
    with its profile's headroom or is marked `plan.expect_fit = false` (shipped to show why), and then does not fit."""
    r = resolve_path(path)
    plan = plan_resolved(r)
    assert plan.fits == r.recipe.plan.expect_fit, (path.name, plan.fits)
    if not plan.fits:  # the run refuses it before any rank starts: one line, exit 2
        p = subprocess.run([sys.executable, "-m", "launch", "run", str(path)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "exceeds the usable" in p.stderr and "shipped to show a layout that does not fit" in p.stderr


def test_every_gpu_recipe_has_a_tiny_twin():
    assert sorted(TWINS.values()) == GPU


# The fields of a layout: a twin differs from its sibling in the model, the hardware, the batch and the precision only.
LAYOUT_FIELDS = ("sp", "vpp", "zero_stage", "offload_optimizer", "offload_params")


@pytest.mark.parametrize("twin", sorted(TWINS), ids=lambda p: p.name)
def test_tiny_twin_has_its_siblings_layout(twin):
    """Equal in every parallel field; a sibling of more than 4 GPUs keeps each dimension it uses at 2 in its twin
    (4 CPU ranks at most), its data parallelism taking what is left."""
    sibling = TWINS[twin]
    t, s = resolve_path(twin), resolve_path(sibling)
    assert Path(t.chain[-2]).resolve() == (sibling / "recipe.toml").resolve(), t.chain  # it extends its sibling
    assert t.recipe.backend == s.recipe.backend
    assert t.recipe.hardware.profile == "cpu" and t.world_size <= 4
    for field in LAYOUT_FIELDS:
        assert getattr(t.recipe.parallel, field) == getattr(s.recipe.parallel, field), field
    assert t.recipe.train.activation_checkpointing == s.recipe.train.activation_checkpointing
    assert t.recipe.peft == s.recipe.peft  # a fine-tune's twin trains the same adapters
    assert t.recipe.train.attention == s.recipe.train.attention
    if s.world_size <= 4:
        assert (t.grid.tp, t.grid.pp, t.grid.dp) == (s.grid.tp, s.grid.pp, s.grid.dp)
    else:
        tp, pp = min(s.grid.tp, 2), min(s.grid.pp, 2)
        assert (t.grid.tp, t.grid.pp, t.grid.dp) == (tp, pp, 4 // (tp * pp))


def test_the_7b_matrix_dry_runs_in_under_5_s():
    """The seed's matrix as the issue asks for it: every 7B cell, its peers and the layouts that do not fit, planned
    by one `sweep.sh --dry-run`."""
    matrix = sorted(p for p in SHIPPED if p.name.startswith("7b_"))
    assert len(matrix) >= 10
    start = time.monotonic()
    p = subprocess.run(["bash", "launch/sweep.sh", *map(str, matrix), "--dry-run"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - start
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for path in matrix:
        assert re.search(rf"^\S*\s*{re.escape(path.name)}\b", p.stdout, re.M), path.name
    assert took < 5, took


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.name)
def test_gpu_recipe_readme_says_what_its_layout_teaches(path):
    """Two or three sentences of its own above the generated numbers (python -m launch docs writes those)."""
    text = (path / "README.md").read_text()
    above, marker, _ = text.partition("<!-- numbers:begin -->")
    assert marker, f"{path.name}/README.md has no generated numbers"
    heading, description, *prose = [block for block in above.strip().split("\n\n") if block.strip()]
    assert heading == f"# {path.name}" and description == resolve_path(path).recipe.description
    assert len(re.findall(r"[.!?](?:\s|$)", " ".join(prose))) >= 2, prose


def test_the_tiny_matrix_report_in_docs_covers_every_7b_twin():
    """docs/tiny_matrix/report.md (bash docs/make_tiny_matrix.sh): our report's own first line, a run row for every
    twin of the 7B matrix (read by this test's regex), each run's Kineto traces read into where the time went."""
    report = (REPO / "docs" / "tiny_matrix" / "report.md").read_text()
    assert report.startswith("# layoutlab report\n")
    runs = re.findall(r"^\| (tiny_7b_\S+) \| runs/sweeps/\S+ \| our run directory \|", report, re.M)
    assert sorted(runs) == sorted(p.name for p in SHIPPED if p.name.startswith("tiny_7b_") and "lora" not in p.name)
    time_went = report.split("## Where the time went", 1)[1].split("\n## ", 1)[0]
    assert "No profiler trace" not in time_went and all(f"| {run} |" in time_went for run in runs)
    # README quotes the report's answer: the lines it quotes are the report's own
    quoted = re.findall(r"^> (\S.*)$", (REPO / "README.md").read_text(), re.M)
    assert quoted and all(line in report for line in quoted), quoted
