"""`python -m launch COMMAND ...`: the dispatch to one module per subcommand (COMMANDS), and `--help` for each.

Every user error is a `ConfigError`: one line on stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from launch.commands.help import command_help, overview
from launch.errors import ConfigError
from launch.run.checkpoints import ResumeError

# subcommand -> its module under launch/commands (imported only when that subcommand runs: the dry run stays fast)
COMMANDS = {"run": "run", "plan": "plan", "calibrate": "calibrate", "recommend": "recommend", "sweep": "sweep",
            "export": "export", "export-accelerate": "export_accelerate", "prepare-data": "prepare_data",
            "rehearse": "rehearse", "docs": "docs"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(COMMANDS), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError("command line", "command", command, "is not a command",
                              f"use one of: {', '.join(COMMANDS)}")
        if "-h" in rest or "--help" in rest:
            print(command_help(command, COMMANDS[command]))
            return 0
        module = importlib.import_module(f"launch.commands.{COMMANDS[command]}")
        return getattr(module, f"cmd_{COMMANDS[command]}")(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ResumeError as e:
        print(f"error: resume: {e}", file=sys.stderr)
        return 2
