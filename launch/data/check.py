"""The data check before any rank starts: every file the recipe names is opened and read, the tokenizer loaded and
matched to the model's vocabulary, and the rows counted against the batch. Text and Parquet corpora are tokenized here,
once, into the run's data/ folder (the ranks map it); Megatron indexed datasets are opened with Megatron-Core's own
reader in a child process (launch/torchtools/indexed.py: the driver never imports Megatron itself).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

import numpy as np

from launch.data.corpus import CorpusError, corpus_files, megatron_prefixes, read_documents
from launch.data.rows import split_rows
from launch.data.tokenizer import Tokenizer, load_tokenizer, tokenize
from launch.errors import ConfigError

if TYPE_CHECKING:
    from launch.config.resolve import Resolved

INDEXED_MODULE = "launch.torchtools.indexed"
CACHE = {"train": "train.npy", "valid": "valid.npy"}  # under the run's data/ folder


@dataclass(frozen=True)
class Corpus:
    """What the check found in one corpus (the training corpus or data.valid_path)."""

    files: int
    documents: int
    tokens: int
    damaged: str | None  # the warning about skipped records, if any
    ids: np.ndarray | None  # text and Parquet: the token stream; megatron: None (the ranks read the prefixes)
    sha256: str  # of the token stream, or of the prefixes' indexes: what a resumed run must read again


@dataclass(frozen=True)
class DataCheck:
    train_rows: int
    valid_rows: int
    lines: tuple[str, ...]  # a summary and warnings, for the terminal
    streams: dict[str, np.ndarray]  # text and Parquet: CACHE key -> the token stream the ranks will read
    fingerprint: str  # the training and validation corpora's digest (Resolved.data_fingerprint)

    def save(self, folder: Path, write_atomic: Callable[[Path, Callable[[BinaryIO], object]], None]) -> None:
        """The token streams, for the ranks to map instead of tokenizing the corpus again on every rank, through the
        run directory's atomic writer (every node of a job writes them into the shared folder at once)."""
        if self.streams:
            folder.mkdir(parents=True, exist_ok=True)
        for key, ids in self.streams.items():
            write_atomic(folder / CACHE[key], lambda f, ids=ids: np.save(f, ids))


def check(resolved: "Resolved") -> DataCheck | None:
    """None for synthetic data; else what the corpus holds, or a ConfigError naming the file and the fix."""
    r = resolved.recipe
    d, w = r.data, resolved.recipe_path
    if d.source == "synthetic":
        if r.train.eval_every:
            raise ConfigError(w, "train.eval_every", r.train.eval_every, "needs a corpus (data.source=\"synthetic\")",
                              "set data.source, data.path and data.valid_fraction, or train.eval_every=0")
        return None
    tok = load_tokenizer(d.tokenizer, r.model.weights, w)
    if tok.vocab_size > resolved.model.vocab_size:
        raise ConfigError(w, "data.tokenizer", d.tokenizer, f"has {tok.vocab_size:,} ids, more than the model's "
                          f"embedding of {resolved.model.vocab_size:,}", "use the model's own tokenizer (data.tokenizer="
                          "\"model\") or a model whose vocab_size holds it")
    train = _corpus(resolved, tok, d.path, "data.path")
    unit = "prefix(es)" if d.source == "megatron" else "file(s)"
    lines = [f"data: {d.source} {train.files} {unit}, {train.documents:,} documents, {train.tokens:,} tokens "
             f"(tokenizer {tok.name}, vocabulary {tok.vocab_size:,})"]
    seq = r.batch.seq_len
    valid = _corpus(resolved, tok, d.valid_path, "data.valid_path") if d.valid_path else None
    s = split_rows(train.tokens, seq, d.valid_fraction, valid.tokens if valid else None)
    train_rows, valid_rows = s.train_rows, s.valid_rows
    for c in (train, valid):
        if c is not None and c.damaged:
            lines.append(f"warning: {c.damaged}")
    gb = r.batch.global_batch_size
    if train_rows < gb:
        raise ConfigError(w, "data.path", d.path, f"holds {train_rows} rows of {seq} tokens for training, fewer than one "
                          f"global batch of {gb}", "give more text, or lower batch.seq_len or batch.global_batch_size")
    if r.train.eval_every:
        if not (d.valid_path or d.valid_fraction):
            raise ConfigError(w, "train.eval_every", r.train.eval_every, "needs held-out rows",
                              "set data.valid_fraction (e.g. 0.05) or data.valid_path")
        if valid_rows < gb:
            field, value = ("data.valid_path", d.valid_path) if d.valid_path else ("data.valid_fraction", d.valid_fraction)
            raise ConfigError(w, field, value, f"gives {valid_rows} validation rows, fewer than one global batch of {gb}",
                              "hold out more (a larger fraction or file)")
    elif valid_rows:
        lines.append(f"warning: {valid_rows} rows held out for validation but train.eval_every=0 never evaluates them")
    lines.append(f"data: {train_rows:,} training rows of {seq} tokens ({train_rows // gb:,} steps an epoch)"
                 + (f", {valid_rows:,} validation rows" if valid_rows else ""))
    streams = {key: c.ids for key, c in (("train", train), ("valid", valid)) if c is not None and c.ids is not None}
    fingerprint = hashlib.sha256(f"{train.sha256} {valid.sha256 if valid else ''}".encode()).hexdigest()
    return DataCheck(train_rows, valid_rows, tuple(lines), streams, fingerprint)


