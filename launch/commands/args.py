"""The one reader of every subcommand's arguments: `--dry-run`, the recipe path, the subcommand's own `key=value`
options and the recipe's dotted overrides (which the recipe loader itself checks, launch/config/schema.py)."""
from __future__ import annotations

from typing import Sequence

from launch.errors import ConfigError


def split_dry_run(args: Sequence[str], script: str, fix: str) -> tuple[bool, list[str]]:
    """(whether --dry-run was given, the other arguments); any other flag is refused in one line."""
    rest = [a for a in args if a != "--dry-run"]
    flags = [a for a in rest if a.startswith("--")]
    if flags:
        raise ConfigError("command line", flags[0], flags[0], f"is not a flag of {script} (--dry-run is the only one)", fix)
    return len(rest) != len(args), rest
