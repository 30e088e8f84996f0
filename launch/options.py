"""`key=value` options of every command line: the `Option` type, the parsers of their values, and the closest known
name for a misspelt one. launch.commands.args reads each subcommand's arguments with them; `python -m analysis`
reads its options with them from here (analysis may not import launch.commands).

The rules are the recipe loader's: a whole number is ASCII digits within 64 bits (`²` passes `str.isdigit` but is
no number), a value never carries a NUL byte, and a parser says what is wrong in a ValueError that its reader turns
into the one-line error of its command.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Option:
    """One `key=value` option of a command. `parse` turns the text into a value or raises ValueError with the
    problem; `default` is the value when the option is not given (None: not given)."""

    name: str
    doc: str
    parse: Callable[[str], Any] = str
    default: Any = None


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` most likely misspells, or None when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


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
