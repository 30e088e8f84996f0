"""`python -m launch run RECIPE [key=value ...] [--dry-run]`, `python -m launch plan key=value ...`,
`python -m launch export RUN_DIR [step=N] [out=DIR]`,
`python -m launch export-accelerate (RUN_DIR | RECIPE [key=value ...]) [out=DIR]`, `python -m launch calibrate [RECIPE] [key=value ...] [out=PATH]`,
`python -m launch recommend RECIPE [key=value ...] [top=K] [verify=true] [steps=N]`,
`python -m launch sweep RECIPE RECIPE ... [key=value ...] [--dry-run]` (what launch/commands/sweep.sh runs).

Every user error is a `ConfigError`: one line on stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import sys
from typing import Sequence

from launch.errors import ConfigError
from launch.run.checkpoints import ResumeError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "run":
            from launch.commands.run import cmd_run

            return cmd_run(rest)
        if command == "plan":
            from launch.commands.plan import cmd_plan

            return cmd_plan(rest)
        if command == "recommend":
            from launch.commands.recommend import cmd_recommend

            return cmd_recommend(rest)
        if command == "sweep":
            from launch.commands.sweep import cmd_sweep

            return cmd_sweep(rest)
        if command == "calibrate":
            from launch.commands.calibrate import cmd_calibrate

            return cmd_calibrate(rest)
        if command == "export":
            from launch.commands.export import cmd_export

            return cmd_export(rest)
        if command == "export-accelerate":
            from launch.commands.export_accelerate import cmd_export_accelerate

            return cmd_export_accelerate(rest)
        raise ConfigError("command line", "command", command, "is not a command", "use `run`, `plan`, `calibrate`, `recommend`, `sweep`, `export` or `export-accelerate`")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ResumeError as e:
        print(f"error: resume: {e}", file=sys.stderr)
        return 2
