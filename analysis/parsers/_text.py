"""Reading log-like text the same way in every parser: a path or the text itself, lines, capped warnings."""
from __future__ import annotations

import codecs
import os
import re
from pathlib import Path

from launch.inputs import not_a_file


def read_source(path_or_text: str | os.PathLike[str], source: str = "") -> tuple[str, str, list[str]]:
    """Return (text, source name, warnings) for a path or for the text itself.

    A `str` with no newline that names an existing path is read as a path (one that is no regular file, such as a
    FIFO, gives a warning naming what it is, unopened); anything else is text.
    Undecodable bytes are replaced rather than raised on, since corrupt logs are normal input.
    """
    warnings: list[str] = []
    is_path = isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and "\0" not in path_or_text
        and len(path_or_text) < 4096 and os.path.lexists(path_or_text))
    if not is_path:
        text = str(path_or_text)
        name = source or "<text>"
    else:
        name = source or os.fspath(path_or_text)
        problem = not_a_file(Path(path_or_text))  # a FIFO's open would block until a writer comes
        if problem:
            return "", name, [f"{name}: {problem}; not read"]
        try:
            with open(path_or_text, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            return "", name, [f"{name}: cannot read ({exc.strerror or exc})"]
        text = data.decode("utf-8", errors="replace")
        if "\ufffd" in text:
            warnings.append(f"{name}: bytes that are not UTF-8 were replaced")
    text, nul = clean_text(text)
    if nul:
        warnings.append(f"{name}: {nul} NUL bytes ignored (the filler a file system leaves after a crash, or garbage)")
    return text.replace("\r\n", "\n").replace("\r", "\n"), name, warnings


# Terminal control sequences that loggers colour or decorate lines with: CSI (`ESC [ 1;32 m`, cursor moves), OSC
# (window titles, hyperlinks) and the short escapes (`ESC ( B` of `tput sgr0`, `ESC 7`, `ESC =`). Removed before
# any pattern is tried, so that a coloured log reads as the plain one does.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b\n]*(?:\x07|\x1b\\)?|[ -/]*[0-~])")
# Bytes that text never holds: controls other than whitespace, backspace and ESC.
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\0\t\n\v\f\r\b\x1b") + b"\x7f"
# More control bytes than this share of what is not NUL: a binary format, not a damaged log.
_BINARY_SHARE = 0.05
# A file with NULs must hold at least this much else to count as text (a log behind NUL filler holds far more).
_MIN_TEXT_BYTES = 1024


def clean_text(text: str) -> tuple[str, int]:
    """`text` without terminal escapes and NUL characters, and how many NULs it held."""
    nul = text.count("\0")
    if nul:
        text = text.replace("\0", "")
    if "\x1b" in text:
        text = _ESCAPES.sub("", text)
    return text, nul


# Byte-order marks of the encodings an editor or a shell's redirection (PowerShell's `>`) re-saves text in; every
# format read here is UTF-8. UTF-32's little-endian mark begins with UTF-16's, hence first.
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))


def wide_encoding(head: bytes) -> str | None:
    """'UTF-16' or 'UTF-32' when `head` (a file's first bytes) starts with that encoding's byte-order mark, else None:
    such text is no UTF-8, and no line of it reads as one."""
    return next((name for bom, name in _BOMS if head.startswith(bom)), None)


def looks_like_text(data: bytes) -> bool:
    """Whether `data` is text, perhaps damaged (a block of NUL filler, garbage spliced in), rather than a binary
    format: a log whose first kilobytes a crash zeroed is still a log."""
    body = data.replace(b"\0", b"")
    if len(body) < min(len(data), _MIN_TEXT_BYTES):
        return False  # mostly NUL with a little else: a database page, an array of zeros
    return len(body) - len(body.translate(None, _CONTROL_BYTES)) <= _BINARY_SHARE * len(body)


SNIFF_BYTES = 64 * 1024

# What launchers and loggers write before a tool's own text at the start of a line, any number of
# them: indentation (a log pasted into a Markdown code block), Open MPI's `[1,0]<stdout>:`, torchrun's
# `[default0]:`, pdsh's and `srun --label`'s `host: `, timestamps (`[2024-04-04 09:09:53,313]`,
# `2024-04-04T09:09:53`), logger fields (`[INFO]`, `[I]`, DeepSpeed's `[logging.py:96:log_dist]`)
# and `[Rank N]`. Sniffers anchor their patterns behind it: a README or a script that quotes a log
# line inside a table cell or a string literal does not start the line with it. Blanks are taken
# possessively: a long run of them must not be retried at every split (quadratic time).
LINE_PREFIX = (r"[ \t]*+(?:(?:\[\d+,\d+\]<(?:stdout|stderr)>:|\[(?:default|rank)\d+\]:|[A-Za-z0-9][\w.-]*: |"
               r"\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\]?|\[[A-Z]+\]|\[[\w./-]+:\d+:\w+\]|"
               r"\[Rank -?\d+\])[ \t]*+){0,6}")
