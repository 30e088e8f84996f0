"""The recipe catalogue (recipes/README.md and each GPU recipe's numbers block, written by `python -m launch docs`):
current, complete, and telling what the dry run tells. The oracles are this file's own: the recipe folders found by
its glob, and the numbers the dry run prints, read with its own patterns."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch.commands import catalogue
from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from tests.conftest import RECIPES, REPO

INDEX = RECIPES / "README.md"
SHIPPED = sorted(p.parent.name for p in RECIPES.glob("*/recipe.toml") if p.parent.name != "base")
ROW = re.compile(r"^\| \[([^\]]+)\]\(([^)]+)/\) \|.*\|$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
BLOCK = re.compile(r"<!-- numbers:begin -->.*?<!-- numbers:end -->", re.S)


def index_rows() -> dict[str, dict[str, str]]:
    """Each table row of the index by its recipe, as {column header: cell}, the header read from the row's table."""
    rows: dict[str, dict[str, str]] = {}
    header: list[str] = []
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == "recipe":
            header = cells
        elif cells and ROW.match(line):
            rows[ROW.match(line).group(1)] = dict(zip(header, cells, strict=True))
    return rows


def repo_copy(tmp_path: Path) -> Path:
    """A repository whose recipes/ is a copy to edit; everything else links to the real one (a recipe's paths
    outside recipes/ still resolve)."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name != "recipes":
            (root / entry.name).symlink_to(entry)
    shutil.copytree(RECIPES, root / "recipes")
    return root / "recipes"


def test_index_lists_every_shipped_recipe_exactly_once():
    listed = ROW.findall(INDEX.read_text(encoding="utf-8"))
    assert all(name == target for name, target in listed), [x for x in listed if x[0] != x[1]]
    counts = Counter(name for name, _ in listed)
    assert [n for n, c in counts.items() if c > 1] == []
    for shipped, indexed in zip(SHIPPED, sorted(counts), strict=True):
        assert shipped == indexed


def test_tiny_twins_are_named_in_both_rows():
    rows = index_rows()
    twins = [n for n in SHIPPED if n.startswith("tiny_") and n.removeprefix("tiny_") in SHIPPED]
    for twin in twins:
        sibling = twin.removeprefix("tiny_")
        assert rows[sibling]["tiny twin"] == f"[{twin}]({twin}/)", sibling
        assert rows[twin]["twin of"] == f"[{sibling}]({sibling}/)", twin


def test_links_of_the_catalogue_resolve():
    pages = [INDEX, *sorted(RECIPES.glob("*/README.md"))]
    broken = [f"{page.relative_to(REPO)}: {target}" for page in pages
              for target in LINK.findall(page.read_text(encoding="utf-8"))
              if not re.match(r"[a-z]+:", target) and not (page.parent / target.partition("#")[0]).exists()]
    assert broken == []


def test_every_gpu_recipe_has_its_numbers_block():
    gpu = [n for n in SHIPPED if resolve_path(RECIPES / n).recipe.hardware.profile != "cpu"]
    assert "7b_tp2_zero3" in gpu
    for name in gpu:
        text = (RECIPES / name / "README.md").read_text(encoding="utf-8")
        assert text.startswith(f"# {name}\n") and len(BLOCK.findall(text)) == 1, name
        assert f"`bash launch/run.sh recipes/{name}`" in BLOCK.search(text).group(0), name


def half_unit(text: str) -> float:
    """Half a unit in the last printed digit: how far a printed number may be from the value it rounds."""
    decimals = len(text.partition(".")[2])
    return 0.5 * 10 ** -decimals


@pytest.mark.parametrize("name", ["7b_tp2_zero3", "8b_tp8_sp_zero1"])
def test_row_says_what_the_dry_run_prints(name, tmp_path):
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable, "COLUMNS": "1000",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(["bash", "launch/run.sh", f"recipes/{name}", "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"memory per rank \(GiB, ", out), out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["ranks", "weights"])
    # a rank row: its ranks ("all ranks [0-3]", "pp stage 0 (first) [0-15]"), a number per column, the fit
    rows = re.findall(r"^.*?\]((?:\s+[\d.e+-]+)+)\s+(?:yes|NO)\s*$", out, re.M)
    totals = [nums.split()[header.index("total") - 1] for nums in rows]
    worst = max(totals, key=float)
    step = re.search(r"^predicted step \(.*?\): ([\d.]+) ms", out, re.M).group(1)
    tokens, mfu = re.search(r"([\d,]+) tokens/s/device, MFU ([\d.]+%)", out).groups()
    usable = re.search(r"usable device memory ([\d.]+) GiB of", out).group(1)
    verdict = re.search(r"^plan: (fits|DOES NOT FIT)", out, re.M).group(1)

    row = index_rows()[name]
    assert abs(float(row["memory/GPU GiB"]) - float(worst)) <= half_unit(row["memory/GPU GiB"]) + half_unit(worst)
    assert abs(float(row["usable GiB"]) - float(usable)) <= half_unit(row["usable GiB"]) + half_unit(usable)
    assert (row["step ms"], row["tokens/s/GPU"], row["MFU"]) == (step, tokens, mfu)
    assert row["fits"].startswith("yes" if verdict == "fits" else "no")
    block = BLOCK.search((RECIPES / name / "README.md").read_text(encoding="utf-8")).group(0)
    assert f": {step} ms = compute" in block and f"{tokens} tokens/s/GPU, MFU {mfu}" in block


def test_recipes_shipped_not_to_fit_do_not():
    rows = index_rows()
    for name in SHIPPED:
        resolved = resolve_path(RECIPES / name)
        if not resolved.recipe.plan.expect_fit:
            assert not plan_resolved(resolved).fits, f"{name} sets plan.expect_fit = false but fits"
            assert rows[name]["fits"] == "no (by design)", name


def test_regenerated_copy_equals_the_checked_in_files_and_a_rerun_changes_nothing(tmp_path):
    copy = repo_copy(tmp_path)
    for g in catalogue.files(copy):
        g.path.write_text(g.new, encoding="utf-8")
    for g in catalogue.files(copy):
        assert not g.stale, g.path
        checked_in = RECIPES / g.path.relative_to(copy)
        assert checked_in.is_file() and g.new == checked_in.read_text(encoding="utf-8"), f"{checked_in} is stale"


def test_a_hand_edited_number_is_stale_and_hand_written_prose_is_kept(tmp_path):
    copy = repo_copy(tmp_path)
    readme, index = copy / "7b_tp2_zero3" / "README.md", copy / "README.md"
    text = readme.read_text(encoding="utf-8")
    block = BLOCK.search(text).group(0)
    edited = re.sub(r"(\d+)\.(\d) ms = compute", lambda m: f"{int(m.group(1)) + 1}.{m.group(2)} ms = compute", block)
    assert edited != block
    prose = "TP 2 keeps the tensor-parallel collectives on NVLink.\n\n"
    readme.write_text(text.replace(block, prose + edited), encoding="utf-8")
    row = next(line for line in index.read_text(encoding="utf-8").splitlines()
               if line.startswith("| [7b_tp2_zero3](7b_tp2_zero3/) |"))
    step = index_rows()["7b_tp2_zero3"]["step ms"]
    index.write_text(index.read_text(encoding="utf-8").replace(row, row.replace(f" | {step} | ", f" | {step}1 | ")),
                     encoding="utf-8")

    by_path = {g.path: g for g in catalogue.files(copy)}
    assert sorted(p for p, g in by_path.items() if g.stale) == sorted([index, readme])
    assert by_path[readme].new == text.replace(block, prose + block)
    assert by_path[index].new == INDEX.read_text(encoding="utf-8")
