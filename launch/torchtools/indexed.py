"""Megatron-Core's indexed datasets (PREFIX.bin + PREFIX.idx), read and written with its own
`megatron.core.datasets.indexed_dataset` classes.

    python -m launch.torchtools.indexed check PREFIX...  one JSON line per prefix (tokens, documents, largest id),
                                                      or one line `error: ...` and exit 2 (launch/data/check.py)
    python -m launch.torchtools.indexed build SPEC.json  tokenize a corpus into a prefix
                                                      (`python -m launch prepare-data`)

A prefix's documents are its sequences in order; the ranks read them as one token stream (`IndexedStream`), so a
prepared corpus gives exactly the rows its text gives (each document ends in the end-of-document id).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launch import inputs

from launch.data.corpus import PREPARED

MAX_SCAN_BYTES = 4 * 2**30  # the check reads every id of a .bin up to this size for the largest id


def _megatron():
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")  # a CPU-only install: not this reader's concern
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def open_prefix(prefix: str, whole: bool = False):
    """Megatron's IndexedDataset for `prefix`; a damaged pair raises ValueError with one line. `whole`: every entry of
    the index checked against the .bin (index_problem: the pre-launch check, `check` below); else, on the ranks that
    read what that check passed, only that the .bin reaches the last sequence's end."""
    ix = _megatron()
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        problem = inputs.not_a_file(p)
        if problem:
            raise ValueError(f"{p} {problem} (an indexed dataset is PREFIX.idx + PREFIX.bin)")
        if p.stat().st_size == 0:
            raise ValueError(f"{p} is empty")
    try:
        ds = ix.IndexedDataset(prefix)
    except Exception as e:  # noqa: BLE001 - Megatron's reader asserts, unpacks and maps; any failure is a damaged file
        raise ValueError(f"{idx} is not a readable Megatron index ({str(e) or type(e).__name__})") from None
    if len(ds) == 0:
        raise ValueError(f"{idx} holds no sequences")
    itemsize, size = ds.index.dtype().itemsize, bin_.stat().st_size
    end = int(ds.index.sequence_pointers[-1]) + int(ds.sequence_lengths[-1]) * itemsize
    problem = (index_problem(ds.sequence_lengths, ds.index.sequence_pointers, ds.document_indices, itemsize, size)
               if whole else ("bin", f"is truncated: {size:,} bytes, the index needs {end:,}") if size < end else None)
    if problem:
        which, what = problem
        raise ValueError(f"{idx if which == 'idx' else bin_} {what}")
    return ds


def index_problem(lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int,
                  bin_size: int) -> tuple[str, str] | None:
    """Which file ("idx" or "bin") and what is wrong with a whole index against its .bin (None: nothing), in one pass of vectorised checks, so that a
    multi-GB index is checked before launch as fast as it is read: every length is positive; every sequence starts
    where the lengths before it end, as Megatron's builder writes them (a pointer that lies sends a rank past the
    file, or into another sequence); the document boundaries start at 0, never fall back and end at the last
    sequence; the .bin holds every id the index points at and no fraction of one. The first offender is named."""
    lengths = np.asarray(lengths).astype(np.int64, copy=False)
    pointers = np.asarray(pointers).astype(np.int64, copy=False)
    documents = np.asarray(documents).astype(np.int64, copy=False)
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        return "idx", f"gives sequence {bad[0]:,} a length of {lengths[bad[0]]:,}"
    expected = np.concatenate([[0], np.cumsum(lengths[:-1] * itemsize)])
    bad = np.flatnonzero(pointers != expected)
    if bad.size:
        i = bad[0]
        return "idx", f"points sequence {i:,} at byte {pointers[i]:,}; the lengths before it end at byte {expected[i]:,}"
    if documents.size < 2 or documents[0] != 0 or documents[-1] != lengths.size or np.any(np.diff(documents) < 0):
        return "idx", (f"holds document boundaries ({documents.size:,}, from {documents[:1].tolist()} to "
                       f"{documents[-1:].tolist()}) that do not run from 0 up to its {lengths.size:,} sequences")
    end = int(expected[-1] + lengths[-1] * itemsize)
    if bin_size < end:
        return "bin", f"is truncated: {bin_size:,} bytes, the index needs {end:,}"
    if bin_size % itemsize:
        return "bin", f"is {bin_size:,} bytes, not a whole number of {itemsize}-byte ids"
    return None


@dataclass
class IndexedStream:
    """Several prefixes' sequences as one stream of token ids (launch.data.rows.TokenStream)."""

    datasets: list
    starts: np.ndarray  # each sequence's first token in the stream, all prefixes in order, one past the end last
    owner: np.ndarray  # (dataset, sequence) of each global sequence

    @classmethod
    def open(cls, prefixes: list[str]) -> "IndexedStream":
        datasets = [open_prefix(p) for p in prefixes]
        lengths = np.concatenate([ds.sequence_lengths.astype(np.int64) for ds in datasets])
        owner = np.concatenate([np.stack([np.full(len(ds), k), np.arange(len(ds))], axis=1)
                                for k, ds in enumerate(datasets)])
        return cls(datasets, np.concatenate([[0], np.cumsum(lengths)]), owner)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            k, i = self.owner[s]
            take = min(stop, int(self.starts[s + 1])) - start
            pieces.append(self.datasets[k].get(int(i), offset=start - int(self.starts[s]), length=take))
            start += take
            s += 1
        return np.concatenate(pieces).astype(np.int64)


