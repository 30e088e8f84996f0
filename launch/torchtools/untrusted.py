"""Untrusted files never run code: every pickle a rank loads is read with `weights_only=True`, and the few
non-tensor objects DeepSpeed stores in checkpoints (of both backends: Megatron's are saved through its engine) are
allowed one by one.

Run directories and checkpoints travel (a colleague's run to export, a downloaded checkpoint to resume), and a
pickle executes whatever its globals name on load. torch's weights-only unpickler rebuilds tensors and plain
containers only; `ALLOWED` adds, by fully qualified name, the objects the libraries we pin write (each with the
version that writes it). `guard()` makes every `torch.load` of this process weights-only, DeepSpeed's own loads
included (it asks for weights_only=False in some twenty places); `python -m launch.torchtools.untrusted PATH ...` is
the check the CLI runs before any rank starts: it names the first file and object that is not allowed, without
unpickling anything, and exits 2.
"""
from __future__ import annotations

import importlib
import io
import json
import sys
from pathlib import Path

from launch import inputs

# Qualified name -> who writes it (the library and version checked here). Found with
# torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints of every backend and ZeRO stage.
ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "DeepSpeed 0.19.8 optimizer states (ZeRO 1-3)",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "DeepSpeed 0.19.8 optimizer states, fp16",
    "deepspeed.utils.tensor_fragment.fragment_address": "DeepSpeed 0.19.8 optimizer states (ZeRO 1-2)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "DeepSpeed 0.19.8 optimizer states (ZeRO 1-3)",
}
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# torch.distributed.checkpoint (the torch backend's checkpoints) writes `.metadata` with pickle and its own reader
# loads it with a bare pickle.load: here it is read by an unpickler that builds these objects and torch dtypes only.
DCP_METADATA = ".metadata"
DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class UntrustedFileError(RuntimeError):
    """A file that would run code (or names objects nobody we pin writes) if it were unpickled."""


def allowed_objects() -> list:
    """The ALLOWED objects themselves, imported (torch's safe-globals lists take objects, not names)."""
    out = []
    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # a library not installed here writes no such checkpoint here either
            continue
    return out


def guard() -> None:
    """Every torch.load of this process weights-only, with ALLOWED admitted: a rank or export process calls this
    before it loads anything."""
    import functools

    import torch

    if getattr(torch.load, "_layoutlab_guarded", False):
        return
    torch.serialization.add_safe_globals(allowed_objects())
    original = torch.load

    @functools.wraps(original)
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except Exception as e:  # torch raises UnpicklingError (a pickle.UnpicklingError) naming the global
            said = [ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln or "GLOBAL" in ln]
            if said or "weights_only" in str(e):
                # torch's own advice (load it with weights_only=False) is the one thing not to do here
                raise UntrustedFileError(f"{f}: {said[0] if said else _first_line(e)}; refused, never unpickled "
                                         "(launch/torchtools/untrusted.py lists what is allowed)") from None
            raise

    load._layoutlab_guarded = True
    torch.load = load


