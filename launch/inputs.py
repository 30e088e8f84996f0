"""The one place the launch side opens a file a user gave it (recipes, DeepSpeed JSON, model configs,
calibrations): every refusal is one ConfigError naming the file, never a traceback.

Rules: the path holds no NUL byte and names a readable regular file (not a folder, not a dangling or looping
link) of at most MAX_BYTES; the text is UTF-8; TOML and JSON documents nest at most MAX_DEPTH deep and hold no
integer longer than Python converts (4,300 digits), and no number that no field can take (NaN, an infinity, an
integer past 64 bits: launch/sense.py). The resolver checks each value's sense afterwards.
"""
from __future__ import annotations

import errno
import json
import math
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import sense
from launch.errors import ConfigError

MAX_BYTES = 16 * 2**20  # far beyond any recipe, config or calibration; a larger file is a wrong path
MAX_DEPTH = 64  # recipes nest 3 deep, DeepSpeed configs 4; Python's parsers recurse and would crash near 1,000


def not_a_file(path: Path) -> str | None:
    """What `path` is when it is not a regular file, in words ("does not exist", "is a FIFO (named pipe)", "is a
    folder", ...), without opening it (a FIFO's open blocks until a writer comes); None for a regular file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is a link to nothing" if path.is_symlink() else "does not exist"
    except ValueError:  # a NUL byte: no file system holds such a name
        return "holds a NUL byte"
    except OSError as e:
        return ("is a loop of symbolic links" if e.errno == errno.ELOOP else
                f"cannot be looked at ({e.strerror or type(e).__name__})")
    for test, what in ((stat.S_ISREG, None), (stat.S_ISDIR, "is a folder"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "is a socket"), (stat.S_ISCHR, "is a character device"),
                       (stat.S_ISBLK, "is a block device")):
        if test(mode):
            return what
    return "is not a regular file"


def read_text(path: str | Path, *, context: str, field: str, fix: str = "give the path of the file you meant") -> str:
    """The file's text, or a ConfigError (file, field, value, problem, fix)."""
    text_path = str(path)
    if "\x00" in text_path:
        raise ConfigError(context, field, text_path.replace("\x00", "\\0"), "holds a NUL byte", fix)
    p = Path(path)
    try:
        problem = not_a_file(p)
        if problem:
            raise ConfigError(context, field, text_path, problem, fix)
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(context, field, text_path, f"is {size:,} bytes, more than {MAX_BYTES:,}", fix)
        data = p.read_bytes()
    except ConfigError:
        raise
    except RuntimeError as e:  # a symlink loop in the path (Path.resolve / exists on some versions)
        raise ConfigError(context, field, text_path, f"cannot be followed ({e})", fix) from None
    except OSError as e:
        raise ConfigError(context, field, text_path, f"cannot be read ({e.strerror or type(e).__name__})",
                          "check the path and its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(text_path, "(encoding)", f"byte {data[e.start]:#04x} at offset {e.start}", "is not UTF-8",
                          "save the file as UTF-8") from None


def nesting(text: str, opener: str = "[{", closer: str = "]}") -> int:
    """The deepest bracket nesting of `text` outside strings (a cheap bound, checked before parsing)."""
    depth = deepest = 0
    quote = ""
    escaped = False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in opener:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closer:
            depth -= 1
    return deepest


def _text_of_document(path: str | Path, *, context: str, field: str, fix: str, what: str) -> str:
    text = read_text(path, context=context, field=field, fix=fix)
    if nesting(text) > MAX_DEPTH:
        raise ConfigError(str(path), "(nesting)", f"more than {MAX_DEPTH} levels", f"nests too deep to be {what}",
                          "flatten its arrays and tables")
    return text


def _number_too_long(path: str | Path, kind: str, e: ValueError) -> ConfigError:
    return ConfigError(str(path), kind, str(e).split(";")[0], "holds a number no field can take",
                       "write the number you meant")


def check_numbers(doc: Any, path: str | Path) -> Any:
    """`doc`, or a ConfigError naming the first field whose number no field can take (sense.bad_number)."""
    found = sense.bad_number(doc)
    if found is not None:
        field, value = found
        raise ConfigError(str(path), field, value, "is not a finite number within 64 bits", "write the number you meant")
    return doc


def parse_toml(path: str | Path, *, context: str, field: str, fix: str = "give the path of the file you meant") -> dict:
    text = _text_of_document(path, context=context, field=field, fix=fix, what="a recipe")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), "toml", str(e), "is not valid TOML", "fix the syntax at that line") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise _number_too_long(path, "toml", e) from None
    return check_numbers(doc, path)