def corpus_ids(source: str, path: str, text_field: str, tok: Tokenizer) -> Corpus:
    """A text or Parquet corpus tokenized. The ranks call it too when no cache was written (launch calibrate)."""
    docs = read_documents(corpus_files(path, source), source, text_field)
    ids = tokenize(docs.texts, tok)
    return Corpus(docs.files, len(docs.texts), len(ids), docs.warning(), ids, hashlib.sha256(ids.tobytes()).hexdigest())


def _corpus(resolved: "Resolved", tok: Tokenizer, path: str, field: str) -> Corpus:
    d = resolved.recipe.data
    try:
        if d.source == "megatron":
            return _indexed(resolved, tok, megatron_prefixes(path), field, path)
        return corpus_ids(d.source, path, d.text_field, tok)
    except CorpusError as e:
        raise ConfigError(e.file, field, path, f"{e.where} {e.problem}" if e.where else e.problem, e.fix) from None


def _indexed(resolved: "Resolved", tok: Tokenizer, prefixes: list[str], field: str, path: str) -> Corpus:
    p = subprocess.run([sys.executable, "-m", INDEXED_MODULE, "check", *prefixes], capture_output=True, text=True)
    if p.returncode != 0:
        lines = (p.stderr.strip() or p.stdout.strip() or f"exit {p.returncode}").splitlines()
        line = next((x for x in lines if x.startswith("error: ")), lines[-1])
        raise ConfigError(resolved.recipe_path, field, path, line.removeprefix("error: "),
                          "prepare it again with `python -m launch prepare-data`") from None
    found = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    vocab = resolved.model.vocab_size
    for f in found:
        if f["max_id"] is not None and f["max_id"] >= vocab:
            raise ConfigError(f["prefix"], field, path, f"holds id {f['max_id']:,}, beyond the "
                              f"model's embedding of {vocab:,} ids", "prepare it with the model's own tokenizer")
        made = f.get("prepared_with")
        if made and made["tokenizer_sha256"] != tok.sha256:
            raise ConfigError(f["prefix"], "data.tokenizer", resolved.recipe.data.tokenizer,
                              f"is not the tokenizer the prefix was prepared with ({made['tokenizer']}, "
                              f"{made['vocab_size']:,} ids)", "name the tokenizer the prefix was prepared with")
    digest = hashlib.sha256(" ".join(f["idx_sha256"] for f in found).encode()).hexdigest()
    return Corpus(len(found), sum(f["documents"] for f in found), sum(f["tokens"] for f in found), None, None, digest)
