"""What importing the planning and analysis side pulls in: no torch, no framework, no rank code."""
import subprocess
import sys

from tests.conftest import REPO

TORCH_FREE = ("launch.config.resolve, launch.plan.build, launch.commands.cli, launch.config.backends, launch.run.checkpoints, launch.commands.export, "
              "launch.commands.plan, launch.comm.commbench_spec, analysis.parsers.runs, "
              "analysis.parsers.commbench, analysis.report.render, analysis.report.data, analysis.__main__")
HEAVY = ("torch", "deepspeed", "megatron", "transformers")


def test_planning_and_analysis_import_neither_torch_nor_rank_code():
    code = (f"import {TORCH_FREE}; import sys; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m == 'launch.ranks.commbench' "
            f"or m.startswith('launch.ranks.trainers.')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", p.stdout
