"""What importing the planning and analysis side pulls in: no torch, no framework, no rank code, no torch program of
the driver. Every module outside launch/ranks and launch/torchtools is imported, found by walking the folders, so a
new one is checked without being listed; this sees what the import rules cannot (a module imported by a string at
import time, a library that imports torch itself)."""
import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("torch", "deepspeed", "megatron", "transformers")
TORCH_ROOMS = ("launch.ranks", "launch.torchtools")
RUNS_WHEN_IMPORTED = {"launch.__main__"}  # `sys.exit(main())` at its top level: the CLI itself


def driver_modules() -> list[str]:
    names = []
    for package in ("launch", "analysis"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name not in RUNS_WHEN_IMPORTED and not name.startswith(TORCH_ROOMS):
                names.append(name)
    return names


def test_planning_and_analysis_import_neither_torch_nor_rank_code():
    modules = driver_modules()
    # the walk finds the modules this test was written against (a walk that found nothing would pass)
    assert {"launch.commands.cli", "launch.run.launcher", "launch.run.rankenv", "analysis.__main__"} <= set(modules)
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith({TORCH_ROOMS!r})))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", p.stdout
