"""The one reader of every subcommand's arguments: `--dry-run`, the positional arguments (recipe paths, a run
directory), the subcommand's own `key=value` options and the recipe's dotted overrides (which the recipe loader
itself checks, launch/config/schema.py).

Its rules are the recipe loader's: a whole number is ASCII digits within 64 bits (`²` passes `str.isdigit` but is
no number), a value never carries control characters unseen (errors.printable shows them escaped), and an unknown
key gets the closest known one as a suggestion.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from launch.config.schema import Recipe
from launch.errors import ConfigError

# The option type and the value parsers live in launch.options, below every room (analysis reads its options with
# them too); the subcommands import them from here, with the reader.
from launch.options import (
    Option,
    boolean,
    choice,
    choice_list,
    closest,
    distinct,
    text,
    text_list,
    whole,
    whole_list,
)

__all__ = ["TOP_LEVEL_KEYS", "Arguments", "Option", "boolean", "choice", "choice_list", "distinct", "read", "text",
           "text_list", "whole", "whole_list"]

# Overrides one command line may hold: a recipe has ~100 fields; past this it is a script's runaway loop, refused
# before every one is parsed, typed and echoed back in the run's summary.
MAX_OVERRIDES = 10_000
# The recipe's own undotted keys (`backend=megatron`): overrides like the dotted ones.
TOP_LEVEL_KEYS = frozenset({"backend", "extends", "description"}) & set(Recipe.__dataclass_fields__)


@dataclass(frozen=True)
class Arguments:
    """What the command line held, read."""

    dry_run: bool
    positional: tuple[str, ...]
    options: Mapping[str, Any]
    overrides: tuple[str, ...] = field(default=())


def read(args: Sequence[str], *, command: str, usage: str, options: Sequence[Option] = (),
         positional: tuple[int, int] = (0, 0), overrides: bool = False, dry_run: bool = False) -> Arguments:
    """Read `args` of `command`: `positional` = (at least, at most) arguments without `=`, which come first;
    options by name; dotted `section.key=value` overrides when the command takes a recipe (`overrides`).
    Every problem is one ConfigError naming the argument and the fix."""
    known = {o.name: o for o in options}
    flags = ("--dry-run",) if dry_run else ()
    given_flags = [a for a in args if a.startswith("--")]
    for a in given_flags:
        if a not in flags:
            which = " (--dry-run is the only one)" if dry_run else " (it takes none)"
            raise ConfigError("command line", a, a, f"is not a flag of {command}{which}", usage)
    rest = [a for a in args if not a.startswith("--")]
    pos: list[str] = []
    values: dict[str, Any] = {}
    dotted: list[str] = []
    for a in rest:
        key, eq, value = a.partition("=")
        if not eq:
            if values or dotted or len(pos) >= positional[1]:
                problem = ("comes after a key=value option" if len(pos) < positional[1] else "is not key=value"
                           if positional[1] <= 1 else f"is one more than the {positional[1]:,} inputs {command} takes")
                raise ConfigError("command line", "argument", a, problem, usage)
            pos.append(a)
            continue
        if key in known:
            if key in values:
                raise ConfigError("command line", key, value, "is given twice", f"give {key}= once")
            try:
                values[key] = known[key].parse(value)
            except ValueError as e:
                raise ConfigError("command line", key, value, str(e), f"{key}: {known[key].doc}") from None
        elif overrides and ("." in key or key in TOP_LEVEL_KEYS):
            if len(dotted) == MAX_OVERRIDES:
                raise ConfigError("command line", "argument", a,
                                  f"is one more than the {MAX_OVERRIDES:,} overrides {command} takes", usage)
            dotted.append(a)
        else:
            names = [*known, *(TOP_LEVEL_KEYS if overrides else ())]  # backedn= is the recipe's backend
            close = closest(key, names)
            hint = f"did you mean {close}=? " if close else ""
            what = (f"options: {', '.join(known)}" if known else "no options") + \
                (", and the recipe's dotted keys (e.g. parallel.tp=2)" if overrides else "")
            raise ConfigError("command line", key, value, f"is not an option of {command}", f"{hint}{what}")
    if len(pos) < positional[0]:
        raise ConfigError("command line", "argument", None, "is missing", usage)
    for o in options:
        values.setdefault(o.name, o.default)
    return Arguments(bool(given_flags), tuple(pos), values, tuple(dotted))
