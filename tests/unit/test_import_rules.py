"""The import rules of pyproject.toml's [tool.importlinter] hold, and each one fails when broken: a copy of the
packages with one forbidden import added must be reported under that contract's name."""
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"]


def _lint(cwd, env=None):
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def test_the_tree_keeps_every_contract():
    p = _lint(REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "BROKEN" not in p.stdout and p.stdout.count(" KEPT") == 8, p.stdout


# (contract name as pyproject.toml states it, module to edit, the import that breaks it)
BREAKS = [
    ("Only launch.ranks imports torch, deepspeed, megatron or transformers", "launch/plan/memory.py", "import torch"),
    ("Nothing outside launch.ranks imports it", "launch/commands/plan.py", "import launch.ranks.data"),
    ("The rooms of launch import downwards only (no cycles between rooms)", "launch/config/resolve.py",
     "import launch.commands.cli"),
    ("launch never imports analysis", "launch/run/metrics.py", "import analysis.table"),
    ("analysis uses only launch's config, plan, comm and run-record layers", "analysis/table.py",
     "import launch.run.launcher"),
    ("No import cycles between sibling modules of one room", "launch/plan/layout.py", "import launch.plan.build"),
    ("analysis in layers: report over analyzers over parsers over table", "analysis/parsers/nccl_tests.py",
     "import analysis.analyzers.ceilings"),
    ("analysis in layers: report over analyzers over parsers over table", "analysis/analyzers/steps.py",
     "import analysis.report.data"),
    ("Only analysis.report draws", "analysis/analyzers/curves.py", "import matplotlib.figure"),
]


@pytest.mark.parametrize("contract,module,line", BREAKS, ids=[f"{b[1]}:{b[2]}" for b in BREAKS])
def test_each_contract_fails_when_broken(tmp_path, contract, module, line):
    for pkg in ("launch", "analysis"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)}
    p = _lint(tmp_path, env)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    broken = [ln.removesuffix(" BROKEN") for ln in p.stdout.splitlines() if ln.endswith(" BROKEN")]
    assert contract in broken, p.stdout