def check(prefixes: list[str]) -> int:
    scanned = 0  # bytes of ids read for the largest id, over all prefixes
    for prefix in prefixes:
        try:
            ds = open_prefix(prefix, whole=True)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        bin_size = Path(prefix + ".bin").stat().st_size
        max_id = None
        if scanned + bin_size <= MAX_SCAN_BYTES:
            scanned += bin_size
            max_id = int(np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r").max())
        sidecar = Path(prefix + PREPARED)
        made = None
        doc = inputs.load_json(sidecar) if os.path.lexists(sidecar) else None
        if isinstance(doc, dict):
            try:
                made = {"tokenizer": str(doc["tokenizer"]), "vocab_size": int(doc["vocab_size"]),
                        "tokenizer_sha256": str(doc["tokenizer_sha256"])}
            except (ValueError, KeyError, TypeError):
                made = None  # a damaged sidecar only loses the tokenizer comparison
        print(json.dumps({"prefix": prefix, "tokens": int(ds.sequence_lengths.sum(dtype=np.int64)),
                          "documents": len(ds.document_indices) - 1, "max_id": max_id, "prepared_with": made,
                          # what resume compares: the index holds every document's length and place
                          "idx_sha256": hashlib.sha256(Path(prefix + ".idx").read_bytes()).hexdigest()}))
    return 0


def build(spec_path: str) -> int:
    """Tokenize the corpus files of SPEC (written by launch/commands/prepare_data.py) into its prefix with Megatron's
    IndexedDatasetBuilder; the .bin/.idx appear under their names only when complete."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from launch.data.corpus import CorpusError, read_documents
    from launch.data.tokenizer import load_tokenizer

    ix = _megatron()
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    prefix = spec["out"]
    try:
        tok = load_tokenizer(spec["tokenizer"], spec.get("model_weights"), "prepare-data")
    except Exception as e:  # noqa: BLE001 - checked by the command before; a change since is one line too
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = ix.DType.optimal_dtype(tok.vocab_size)
    tmp = f"{prefix}.tmp{os.getpid()}"
    try:
        builder = ix.IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    except OSError as e:
        print(f"error: {tmp}.bin cannot be written ({e.strerror})", file=sys.stderr)
        return 2
    documents = tokens = empty = 0
    damaged: list[str] = []
    t0 = time.perf_counter()
    console = Console(file=sys.stderr)
    files = [Path(f) for f in spec["files"]]
    try:
        with Progress(TextColumn("[bold]tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                      TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=console,
                      disable=not console.is_terminal) as progress:
            task = progress.add_task("prepare", total=len(files), stats="")
            for f in files:
                try:
                    docs = read_documents([f], spec["source"], spec["text_field"])
                except CorpusError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
                if docs.warning():
                    damaged.append(f"{f}: {docs.warning()}")
                for ids in tok.encode(docs.texts):
                    builder.add_document(ids, [len(ids)])
                    tokens += len(ids)
                documents += len(docs.texts)
                empty += sum(1 for text in docs.texts if not text.strip())
                progress.update(task, advance=1, stats=f"{documents:,} docs  {tokens:,} tokens")
        builder.finalize(tmp + ".idx")
        seconds = time.perf_counter() - t0
        Path(tmp + PREPARED).write_text(json.dumps({"tokenizer": tok.name, "vocab_size": tok.vocab_size,
                                                   "tokenizer_sha256": tok.sha256,
                                                   "eos_id": tok.eos_id, "documents": documents, "tokens": tokens,
                                                   "files": [str(f) for f in files]}, indent=1) + "\n")
        linked: list[str] = []
        try:
            for suffix in (".bin", ".idx", PREPARED):  # a reader sees the pair only once the .idx exists
                os.link(tmp + suffix, prefix + suffix)  # never replaces: a prefix made meanwhile stops this one
                linked.append(prefix + suffix)
        except FileExistsError as e:
            for p in linked:
                os.unlink(p)
            print(f"error: {e.filename2 or e.filename} appeared while tokenizing; nothing was replaced", file=sys.stderr)
            return 2
    finally:
        for suffix in (".bin", ".idx", PREPARED):
            Path(tmp + suffix).unlink(missing_ok=True)
    size = Path(prefix + ".bin").stat().st_size + Path(prefix + ".idx").stat().st_size
    if empty:  # written as they are (an end-of-document token each), but a corpus of them trains on nothing
        damaged.append(f"{empty:,} of the {documents:,} documents hold no text: each is its end-of-document token alone")
    for line in damaged:
        print(f"warning: {line}", file=sys.stderr)
    print(f"prepared {prefix}.bin/.idx: {documents:,} documents, {tokens:,} tokens, {size:,} bytes, "
          f"{tokens / seconds:,.0f} tokens/s ({seconds:.2f} s; tokenizer {tok.name}, ids {np.dtype(dtype).name})")
    print(f"train on it: data.source=megatron data.path={prefix} data.tokenizer={spec['tokenizer']}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) > 1:
        return check(argv[1:])
    if argv[:1] == ["build"] and len(argv) == 2:
        return build(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
