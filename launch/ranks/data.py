"""Deterministic training data indexed by (step, data-parallel rank, micro-step).

Every rank derives its micro-batch from the global batch of the step, so any layout with the same
global batch sees the same samples: ranks of one TP group read the same rows (they share a
data-parallel rank), and a 1-rank run reads them all. Torch is imported lazily (trainers only).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS_BYTE = 256  # byte-level tokenizer: ids 0-255 are bytes, 256 separates documents


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Synthetic:
    """Walks through a fixed random successor table (one permutation of the vocabulary per seed) from a
    random start per sample: a bigram rule a tiny model learns within tens of steps, so loss falls."""

    vocab: int
    seq_len: int
    seed: int

    def successor(self) -> np.ndarray:
        return np.random.default_rng((self.seed, 0x5EED)).permutation(self.vocab)

    def sample(self, index: int) -> np.ndarray:
        succ = self.successor()
        out = np.empty(self.seq_len, dtype=np.int64)
        out[0] = np.random.default_rng((self.seed, index)).integers(0, self.vocab)
        for i in range(1, self.seq_len):
            out[i] = succ[out[i - 1]]
        return out

    def samples_per_epoch(self) -> int | None:
        return None


@dataclass(frozen=True)
class ByteText:
    """Local .txt / .jsonl ({"text": ...}) files as bytes, cut into windows of seq_len tokens."""

    tokens: np.ndarray
    seq_len: int
    seed: int

    @classmethod
    def from_path(cls, path: Path, seq_len: int, seed: int, vocab: int) -> "ByteText":
        if vocab <= EOS_BYTE:
            raise DataError(f"data.tokenizer=byte needs a vocabulary of at least {EOS_BYTE + 1} ids (model has {vocab})")
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path]
        if not files:
            raise DataError(f"data.path={str(path)!r} holds no .txt or .jsonl files")
        chunks: list[bytes] = []
        for f in files:
            if f.suffix == ".jsonl":
                for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                    if line.strip():
                        try:
                            chunks.append(json.loads(line)["text"].encode("utf-8"))
                        except (json.JSONDecodeError, KeyError, TypeError):
                            raise DataError(f"{f}:{n}: expected a JSON object with a \"text\" field") from None
            else:
                chunks.append(f.read_bytes())
        ids: list[np.ndarray] = []
        for c in chunks:
            ids.append(np.frombuffer(c, dtype=np.uint8).astype(np.int64))
            ids.append(np.array([EOS_BYTE], dtype=np.int64))
        tokens = np.concatenate(ids)
        if len(tokens) < seq_len:
            raise DataError(f"data.path={str(path)!r} has {len(tokens)} tokens, fewer than one sequence of {seq_len}")
        return cls(tokens, seq_len, seed)

    def samples_per_epoch(self) -> int:
        return len(self.tokens) // self.seq_len

    def sample(self, index: int) -> np.ndarray:
        n = self.samples_per_epoch()
        epoch, i = divmod(index, n)
        order = np.random.default_rng((self.seed, epoch)).permutation(n)  # reshuffle every epoch
        j = int(order[i])
        return self.tokens[j * self.seq_len:(j + 1) * self.seq_len]


def global_batch_indices(step: int, global_batch: int, per_epoch: int | None) -> range:
    """Sample indices of optimizer step `step`. An uneven last batch of an epoch is dropped, never padded:
    every rank must run the same number of collectives."""
    if per_epoch is None:
        return range(step * global_batch, (step + 1) * global_batch)
    steps_per_epoch = per_epoch // global_batch
    if steps_per_epoch == 0:
        raise DataError(f"the corpus has {per_epoch} sequences, fewer than one global batch of {global_batch}")
    epoch, k = divmod(step, steps_per_epoch)
    start = epoch * per_epoch + k * global_batch
    return range(start, start + global_batch)


def micro_batch(source, step: int, *, global_batch: int, micro: int, dp: int, dp_rank: int, micro_step: int) -> np.ndarray:
    """Rows of the step's global batch that (dp_rank, micro_step) trains on: shape (micro, seq_len)."""
    idx = global_batch_indices(step, global_batch, source.samples_per_epoch())
    lo = (micro_step * dp + dp_rank) * micro
    return np.stack([source.sample(i) for i in idx[lo:lo + micro]])
