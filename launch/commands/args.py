"""The one reader of every subcommand's arguments: `--dry-run`, the positional arguments (recipe paths, a run
directory), the subcommand's own `key=value` options and the recipe's dotted overrides (which the recipe loader
itself checks, launch/config/schema.py).

Its rules are the recipe loader's: a whole number is ASCII digits within 64 bits (`²` passes `str.isdigit` but is
no number), a value never carries control characters unseen (errors.printable shows them escaped), and an unknown
key gets the closest known one as a suggestion.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from launch.config.schema import Recipe
from launch.errors import ConfigError

INT64_MAX = 2**63 - 1
# The recipe's own undotted keys (`backend=megatron`): overrides like the dotted ones.
TOP_LEVEL_KEYS = frozenset({"backend", "extends", "description"}) & set(Recipe.__dataclass_fields__)


@dataclass(frozen=True)
class Option:
    """One `key=value` option of a subcommand. `parse` turns the text into a value or raises ValueError with the
    problem; `default` is the value when the option is not given (None: not given)."""

    name: str
    doc: str
    parse: Callable[[str], Any] = str
    default: Any = None


@dataclass(frozen=True)
class Arguments:
    """What the command line held, read."""

    dry_run: bool
    positional: tuple[str, ...]
    options: Mapping[str, Any]
    overrides: tuple[str, ...] = field(default=())


def whole(low: int = 0, high: int = INT64_MAX) -> Callable[[str], int]:
    """A whole number of ASCII digits from `low` to `high`."""

    def parse(text: str) -> int:
        # ASCII digits only: "²" passes str.isdigit(), and int() refuses it
        if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
            raise ValueError(f"is not a whole number from {low} to {high}")
        return int(text)

    return parse


def whole_list(low: int = 1, high: int = INT64_MAX) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated whole numbers, each from `low` to `high`; at least one."""
    one = whole(low, high)

    def parse(text: str) -> tuple[int, ...]:
        items = text.split(",")
        if not text or any(not x for x in items):
            raise ValueError(f"is not a comma-separated list of whole numbers from {low} to {high}")
        try:
            return tuple(one(x) for x in items)
        except ValueError:
            raise ValueError(f"is not a comma-separated list of whole numbers from {low} to {high}") from None

    return parse


def boolean(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError("must be true or false")
    return text == "true"


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"is not one of {', '.join(allowed)}")
        return text

    return parse


def choice_list(*allowed: str) -> Callable[[str], tuple[str, ...]]:
    """Comma-separated names, each one of `allowed`; at least one."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(text.split(","))
        if not text or any(x not in allowed for x in items):
            raise ValueError(f"is not a comma-separated list of {', '.join(allowed)}")
        return items

    return parse


def text(value: str) -> str:
    """Any text without a NUL byte (no path or name can hold one); empty is refused."""
    if not value or "\0" in value:
        raise ValueError("must be non-empty text without a NUL byte")
    return value


def distinct(parse: Callable[[str], tuple]) -> Callable[[str], tuple]:
    """`parse`'s list with no item twice (an item given twice would be computed and shown twice)."""

    def checked(text: str) -> tuple:
        items = parse(text)
        twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
        if twice is not None:
            raise ValueError(f"names {twice} twice")
        return items

    return checked


def _texts(value: str) -> tuple[str, ...]:
    items = tuple(value.split(","))
    if any(not x or "\0" in x for x in items):
        raise ValueError("is not a comma-separated list of non-empty names without a NUL byte")
    return items


# Comma-separated texts, each as `text` takes it; at least one, none twice.
text_list = distinct(_texts)


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
                raise ConfigError("command line", "argument", a, "is not key=value" if len(pos) >= positional[1]
                                  else "comes after a key=value option", usage)
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
            dotted.append(a)
        else:
            names = [*known, *(TOP_LEVEL_KEYS if overrides else ())]  # backedn= is the recipe's backend
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}=? " if close else ""
            what = (f"options: {', '.join(known)}" if known else "no options") + \
                (", and the recipe's dotted keys (e.g. parallel.tp=2)" if overrides else "")
            raise ConfigError("command line", key, value, f"is not an option of {command}", f"{hint}{what}")
    if len(pos) < positional[0]:
        raise ConfigError("command line", "argument", None, "is missing", usage)
    for o in options:
        values.setdefault(o.name, o.default)
    return Arguments(bool(given_flags), tuple(pos), values, tuple(dotted))
