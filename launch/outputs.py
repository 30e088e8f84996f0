"""The one writer of what any command writes (run directories, reports, plans, exports, calibrations, accelerate
configs, prepared data).

Three rules, checked before any work starts and kept while writing:
- a file appears whole: it is written under a name of this writer's own, then renamed into place;
- a target is replaced only when this project wrote it, recognised exactly by a mark the writer of that kind puts in
  it (`ours`: a header, a marker file, a schema), never by a search of its text; nothing else is replaced or deleted;
- a target is never an input of the same command, inside one, or (a folder) holding one.
A folder of our own (a run directory, a calibration's working folder) is claimed with an exclusive mkdir, so two
launches never share one.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import os
import socket
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from launch.errors import ConfigError


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: readers see the old file or the new one, never a part."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` at once: readers see the old file or the new one, never a part."""
    write_atomic(path, lambda f: f.write(data))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace `path` with what `write` writes to the open file, at once: readers see the old file or the new one,
    never a part.

    The temporary name is this writer's own (host, process and thread): the nodes of a job write their shared run
    directory at the same moment, and with one name for all, one node's os.replace moved the file the other had
    just written, which then failed with FileNotFoundError and left node 0 waiting in the rendezvous.
    """
    tmp = path.with_name(_temporary_name(path))
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _temporary_name(path: Path) -> str:
    """A name beside `path` of this writer's own (host, process and thread), of fixed length: the name it stands in
    for may already be near the file system's limit."""
    writer = f"{path.name}\0{socket.gethostname()}\0{os.getpid()}\0{threading.get_ident()}"
    return f".{hashlib.sha256(writer.encode('utf-8', 'surrogateescape')).hexdigest()[:24]}.tmp"


def write_new(path: Path, write: Callable[[BinaryIO], object]) -> bool:
    """Write `path` whole, only if nothing is there when it is ready (a hard link never replaces): False, and
    nothing changed, when a file appeared at `path` meanwhile."""
    tmp = path.with_name(_temporary_name(path))
    try:
        with open(tmp, "wb") as f:
            write(f)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def claim_folder(parent: Path, prefix: str = "", *, field: str = "out",
                 now: _dt.datetime | None = None) -> Path:
    """A new folder `parent/<prefix><UTC stamp>` of this process's own: mkdir is the atomic claim, so two launches in
    one second get distinct folders (`-1`, `-2`, ...) and none is ever joined. A `parent` that cannot hold folders
    (a file on the way, a symlink loop, no permission) is one line naming `field`."""
    problem = place_problem(parent / "x")
    if problem:
        raise ConfigError("command line" if field == "out" else "environment", field, str(parent), problem,
                          "name a folder that exists or can be created")
    parent = parent.resolve()
    parent.mkdir(parents=True, exist_ok=True)
    stamp = prefix + (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:
        path = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


NAME_MAX = 255  # bytes in one file name on Linux file systems


def place_problem(path: Path) -> str | None:
    """Why nothing can be written at `path` (None: it can, once missing folders are made): no file name in it (`.`,
    `..`), a name too long, a symlink as the name itself (a write replaces the link, not what it points to), a
    symlink on the way that points to nothing or loops (a folder would be made wherever it points), a file where a
    folder is needed, or no writable folder to create it in. A symlinked folder on the way is followed."""
    if path.name in ("", ".", ".."):
        return "names no file or folder of its own (it ends in '.', '..' or '/'); add a name"
    if len(path.name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return f"has a name longer than {NAME_MAX} bytes"
    full = Path(os.path.abspath(path))
    for part in [*reversed(full.parents[:-1]), full]:
        if os.path.islink(part):
            if not os.path.exists(part):
                try:
                    os.stat(part)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        return f"goes through a symlink loop ({part})"
                return (f"is a symlink to nothing ({os.readlink(part)})" if part == full else
                        f"goes through {part}, a symlink to nothing ({os.readlink(part)})")
            if part == full:
                return f"is a symlink (to {os.readlink(part)}); name the file or folder itself"
        elif not os.path.exists(part):
            parent = part.parent
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"cannot be created: {parent} is not a writable folder"
            return None
        if part != full and not os.path.isdir(part):
            return f"lies under {part}, which is a file"
    if not os.access(full.parent, os.W_OK | os.X_OK):
        return f"cannot be replaced: {full.parent} is not a writable folder"
    return None


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def input_problem(target: Path, inputs: Iterable[Path], *, folder: bool = False) -> str | None:
    """Why `target` may not be written by a command that reads `inputs` (None: it may): it is one of them or lies
    inside one; a folder target also may not hold one."""
    t = _resolved(target)
    for src in inputs:
        s = _resolved(src)
        if t == s:
            return f"is an input of this command ({src})"
        if s in t.parents:
            return f"lies inside an input of this command ({src})"
        if folder and t in s.parents:
            return f"holds an input of this command ({src})"
    return None


def file_problem(path: Path, *, ours: Callable[[Path], bool], writer: str,
                 inputs: Iterable[Path] = ()) -> str | None:
    """Why `writer` may not write the file `path` (None: it is absent, or an earlier one of ours it will replace)."""
    problem = place_problem(path) or input_problem(path, inputs)
    if problem:
        return problem
    if path.is_dir():
        return "is a folder; name a file in it"
    if path.exists() and not (path.is_file() and ours(path)):
        return f"exists and was not written by {writer}; it is never overwritten"
    return None


def folder_problem(path: Path, *, ours: Callable[[Path], bool], writer: str,
                   inputs: Iterable[Path] = ()) -> str | None:
    """Why `writer` may not fill the folder `path` (None: absent, empty, or an earlier one of ours)."""
    problem = place_problem(path) or input_problem(path, inputs, folder=True)
    if problem:
        return problem
    if path.exists() and not path.is_dir():
        return "is a file; name a folder (it is created)"
    if path.is_dir() and any(path.iterdir()) and not ours(path):
        first = min(p.name for p in path.iterdir())
        return f"holds files that {writer} did not write ({first}, ...); they are never replaced or deleted"
    return None