def read_dcp_metadata(path: Path):
    """A torch.distributed.checkpoint `.metadata` file, unpickled with only DCP_METADATA_GLOBALS (and torch dtypes)
    constructible: anything else it names raises UntrustedFileError before it is built."""
    import pickle

    import torch

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in DCP_METADATA_GLOBALS or (
                    module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise UntrustedFileError(f"{path}: names {module}.{name}, which torch.distributed.checkpoint does not write "
                                     "into its metadata; refused, never unpickled (a pickle runs what it names)")

    try:
        with open(path, "rb") as f:
            metadata = Restricted(f).load()
        storage = getattr(metadata, "storage_data", None) or {}
        files = {getattr(info, "relative_path", None) for info in storage.values()}
    except UntrustedFileError:
        raise
    except Exception as e:  # truncated, or not a pickle at all
        raise UntrustedFileError(f"{path}: not readable as checkpoint metadata ({_first_line(e)})") from None
    # DCP reads each tensor from the file its metadata names: only files of this folder
    outside = sorted(str(f) for f in files if not isinstance(f, str) or not f or "/" in f or "\\" in f or "\x00" in f
                     or f in (".", ".."))
    if outside:
        raise UntrustedFileError(f"{path}: names {outside[0]!r} as a data file, which is not a file of this checkpoint "
                                 "folder; refused")
    _check_slices(path.parent, storage)
    return metadata


def _check_slices(folder: Path, storage: dict) -> None:
    """Every data file the metadata names is a regular file of the folder (looked at, never opened, before: a FIFO
    would hang the read), and every item's bytes lie inside it (a shard cut short, or another checkpoint's)."""
    sizes: dict[str, int] = {}
    for name in sorted({info.relative_path for info in storage.values()}):
        problem = inputs.not_a_file(folder / name)
        if problem:
            raise UntrustedFileError(f"{folder / name}: {problem}; the checkpoint's metadata names it as a data file")
        sizes[name] = (folder / name).stat().st_size
    for index, info in storage.items():
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= sizes[info.relative_path]):
            raise UntrustedFileError(
                f"{folder / info.relative_path}: {sizes[info.relative_path]:,} bytes, where the metadata places "
                f"{getattr(index, 'fqn', index)} at bytes {offset}+{length}: cut short, or not this checkpoint's file")


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of a file as a seekable file of their own: torch's zip reader takes the item
    DCP stored there without the rest of the shard being read."""

    def __init__(self, f, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, min(self.length, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos))
        return self.pos

    def readinto(self, buffer) -> int:
        self.f.seek(self.offset + self.pos)
        data = self.f.read(min(len(buffer), self.length - self.pos))
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _check_dcp_items(meta_path: Path) -> None:
    """Every item of a DCP checkpoint (each a torch.save archive at its place in a data file, loaded weights-only on
    the ranks) names no object outside ALLOWED: read from its pickle's opcodes, before any rank starts."""
    import torch

    folder = meta_path.parent
    storage = getattr(read_dcp_metadata(meta_path), "storage_data", None) or {}
    by_file: dict[str, list] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for name, items in sorted(by_file.items()):
        with open(folder / name, "rb") as f:
            for index, info in items:
                try:
                    found = torch.serialization.get_unsafe_globals_in_checkpoint(_Slice(f, info.offset, info.length))
                except Exception as e:  # not a torch archive where the metadata says one is
                    raise UntrustedFileError(f"{folder / name}: {getattr(index, 'fqn', index)} at byte {info.offset:,} "
                                             f"is not a stored item ({_first_line(e)}); refused, never unpickled") from None
                unknown = [g for g in found if g not in ALLOWED]
                if unknown:
                    raise UntrustedFileError(f"{folder / name}: {getattr(index, 'fqn', index)} names {unknown[0]}, "
                                             "which torch.distributed.checkpoint never stores; refused, never unpickled "
                                             "(a pickle runs what it names)")


class CheckpointMismatchError(UntrustedFileError):
    """A checkpoint whose tensors are not the model's (another model's shards, or a marker that lies about them):
    refused before any rank starts, in the same one line."""


# The entry of the state torch_backend saves with DCP that holds the model (beside "optim"); DCP flattens nested
# state, so a model tensor's key is "model." + its name.
DCP_MODEL_KEY = "model"
DCP_MODEL_PREFIX = DCP_MODEL_KEY + "."


def shape_mismatches(metadata, want: dict[str, tuple[int, ...]]) -> list[str]:
    """Each model tensor (`want`: DCP key -> global shape) that the checkpoint's metadata lacks or holds in another
    shape, in words; the ranks' check before loading and the driver's before launch both ask it."""
    saved = getattr(metadata, "state_dict_metadata", None) or {}
    wrong = []
    for key, shape in want.items():
        meta = saved.get(key)
        have = tuple(getattr(meta, "size", ())) if meta is not None else None
        if have != tuple(shape):
            wrong.append(f"{key.removeprefix(DCP_MODEL_PREFIX)}: checkpoint {have if have is not None else 'missing'}, "
                         f"model {tuple(shape)}")
    return wrong


