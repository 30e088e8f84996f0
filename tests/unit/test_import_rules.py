"""The import rules of pyproject.toml's [tool.importlinter] hold, and each one fails when broken: a copy of the
packages with one forbidden import added, or with one new module, must be reported under that contract's name.
Modules named by a string (a `-m` argument, importlib.import_module), which no rule sees, are checked here."""
import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"]
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
TORCH = "Only launch.ranks and launch.torchtools import torch, deepspeed, megatron or transformers"
RANKS = "Nothing outside launch.ranks imports it"
TORCHTOOLS = "Only launch.ranks imports launch.torchtools (the driver starts it as processes)"
ROOMS = "The rooms of launch import downwards only (no cycles between rooms)"
ANALYSIS_LAYERS = "analysis in layers: report over analyzers over parsers over table"
DRAWS = "Only analysis.report draws"
# A contract with an ignored import says so after its verdict.
VERDICT = re.compile(r"(?P<name>.+) (?P<verdict>KEPT|BROKEN)(?: \(\d+ ignored imports?\))?")


def _lint(cwd, env=None):
    # Off a terminal the report wraps at 80 columns, which would split a contract's name over two lines.
    env = {**(os.environ if env is None else env), "COLUMNS": "1000"}
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def _verdicts(stdout: str) -> dict[str, str]:
    return {m["name"]: m["verdict"] for m in map(VERDICT.fullmatch, stdout.splitlines()) if m}


def _lint_copy(tmp_path, edit):
    """lint-imports over a copy of the packages after `edit(copy_root)`: the names of the broken contracts."""
    for pkg in ("launch", "analysis"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    edit(tmp_path)
    p = _lint(tmp_path, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)})
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    return {name for name, verdict in _verdicts(p.stdout).items() if verdict == "BROKEN"}


def test_the_tree_keeps_every_contract():
    p = _lint(REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert _verdicts(p.stdout) == {c["name"]: "KEPT" for c in CONTRACTS}, p.stdout


# (contract name as pyproject.toml states it, module to edit, the import that breaks it)
BREAKS = [
    (TORCH, "launch/plan/memory.py", "import torch"),
    (RANKS, "launch/commands/plan.py", "import launch.ranks.data"),
    # export's one import of rank code is ignored by name: the rest of its room still may not
    (RANKS, "launch/torchtools/indexed.py", "import launch.ranks.data"),
    (TORCHTOOLS, "launch/commands/export.py", "import launch.torchtools.export"),
    (TORCHTOOLS, "launch/run/checkpoints.py", "import launch.torchtools.untrusted"),
    ("Rank code reads the launcher's names in launch.run.rankenv, never the launcher", "launch/ranks/data.py",
     "import launch.run.launcher"),
    (ROOMS, "launch/config/resolve.py", "import launch.commands.cli"),
    (ROOMS, "launch/torchtools/untrusted.py", "import launch.commands.cli"),
    ("launch never imports analysis", "launch/run/metrics.py", "import analysis.table"),
    ("analysis uses only launch's config, plan, comm and run-record layers", "analysis/table.py",
     "import launch.run.launcher"),
    ("No import cycles between sibling modules of one room", "launch/plan/layout.py", "import launch.plan.build"),
    (ANALYSIS_LAYERS, "analysis/parsers/nccl_tests.py", "import analysis.analyzers.ceilings"),
    (ANALYSIS_LAYERS, "analysis/analyzers/steps.py", "import analysis.report.data"),
    (DRAWS, "analysis/analyzers/curves.py", "import matplotlib.figure"),
]


@pytest.mark.parametrize("contract,module,line", BREAKS, ids=[f"{b[1]}:{b[2]}" for b in BREAKS])
def test_each_contract_fails_when_broken(tmp_path, contract, module, line):
    def add_import(root):
        target = root / module
        target.write_text(target.read_text() + f"\n{line}  # noqa\n")

    assert contract in _lint_copy(tmp_path, add_import)


# A module nobody listed is under the rules all the same: (file to create, its text, exactly the contracts it breaks).
NEW_MODULES = [
    ("launch/newtool.py", "import torch\n", {TORCH, ROOMS}),  # and a top-level module needs a layer
    ("launch/newroom/__init__.py", "import launch.ranks.data\n", {RANKS, ROOMS}),
    ("launch/plan/newmodel.py", "import torch\n", {TORCH}),
    ("analysis/newroom/__init__.py", "import matplotlib.pyplot\n", {DRAWS, ANALYSIS_LAYERS}),
]


@pytest.mark.parametrize("path,text,contracts", NEW_MODULES, ids=[n[0] for n in NEW_MODULES])
def test_a_new_module_is_under_the_rules(tmp_path, path, text, contracts):
    def create(root):
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).write_text(text)

    assert _lint_copy(tmp_path, create) == contracts


