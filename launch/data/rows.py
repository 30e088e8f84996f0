"""Rows of training data indexed by (step, data-parallel rank, micro-step).

Every rank derives its micro-batch from the global batch of the step, so any layout with the same global batch sees
the same rows: ranks of one TP group read the same rows (they share a data-parallel rank), a 1-rank run reads them
all, and a resumed run continues at the exact next row (the position is a function of the step alone).

A corpus is one stream of token ids (documents packed, each ending in its end-of-document id) cut into rows of
seq_len; attention crosses document boundaries inside a row (the end-of-document id separates them), as Megatron's
GPTDataset and nanoGPT train by default. The last `valid_fraction` of the rows is held out for the validation loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Protocol

import numpy as np


class TokenStream(Protocol):
    """Token ids in corpus order: an array in memory, a cache file mapped, or Megatron indexed datasets."""

    def __len__(self) -> int: ...

    def window(self, start: int, stop: int) -> np.ndarray: ...


@dataclass(frozen=True)
class ArrayStream:
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def window(self, start: int, stop: int) -> np.ndarray:
        return self.ids[start:stop]


@dataclass(frozen=True)
class Synthetic:
    """Walks through a fixed random successor table (one permutation of the vocabulary per seed) from a
    random start per sample: a bigram rule a tiny model learns within tens of steps, so loss falls."""

    vocab: int
    seq_len: int
    seed: int

    def successor(self) -> np.ndarray:
        return np.random.default_rng((self.seed, 0x5EED)).permutation(self.vocab)

    def row(self, index: int) -> np.ndarray:
        succ = self.successor()
        out = np.empty(self.seq_len, dtype=np.int64)
        out[0] = np.random.default_rng((self.seed, index)).integers(0, self.vocab)
        for i in range(1, self.seq_len):
            out[i] = succ[out[i - 1]]
        return out

    def rows_per_epoch(self) -> int | None:
        return None


@dataclass(frozen=True)
class TokenRows:
    """Rows [first, first + count) of a stream cut into seq_len windows; training reads them in a fresh order every
    epoch (seeded), validation (shuffle=False) in corpus order."""

    stream: TokenStream
    seq_len: int
    seed: int
    first: int
    count: int
    shuffle: bool = True

    def rows_per_epoch(self) -> int:
        return self.count

    def row(self, index: int) -> np.ndarray:
        epoch, i = divmod(index, self.count)
        j = int(_order(self.seed, epoch, self.count)[i]) if self.shuffle else i
        start = (self.first + j) * self.seq_len
        return np.asarray(self.stream.window(start, start + self.seq_len), dtype=np.int64)


@lru_cache(maxsize=2)  # the epoch being read (and the next, across a boundary): one permutation, not one per row
def _order(seed: int, epoch: int, count: int) -> np.ndarray:
    return np.random.default_rng((seed, epoch)).permutation(count)


@dataclass(frozen=True)
class Split:
    train_rows: int
    valid_rows: int


def split_rows(tokens: int, seq_len: int, valid_fraction: float, valid_tokens: int | None = None) -> Split:
    """How many whole rows the stream holds, and how many of the last are held out; with a separate validation stream
    of `valid_tokens` (data.valid_path), all of the first trains and all of the second validates."""
    if valid_tokens is not None:
        return Split(tokens // seq_len, valid_tokens // seq_len)
    rows = tokens // seq_len
    # exact decimal arithmetic: in floats 100 rows × 0.07 is 7.000000000000001, and ceil would hold out 8
    valid = math.ceil(rows * Fraction(repr(valid_fraction))) if valid_fraction > 0 else 0
    return Split(rows - valid, valid)


def global_batch_indices(step: int, global_batch: int, per_epoch: int | None) -> range:
    """Row indices of optimizer step `step`. An uneven last batch of an epoch is dropped, never padded:
    every rank must run the same number of collectives. The data check refuses a corpus of fewer rows than a batch."""
    if per_epoch is None:
        return range(step * global_batch, (step + 1) * global_batch)
    steps_per_epoch = per_epoch // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"the corpus has {per_epoch} rows, fewer than one global batch of {global_batch}")
    epoch, k = divmod(step, steps_per_epoch)
    start = epoch * per_epoch + k * global_batch
    return range(start, start + global_batch)


def micro_batch(source, step: int, *, global_batch: int, micro: int, dp: int, dp_rank: int, micro_step: int) -> np.ndarray:
    """Rows of the step's global batch that (dp_rank, micro_step) trains on: shape (micro, seq_len)."""
    idx = global_batch_indices(step, global_batch, source.rows_per_epoch())
    lo = (micro_step * dp + dp_rank) * micro
    return np.stack([source.row(i) for i in idx[lo:lo + micro]])