# One matching line can be a quotation; a tool's output repeats its format.
SNIFF_MIN_LINES = 2


def line_start_pattern(body: str) -> re.Pattern[str]:
    """`body` (alternatives allowed) anchored at the start of a line, behind LINE_PREFIX."""
    return re.compile(r"^" + LINE_PREFIX + r"(?:" + body + r")", re.MULTILINE)


def has_lines(pattern: re.Pattern[str], text: str | None, at_least: int = SNIFF_MIN_LINES) -> bool:
    """Whether `at_least` lines of `text` match a line_start_pattern (each match starts its own line)."""
    if text is None:
        return False
    found = 0
    for _ in pattern.finditer(text):
        found += 1
        if found >= at_least:
            return True
    return False


def head_and_tail(path: str | os.PathLike[str]) -> str | None:
    """The first and last 64 KiB of a text file, decoded leniently and cleaned (clean_text); None for binary or
    unreadable files.

    Launch scripts often print 100 KB of shell trace before training starts, hence the tail too; it
    begins at a line start, so that a line cut in two does not pass for one that starts there."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
            size = os.fstat(fh.fileno()).st_size
            tail = b""
            if size > 2 * SNIFF_BYTES:
                fh.seek(size - SNIFF_BYTES)
                tail = fh.read(SNIFF_BYTES)
                tail = b"\n" + tail[tail.find(b"\n") + 1:]
            elif size > SNIFF_BYTES:
                tail = fh.read()  # the rest, contiguous with the head
    except OSError:
        return None
    if not looks_like_text(head):
        return None  # binary (an event file, a trace): never a text log
    return clean_text((head + tail).decode("utf-8", errors="replace"))[0]


def split_lines(text: str) -> tuple[list[str], bool]:
    """Lines of `text` and whether the last one is cut (no newline after it)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
        return lines, False
    return lines, bool(lines)


def capped_warn(warnings: list[str], counts: dict[str, int], cap: int, name: str, kind: str,
                lineno: int | None, message: str) -> None:
    """Append `name:lineno: message`, at most `cap` times per kind, then one line saying the rest were dropped:
    a log with a thousand garbled lines should not bury the first few that explain it."""
    n = counts.get(kind, 0) + 1
    counts[kind] = n
    where = f"{name}:{lineno}" if lineno else name
    if n <= cap:
        warnings.append(f"{where}: {message}")
    elif n == cap + 1:
        warnings.append(f"{name}: further '{kind}' warnings suppressed")


# What a damaged line raises while it is read (a 5,000-digit number, a float past its range, nesting, a huge
# field): the line is skipped with a warning, the rest of the file is read.
GARBLED: tuple[type[BaseException], ...] = (ValueError, OverflowError, RecursionError, MemoryError)


class LineParser:
    """Base of the line-oriented log parsers: feeds every line to `line()`, turning a line that matched a
    pattern but holds no valid number into a capped warning instead of an exception."""

    max_warnings_per_kind = 10
    garbled = GARBLED

    def __init__(self, name: str, warnings: list[str]) -> None:
        self.name = name
        self.warnings = warnings
        self.warned: dict[str, int] = {}

    def warn(self, kind: str, lineno: int | None, message: str) -> None:
        capped_warn(self.warnings, self.warned, self.max_warnings_per_kind, self.name, kind, lineno, message)

    def line(self, lineno: int, raw: str, cut: bool) -> None:
        raise NotImplementedError

    def feed(self, text: str, first_line: int = 1) -> int:
        """Parse every line of `text`, numbered from `first_line` (a part of a file keeps the file's numbers); returns
        the last line's number."""
        lines, last_cut = split_lines(text)
        last = first_line + len(lines) - 1
        for lineno, raw in enumerate(lines, start=first_line):
            try:
                self.line(lineno, raw, last_cut and lineno == last)
            except self.garbled as exc:
                self.warn("garbled", lineno, f"line not understood ({type(exc).__name__}); skipped")
        return last