def mismatch_text(folder: Path, wrong: list[str]) -> str:
    """The one line a checkpoint of another model gets, before launch and on the ranks alike."""
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return (f"{folder}: checkpoint does not fit this model: {'; '.join(wrong[:3])}{more}; set run.resume=never to "
            "start fresh")


def dcp_reader(folder: Path):
    """torch.distributed.checkpoint's FileSystemReader for `folder`, reading its metadata through read_dcp_metadata.
    The tensors and other saved objects in its data files it reads with torch.load, weights-only (guard())."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(Path(folder) / DCP_METADATA)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(folder))


def check(paths: list[Path], shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise UntrustedFileError for the first checkpoint file under `paths` (files or folders) that names an object
    outside torch's weights-only set and ALLOWED, or a DCP metadata file that names one outside DCP_METADATA_GLOBALS;
    with `shapes` (DCP key -> the model's global shape), CheckpointMismatchError for a DCP checkpoint whose model
    tensors are not those. Reads the pickles' opcodes only (the metadata through the restricted unpickler); runs
    nothing they name."""
    import torch

    for path in paths:
        entries = sorted(path.rglob("*")) if path.is_dir() else [path]
        # a FIFO in a shard's or the metadata's place would block the first read of it: named from its stat
        for f in entries:
            problem = None if f.is_dir() and not f.is_symlink() else inputs.not_a_file(f)
            if problem:
                raise UntrustedFileError(f"{f}: {problem}; a checkpoint holds regular files only")
        for meta in (f for f in entries if f.name == DCP_METADATA) if path.is_dir() else ():
            _check_dcp_items(meta)
            wrong = shape_mismatches(read_dcp_metadata(meta), shapes) if shapes else []
            if wrong:
                raise CheckpointMismatchError(mismatch_text(meta.parent, wrong))
        for f in (f for f in entries if f.suffix in CHECKPOINT_SUFFIXES) if path.is_dir() else entries:
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
            except Exception as e:  # not a torch zip archive at all: a bare pickle or damage
                raise UntrustedFileError(f"{f}: cannot be checked as a torch checkpoint ({_first_line(e)}); refused, "
                                         "never unpickled") from None
            unknown = [g for g in found if g not in ALLOWED]
            if unknown:
                raise UntrustedFileError(f"{f}: names {unknown[0]}, which no library layoutlab pins writes into a "
                                         "checkpoint; refused, never unpickled (a pickle runs what it names)")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv: list[str]) -> int:
    """`python -m launch.torchtools.untrusted [--shapes=-] PATH ...`: exit 2 with one line when a checkpoint file would
    run code (or, with --shapes=- and the model's tensor names and shapes as JSON on stdin, when a DCP checkpoint holds
    another model's tensors).
    `python -m launch.torchtools.untrusted ds_to_universal ARGS`: DeepSpeed's converter with every load weights-only."""
    if argv[:1] == ["ds_to_universal"]:
        from deepspeed.checkpoint import ds_to_universal

        try:
            check([Path(argv[argv.index("--input_folder") + 1])])
        except UntrustedFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        guard()  # its extraction workers fork from here and keep the guard
        sys.argv = ["ds_to_universal", *argv[1:]]
        ds_to_universal.main(ds_to_universal.parse_arguments())
        return 0
    shapes = None
    if argv[:1] == ["--shapes=-"]:  # the model's tensor names and shapes as JSON on stdin (the driver imports no torch)
        shapes = {DCP_MODEL_PREFIX + k: tuple(v) for k, v in json.loads(sys.stdin.read()).items()}
        argv = argv[1:]
    try:
        check([Path(a) for a in argv], shapes)
    except UntrustedFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
