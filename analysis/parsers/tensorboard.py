"""Read the scalar summaries of TensorBoard event files into one table, one row per value.

Uses the tensorboard package's own record reader and compat layers (no TensorFlow, no torch):
`RawEventFileLoader` for the TFRecord framing, then `data_compat` / `dataclass_compat`, which turn
TF1-style `simple_value` summaries (what torch's SummaryWriter, Megatron and DeepSpeed's monitor
write) into the TF2 `scalars` plugin form. A tag counts as a scalar when its first value carries
the `scalars` plugin metadata, as TensorBoard itself decides.

The loader stops quietly at a record it cannot read (a writer killed mid-record leaves a short
final record); this module counts the bytes it did read and warns when the file holds more, naming
the file and the byte offset where reading stopped.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Iterator, NamedTuple

from analysis.table import Table
from launch import sense

COLUMNS: dict[str, str] = {
    "tag": "summary tag as written (e.g. 'lm loss', 'Train/Samples/train_loss', 'iteration-time')",
    "step": "global step the writer attached to the value",
    "wall_time_s": "wall-clock time of the event, seconds since the Unix epoch",
    "value": "the scalar as a Python float",
    "run": "directory of the event file relative to the directory given (TensorBoard's run name); '.' for "
           "files directly in it, or when a single file was given",
    "file": "event file name",
}

_HEADER_BYTES = 12      # uint64 length + uint32 masked CRC of the length
_FOOTER_BYTES = 4       # uint32 masked CRC of the data
_FILE_VERSION = b"brain.Event:"
_MAX_WARNINGS = 20


def sniff(path: str | os.PathLike[str]) -> str | None:
    """'tensorboard' if `path` is an event file, or a directory holding one, judged by content.

    An event file starts with a TFRecord whose Event carries `file_version: "brain.Event:N"`.
    Directories are searched recursively (the first 200 files).
    """
    if os.path.isdir(path):
        return "tensorboard" if next(_event_files(os.fspath(path), limit=200), None) else None
    return "tensorboard" if _looks_like_event_file(os.fspath(path)) else None


class TensorBoardMeta(NamedTuple):
    """Table.meta of a `tensorboard` table (parse_tensorboard)."""

    files: list[dict[str, Any]]  # [{path, run, records}]: each event file read, its run folder and records read


def parse_tensorboard(dir_or_file: str | os.PathLike[str], *, source: str = "") -> Table:
    """Scalars of one event file, or of every event file under a directory, as the `tensorboard` table.

    Files are recognised by content, not name. Never raises on content: a truncated or corrupt
    record ends that file's reading with a warning (file and byte offset); records that are not
    Events are skipped with a warning. `meta` (TensorBoardMeta) lists the files read and how many records each held.
    """
    from tensorboard import data_compat, dataclass_compat
    from tensorboard.backend.event_processing.event_file_loader import (
        RawEventFileLoader,
    )
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    root = os.fspath(dir_or_file)
    name = source or root
    warnings: list[str] = []
    rows: list[dict[str, Any]] = []
    meta = TensorBoardMeta(files=[])  # its list filled below
    if os.path.isdir(root):
        files = sorted(_event_files(root))
        if not files:
            warnings.append(f"{name}: no TensorBoard event files found")
    elif os.path.isfile(root):
        files = [root]
        if not _looks_like_event_file(root):
            warnings.append(f"{name}: does not start with a TensorBoard event record; reading it anyway")
    else:
        files = []
        warnings.append(f"{name}: no such file or directory")

    for path in files:
        run = os.path.relpath(os.path.dirname(path), root) if path != root else "."
        label = path if path != root else name
        plugin_of_tag: dict[str, str] = {}
        initial_metadata: dict[str, Any] = {}
        offset = 0
        records = 0
        bad = 0
        try:
            loader = RawEventFileLoader(path)
            for raw in loader.Load():
                start = offset
                offset += _HEADER_BYTES + len(raw) + _FOOTER_BYTES
                records += 1
                try:
                    event = event_pb2.Event.FromString(raw)
                    events = dataclass_compat.migrate_event(data_compat.migrate_event(event), initial_metadata)
                except Exception as exc:  # protobuf raises DecodeError and friends; any of them means garbage
                    bad += 1
                    if bad <= _MAX_WARNINGS:
                        warnings.append(f"{label}: byte {start}: record is not a TensorBoard Event "
                                        f"({type(exc).__name__}); skipped")
                    continue
                for ev in events:
                    rows.extend(_scalar_rows(ev, plugin_of_tag, tensor_util, run, os.path.basename(path)))
        except OSError as exc:
            warnings.append(f"{label}: cannot read ({exc})")
            continue
        size = _size(path)
        if size is not None and offset < size:
            warnings.append(f"{label}: byte {offset}: the last {size - offset} bytes are not a complete record "
                            f"(file cut short while being written, or corrupt); kept the {records} records before")
        meta.files.append({"path": path, "run": run, "records": records})
    warnings += sense.clean(rows, name, counts=("step",), figures=("value",))
    return Table.from_rows("tensorboard", COLUMNS, rows, source=name, warnings=warnings, meta=meta)


def _scalar_rows(event: Any, plugin_of_tag: dict[str, str], tensor_util: Any, run: str,
                 file: str) -> Iterator[dict[str, Any]]:
    if not event.HasField("summary"):
        return
    for value in event.summary.value:
        # TF2 writers attach metadata to a tag's first value only; later values inherit it.
        plugin = value.metadata.plugin_data.plugin_name if value.HasField("metadata") else ""
        if plugin:
            plugin_of_tag.setdefault(value.tag, plugin)
        if plugin_of_tag.get(value.tag) != "scalars":
            continue
        if value.HasField("tensor"):
            try:
                array = tensor_util.make_ndarray(value.tensor)
                number = float(array.reshape(-1)[0]) if array.size == 1 else None
            except (ValueError, TypeError, IndexError):
                number = None
        elif value.HasField("simple_value"):
            number = float(value.simple_value)
        else:
            number = None
        if number is None:
            continue
        yield {"tag": value.tag, "step": int(event.step), "wall_time_s": float(event.wall_time), "value": number,
               "run": run, "file": file}


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _looks_like_event_file(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(_HEADER_BYTES + 64)
    except OSError:
        return False
    if len(head) < _HEADER_BYTES:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 0 < length < (1 << 20) and _FILE_VERSION in head[_HEADER_BYTES:]


def _event_files(root: str, limit: int | None = None) -> Iterator[str]:
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            if limit is not None and seen >= limit:
                return
            seen += 1
            path = os.path.join(dirpath, filename)
            if _looks_like_event_file(path):
                yield path
