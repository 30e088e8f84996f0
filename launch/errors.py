"""User-facing configuration errors: one line naming the file, the dotted field, the value and the fix."""
from __future__ import annotations


class ConfigError(Exception):
    """A recipe, override or config file the user must change; rendered as one line, exit code 2."""

    def __init__(self, file: str, field: str, value: object, problem: str, fix: str) -> None:
        self.file = str(file)
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(str(self))

    def __str__(self) -> str:
        return printable(f"{self.file}: {self.field}={_show(self.value)} {self.problem}; {self.fix}")


def printable(text: str, keep: str = "") -> str:
    """Safe on a terminal: control characters (newlines, ESC of ANSI sequences, C1 codes) shown as escapes, so a
    value holding them can neither split the message nor recolour or move the cursor; those in `keep` (a report's
    own line breaks) stay."""
    return "".join(ch if ch.isprintable() or ch == " " or ch in keep else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
