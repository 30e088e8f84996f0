"""Deterministic data: every layout with the same global batch sees the same samples."""
import numpy as np
import pytest

from launch.ranks.data import (
    ByteText,
    DataError,
    Synthetic,
    global_batch_indices,
    micro_batch,
)
from tests.conftest import REPO

CORPUS = REPO / "tests" / "fixtures" / "text" / "corpus.jsonl"


def test_layouts_partition_the_same_global_batch():
    src = Synthetic(512, 16, 7)
    one = micro_batch(src, 3, global_batch=8, micro=8, dp=1, dp_rank=0, micro_step=0)
    parts = [micro_batch(src, 3, global_batch=8, micro=2, dp=2, dp_rank=d, micro_step=k)
             for k in range(2) for d in range(2)]
    assert np.array_equal(np.concatenate(parts), one)


def test_synthetic_is_a_learnable_bigram_walk():
    src = Synthetic(512, 32, 1)
    succ = src.successor()
    s = src.sample(11)
    assert all(s[i + 1] == succ[s[i]] for i in range(31))
    assert not np.array_equal(src.sample(11), src.sample(12)) and np.array_equal(src.sample(11), s)


def test_byte_text_windows_epochs_and_uneven_last_batch():
    src = ByteText.from_path(CORPUS, 64, 5, vocab=512)
    n = src.samples_per_epoch()
    assert n > 100 and len(src.tokens) // 64 == n
    text = CORPUS.read_text()
    assert bytes(src.tokens[:40].astype(np.uint8)).decode() in text  # real bytes, in order
    per_step = 16
    steps_per_epoch = n // per_step
    last = global_batch_indices(steps_per_epoch - 1, per_step, n)
    first_next = global_batch_indices(steps_per_epoch, per_step, n)
    assert last.stop <= n and first_next.start == n  # the uneven tail of the epoch is dropped
    # every epoch is a permutation of the windows, reshuffled per epoch
    e0 = [tuple(src.sample(i)) for i in range(n)]
    e1 = [tuple(src.sample(n + i)) for i in range(n)]
    assert sorted(e0) == sorted(e1) and e0 != e1


def test_byte_text_errors(tmp_path):
    with pytest.raises(DataError, match="at least 257"):
        ByteText.from_path(CORPUS, 64, 0, vocab=256)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object"):
        ByteText.from_path(bad, 4, 0, vocab=512)
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        ByteText.from_path(_mkdir(tmp_path), 4, 0, vocab=512)


def _mkdir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d
