"""The rank side of launch/data: a run's training and validation rows, from the token streams the CLI's data check
cached in the run's data/ folder, from Megatron indexed datasets, or (no cache: launch calibrate) tokenized here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launch.config.resolve import Resolved
from launch.data.check import CACHE, corpus_ids
from launch.data.corpus import megatron_prefixes
from launch.data.rows import ArrayStream, Synthetic, TokenRows, TokenStream, split_rows
from launch.data.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Sources:
    train: Synthetic | TokenRows
    valid: TokenRows | None  # None: no held-out rows


def sources(resolved: Resolved, cache: Path | None = None) -> Sources:
    r = resolved.recipe
    d, seq, seed = r.data, r.batch.seq_len, r.train.seed
    if d.source == "synthetic":
        return Sources(Synthetic(resolved.model.vocab_size, seq, seed), None)
    train = _stream(resolved, d.path, cache, "train")
    valid = _stream(resolved, d.valid_path, cache, "valid") if d.valid_path else None
    s = split_rows(len(train), seq, d.valid_fraction, len(valid) if valid is not None else None)
    # held-out rows: all of data.valid_path's, or the training stream's last
    held = TokenRows(valid, seq, seed, 0, s.valid_rows, shuffle=False) if valid is not None else \
        TokenRows(train, seq, seed, s.train_rows, s.valid_rows, shuffle=False)
    return Sources(TokenRows(train, seq, seed, 0, s.train_rows), held if s.valid_rows else None)


def _stream(resolved: Resolved, path: str, cache: Path | None, which: str) -> TokenStream:
    d = resolved.recipe.data
    if d.source == "megatron":
        from launch.torchtools.indexed import IndexedStream

        return IndexedStream.open(megatron_prefixes(path))
    cached = cache / CACHE[which] if cache is not None else None
    if cached is not None and cached.is_file():
        return ArrayStream(np.load(cached, mmap_mode="r"))
    tok = load_tokenizer(d.tokenizer, resolved.recipe.model.weights, resolved.recipe_path)
    return ArrayStream(corpus_ids(d.source, path, d.text_field, tok).ids)