# Modules the driver may name by a string (start as a process, import through the backend registry): rank code and
# the driver's torch programs. A room may also name its own modules (the CLI dispatching to its subcommands).
STARTED = ("launch.ranks.", "launch.torchtools.")
MODULE_NAME = re.compile(r"(launch|analysis)(\.\w+)+")
DASH_M = re.compile(r"-m\s+((?:launch|analysis)(?:\.\w+)+)")


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _python_files(root):
    return sorted([*(root / "launch").rglob("*.py"), *(root / "analysis").rglob("*.py")])


def _string_named(root) -> list[tuple[str, int, str]]:
    """(file, line, module) of every string in launch/ and analysis/ that names a module of ours: a whole dotted
    name, the constant head of an f-string (`f"launch.commands.{name}"` names that package), or a shell script's
    `-m` argument."""
    found = []
    for path in _python_files(root):
        tree = ast.parse(path.read_text())
        heads = {id(s.values[0]) for s in ast.walk(tree) if isinstance(s, ast.JoinedStr) and s.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.removesuffix(".") if id(node) in heads else node.value
                if MODULE_NAME.fullmatch(text):
                    found.append((str(path.relative_to(root)), node.lineno, text))
    for path in sorted([*(root / "launch").glob("*.sh"), *(root / "launch").glob("*.sbatch")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [(str(path.relative_to(root)), n, m) for m in DASH_M.findall(line)]
    return found


def _string_import_problems(root) -> list[str]:
    problems = []
    for file, line, name in _string_named(root):
        where = root.joinpath(*name.split("."))
        own_room = file.endswith(".py") and _room(name) == _room(file.removesuffix(".py").replace("/", "."))
        if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()):
            problems.append(f"{file}:{line}: {name} is no module of ours")
        elif not (name.startswith(STARTED) or own_room):
            problems.append(f"{file}:{line}: {name} is neither rank code nor a torch program of the driver")
    # The registry imports a backend's rank module by the name it holds: only code that may import torch asks it.
    for path in _python_files(root):
        file = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rank_module"
                    and not file.startswith(("launch/ranks/", "launch/torchtools/"))):
                problems.append(f"{file}:{node.lineno}: imports a rank module through the registry")
    return problems


def test_every_module_named_by_a_string_is_one_the_driver_may_start():
    names = {name for _, _, name in _string_named(REPO)}
    # the scan finds the names these files are known to hold (a scan that found nothing would pass)
    assert {"launch.ranks.train", "launch.ranks.trainers.torch_backend", "launch.torchtools.export",
            "launch.torchtools.untrusted", "launch.torchtools.indexed", "launch.commands"} <= names, names
    assert _string_import_problems(REPO) == []


# (file to edit, the line to append, the one problem it must raise there)
STRING_BREAKS = [
    ("launch/commands/plan.py", 'importlib.import_module("launch.plan.memory")',
     "launch.plan.memory is neither rank code nor a torch program of the driver"),
    ("launch/commands/plan.py", 'importlib.import_module(f"launch.plan.{name}")',
     "launch.plan is neither rank code nor a torch program of the driver"),
    ("launch/commands/run.py", '["-m", "launch.ranks.untrusted"]', "launch.ranks.untrusted is no module of ours"),
    ("launch/commands/plan.py", 'traits("torch").rank_module()', "imports a rank module through the registry"),
]


@pytest.mark.parametrize("module,line,problem", STRING_BREAKS, ids=[b[1] for b in STRING_BREAKS])
def test_a_module_named_by_a_string_is_checked(tmp_path, module, line, problem):
    for pkg in ("launch", "analysis"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}\n")
    appended_at = len(target.read_text().splitlines())
    assert _string_import_problems(tmp_path) == [f"{module}:{appended_at}: {problem}"]