def parse_json(path: str | Path, *, context: str, field: str, fix: str = "give the path of the file you meant",
               numbers: bool = True) -> Any:
    """A JSON document whose every number a field can take (check_numbers); `numbers=False` for files whose other
    writers put numbers there that no field of ours reads (transformers writes model_max_length = 1e30 as "no
    limit"): their caller checks the values it takes."""
    text = _text_of_document(path, context=context, field=field, fix=fix, what="a configuration")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        lines = text.splitlines()
        snippet = lines[e.lineno - 1].strip()[:60] if 0 < e.lineno <= len(lines) else ""
        raise ConfigError(str(path), f"line {e.lineno} col {e.colno}", snippet, f"is not valid JSON ({e.msg})",
                          "fix the JSON syntax at that position (strict JSON: no comments, no trailing commas)") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise _number_too_long(path, "json", e) from None
    return check_numbers(doc, path) if numbers else doc


def parse_json_object(path: str | Path, *, context: str, field: str, numbers: bool = True,
                      fix: str = "give the path of the file you meant") -> dict:
    """parse_json of a file that must hold one JSON object (a configuration), or a ConfigError saying it does not."""
    doc = parse_json(path, context=context, field=field, numbers=numbers, fix=fix)
    if not isinstance(doc, dict):
        raise ConfigError(str(path), field, json.dumps(doc)[:40], "is not a JSON object",
                          "use the file its library wrote (an object of settings)")
    return doc


def load_json(path: str | Path, *, numbers: bool = True) -> Any:
    """For readers that pass over a file they cannot use rather than refuse it (markers, sidecars, a candidate
    output's own record): the document, or what is wrong with the file in words. The same checks as parse_json: a
    FIFO is never opened (it would block), nesting is bounded before parsing (Python's parser recurses)."""
    try:
        return parse_json(path, context=str(path), field="(file)", numbers=numbers)
    except ConfigError as e:  # what is wrong, with the field or place it is at ("step=inf is not a finite ...")
        if e.field == "(file)":
            return _Problem(e.problem)
        return _Problem(str(ConfigError("", e.field, e.value, e.problem, "")).removeprefix(": ").removesuffix("; "))


class _Problem(str):
    """load_json's answer for a file it could not use: `isinstance(doc, str)` alone cannot tell it from a document
    that is a JSON string."""


def unusable(doc: Any) -> bool:
    """Whether load_json could not read the file (its answer is then the problem in words)."""
    return isinstance(doc, _Problem)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header describes it."""

    file: str
    dtype: str
    shape: tuple[int, ...]


SAFETENSORS_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit on the JSON header
# bytes per element of each dtype the safetensors format names (its Rust `Dtype`)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone (8 bytes of little-endian length, then JSON), with
    every tensor's bytes checked to lie inside the file: a file cut short, a header that is not the format's, or
    offsets past the end are one ConfigError naming the file."""

    def damaged(problem: str) -> ConfigError:
        return ConfigError(str(path), "model.weights", path.name, problem,
                           "copy the weights again (a download or copy was cut short?) or point model.weights elsewhere")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(SAFETENSORS_MAX_HEADER, size - 8):
                raise damaged(f"is not a safetensors file ({size} bytes; its header length reads {n})")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise damaged(f"cannot be read ({e.strerror or type(e).__name__})") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise damaged("has a header that is not JSON (or nests past any parser)") from None
    if not isinstance(header, dict):
        raise damaged("has a header that is not a JSON object")
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
                  and type(start) is int and type(end) is int and 0 <= start <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise damaged(f"describes tensor {name!r} without a dtype, shape and byte range")
        if 8 + n + end > size:
            raise damaged(f"is cut short: tensor {name!r} ends at byte {8 + n + end:,} of {size:,}")
        if dtype in DTYPE_BYTES and end - start != math.prod(shape) * DTYPE_BYTES[dtype]:  # sub-byte kinds unchecked
            raise damaged(f"describes tensor {name!r} ({dtype} {list(shape)}) in {end - start:,} bytes, which do not "
                          "hold it")
        out[name] = StoredTensor(path.name, dtype, shape)
    return out


# A weights folder's fingerprint reads this many evenly spaced pieces of each safetensors file, of this size.
FINGERPRINT_PIECES = 16
FINGERPRINT_PIECE_BYTES = 64 * 2**10


def weights_fingerprint(folder: Path) -> str:
    """A digest of a weights folder's safetensors files that another set of weights does not share: each file's name,
    size and FINGERPRINT_PIECES pieces spread over it (the first holds the header). A whole-file digest would read a
    7B model's 13 GB at every launch; other weights of the same architecture (another fine-tune, a re-download of a
    newer revision) differ in every piece, while an edit of a few values between the pieces goes unseen."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name} {size}\n".encode())
        with open(path, "rb") as f:
            for k in range(FINGERPRINT_PIECES):
                f.seek(size * k // FINGERPRINT_PIECES)
                digest.update(f.read(FINGERPRINT_PIECE_BYTES))
    return digest.hexdigest()
