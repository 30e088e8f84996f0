"""`python -m launch run RECIPE [key=value ...] [--dry-run]`, `python -m launch plan key=value ...`,
`python -m launch export RUN_DIR [step=N] [out=DIR]`,
`python -m launch export-accelerate (RUN_DIR | RECIPE [key=value ...]) [out=DIR]`, `python -m launch calibrate [RECIPE] [key=value ...] [out=PATH]`,
`python -m launch recommend RECIPE [key=value ...] [top=K] [verify=true] [steps=N]`,
`python -m launch sweep RECIPE RECIPE ... [key=value ...] [--dry-run]` (what launch/sweep.sh runs).

Every user error is a `ConfigError`: one line on stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from launch.errors import ConfigError
from launch.run.checkpoints import ResumeError

# subcommand -> its module under launch/commands (imported only when that subcommand runs: the dry run stays fast)
COMMANDS = {"run": "run", "plan": "plan", "calibrate": "calibrate", "recommend": "recommend", "sweep": "sweep",
            "export": "export", "export-accelerate": "export_accelerate", "docs": "docs"}


def command_help(name: str) -> str:
    """A subcommand's usage and options, from its module: USAGE (else its docstring's first line) and OPTIONS."""
    module = importlib.import_module(f"launch.commands.{COMMANDS[name]}")
    lines = [getattr(module, "USAGE", "") or (module.__doc__ or "").strip().splitlines()[0]]
    options = getattr(module, "OPTIONS", ())
    items = options.items() if isinstance(options, dict) else ((o.name, o.doc) for o in options)
    lines += [f"  {key}=  {doc}" for key, doc in items]
    if name in ("run", "sweep", "recommend", "calibrate", "export-accelerate"):
        lines.append("  section.key=value  any field of the recipe (docs/recipes.md lists them all)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError("command line", "command", command, "is not a command",
                              f"use one of: {', '.join(COMMANDS)}")
        if "-h" in rest or "--help" in rest:
            print(command_help(command))
            return 0
        module = importlib.import_module(f"launch.commands.{COMMANDS[command]}")
        return getattr(module, f"cmd_{COMMANDS[command]}")(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ResumeError as e:
        print(f"error: resume: {e}", file=sys.stderr)
        return 2
