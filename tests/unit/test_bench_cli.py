"""Every bench script's --help is its own and exits 0, and an unknown option is a usage error in one line, exit 2,
before any heavy import or measurement (a newcomer's finding: `bench_planner.py --help` ended in a traceback)."""
import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench"
MODULES = {"_cli.py", "compare_bare.py"}  # imported by the scripts, not run
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in MODULES)


def test_every_script_is_covered():
    assert len(SCRIPTS) >= 11 and all(ast.get_docstring(ast.parse(p.read_text())) for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_help_is_the_scripts_own_and_a_bad_option_exits_2(script):
    first = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0]
    ok = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert first.split("`")[0].strip()[:40] in " ".join(ok.stdout.split()), ok.stdout[:300]
    bad = subprocess.run([sys.executable, str(script), "--no-such-option"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
