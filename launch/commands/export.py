"""`python -m launch export RUN_DIR [step=N] [out=DIR]`: a checkpoint as a Hugging Face safetensors folder.

This side checks the arguments; the consolidation needs torch and the backend's own code, so it runs as a process
(`python -m launch.ranks.export`, launch/ranks/export.py), like every other rank program.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Sequence

from launch.errors import ConfigError
from launch.run.rundir import RunDir


def cmd_export(args: Sequence[str]) -> int:
    if not args:
        raise ConfigError("command line", "run_dir", None, "is missing", "usage: python -m launch export RUN_DIR [step=N] [out=DIR]")
    run_dir, opts = args[0], {}
    for a in args[1:]:
        k, _, v = a.partition("=")
        if k not in ("step", "out") or not v:
            raise ConfigError("command line", k, v, "is not an export option", "use step=N or out=DIR")
        opts[k] = v
    if not RunDir.is_run_dir(run_dir):
        raise ConfigError(run_dir, "run_dir", run_dir, "is not a run directory (no resolved.json)", "pass runs/<recipe>/<stamp>")
    try:
        step = int(opts["step"]) if "step" in opts else None
    except ValueError:
        raise ConfigError("command line", "step", opts["step"], "is not an integer", "write step=N") from None
    cmd = [sys.executable, "-m", "launch.ranks.export", run_dir, "-" if step is None else str(step), opts.get("out", "-")]
    return subprocess.run(cmd, check=False).returncode
