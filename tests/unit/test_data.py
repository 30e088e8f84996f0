"""Training data: tokenizers, the three corpus sources, packing, each row's place, and the check before launch.

Oracles: the `tokenizers` library's own encode of each document (plus the end-of-document id), the corpus's own bytes,
Megatron-Core's IndexedDataset reading a prepared prefix, and the rows a 1-rank layout reads."""
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from launch.commands.cli import main
from launch.config.resolve import resolve_path
from launch.data.check import check, corpus_ids
from launch.data.corpus import MAX_DAMAGED, CorpusError, corpus_files, read_documents
from launch.data.rows import ArrayStream, Synthetic, TokenRows, global_batch_indices, micro_batch, split_rows
from launch.data.tokenizer import BYTE, EOS_BYTE, load_tokenizer
from launch.errors import ConfigError
from tests.conftest import REPO

CORPUS = REPO / "tests" / "fixtures" / "text" / "corpus.jsonl"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer"
TINY = "recipes/tiny_zero2"


def texts() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]


def oracle_ids() -> np.ndarray:
    """The corpus as the tokenizers library encodes it, each document followed by <|endoftext|>."""
    tok = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    return np.concatenate([np.array(tok.encode(t).ids + [eos]) for t in texts()])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The corpus through `python -m launch prepare-data` (Megatron's builder), once for the module."""
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(CORPUS), f"out={out}",
                        f"data.tokenizer={TOKENIZER}"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return out, p


# --------------------------------------------------------------------------- rows


def test_layouts_partition_the_same_global_batch():
    src = Synthetic(512, 16, 7)
    one = micro_batch(src, 3, global_batch=8, micro=8, dp=1, dp_rank=0, micro_step=0)
    for dp in (2, 4):
        micro = 8 // dp // 2
        parts = [micro_batch(src, 3, global_batch=8, micro=micro, dp=dp, dp_rank=d, micro_step=k)
                 for k in range(2) for d in range(dp)]
        assert np.array_equal(np.concatenate(parts), one)


def test_text_rows_are_the_same_for_dp_1_2_4_at_every_step():
    ids = corpus_ids("text", str(CORPUS), "text", load_tokenizer(str(TOKENIZER), None, "test")).ids
    rows = TokenRows(ArrayStream(ids), 32, 5, 0, len(ids) // 32)
    for step in (0, 1, 7, 30):  # 30: past the first epoch
        one = micro_batch(rows, step, global_batch=8, micro=8, dp=1, dp_rank=0, micro_step=0)
        for dp, micro in ((2, 2), (4, 1)):
            parts = [micro_batch(rows, step, global_batch=8, micro=micro, dp=dp, dp_rank=d, micro_step=k)
                     for k in range(8 // dp // micro) for d in range(dp)]
            assert np.array_equal(np.concatenate(parts), one)


def test_synthetic_is_a_learnable_bigram_walk():
    src = Synthetic(512, 32, 1)
    succ = src.successor()
    s = src.row(11)
    assert all(s[i + 1] == succ[s[i]] for i in range(31))
    assert not np.array_equal(src.row(11), src.row(12)) and np.array_equal(src.row(11), s)


def test_byte_rows_are_the_corpus_bytes_reshuffled_each_epoch():
    c = corpus_ids("text", str(CORPUS), "text", BYTE)
    ids, files, documents, damaged = c.ids, c.files, c.documents, c.damaged
    assert (files, documents, damaged) == (1, len(texts()), None)
    # the oracle: every document's UTF-8 bytes, each followed by the separator
    want = b"".join(t.encode() + b"\x00" for t in texts())
    assert len(ids) == len(want) and (ids == EOS_BYTE).sum() == len(texts())
    assert bytes(np.where(ids == EOS_BYTE, 0, ids).astype(np.uint8)) == want
    n = len(ids) // 64
    rows = TokenRows(ArrayStream(ids), 64, 5, 0, n)
    last, next_epoch = global_batch_indices(n // 16 - 1, 16, n), global_batch_indices(n // 16, 16, n)
    assert last.stop <= n and next_epoch.start == n  # the uneven tail of the epoch is dropped
    e0 = [tuple(rows.row(i)) for i in range(n)]
    e1 = [tuple(rows.row(n + i)) for i in range(n)]
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert sorted(e0) == sorted(tuple(ids[j * 64:(j + 1) * 64]) for j in range(n))


def test_validation_rows_are_the_last_and_never_trained_on():
    ids = np.arange(1000)
    s = split_rows(len(ids), 10, 0.15)
    assert (s.train_rows, s.valid_rows) == (85, 15)  # 100 rows: ceil(15.0) held out
    train = TokenRows(ArrayStream(ids), 10, 0, 0, s.train_rows)
    valid = TokenRows(ArrayStream(ids), 10, 0, s.train_rows, s.valid_rows, shuffle=False)
    seen = {int(train.row(i)[0]) for i in range(3 * s.train_rows)}
    assert seen == set(range(0, 850, 10))
    assert [int(valid.row(i)[0]) for i in range(15)] == list(range(850, 1000, 10))


# --------------------------------------------------------------------------- the three sources


def test_public_domain_text_reads_the_same_through_text_and_parquet(tmp_path):
    """The KJV Genesis fixture: its own chapters, as the tokenizers library encodes them, through both readers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    genesis = REPO / "tests" / "fixtures" / "text" / "genesis.jsonl"
    chapters = [json.loads(line)["text"] for line in genesis.read_text().splitlines()]
    assert len(chapters) == 8 and chapters[0].startswith("In the beginning God created the heaven and the earth.")
    tok = load_tokenizer(str(TOKENIZER), None, "test")
    hf = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    want = np.concatenate([np.array(hf.encode(c).ids + [0]) for c in chapters])
    pq.write_table(pa.table({"text": chapters}), tmp_path / "genesis.parquet")
    for source, path in (("text", genesis), ("parquet", tmp_path / "genesis.parquet")):
        assert np.array_equal(corpus_ids(source, str(path), "text", tok).ids, want), source


def test_text_parquet_and_megatron_give_identical_rows(tmp_path, prepared):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launch.torchtools.indexed import IndexedStream

    tok = load_tokenizer(str(TOKENIZER), None, "test")
    pq.write_table(pa.table({"body": texts()}), tmp_path / "corpus.parquet", row_group_size=7)
    text_ids = corpus_ids("text", str(CORPUS), "text", tok).ids
    parquet_ids = corpus_ids("parquet", str(tmp_path / "corpus.parquet"), "body", tok).ids
    indexed = IndexedStream.open([str(prepared[0])])
    want = oracle_ids()
    assert np.array_equal(text_ids, want) and np.array_equal(parquet_ids, want)
    assert len(indexed) == len(want) and np.array_equal(indexed.window(0, len(want)), want)
    streams = [ArrayStream(text_ids), ArrayStream(parquet_ids), indexed]
    for seq in (17, 64):  # windows that cross document and sequence boundaries
        n = len(want) // seq
        for s in streams[1:]:
            for i in range(n):
                a = TokenRows(streams[0], seq, 3, 0, n).row(i)
                assert np.array_equal(TokenRows(s, seq, 3, 0, n).row(i), a)


def test_prepare_data_writes_megatrons_format_and_never_overwrites(prepared, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out, p = prepared
    ds = IndexedDataset(str(out))
    docs = texts()
    assert len(ds) == len(docs) and len(ds.document_indices) == len(docs) + 1
    tok = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    assert ds[3].tolist() == tok.encode(docs[3]).ids + [0]
    summary = p.stdout.splitlines()[0]
    assert f"{len(docs)} documents" in summary and f"{len(oracle_ids()):,} tokens" in summary and "tokens/s" in summary
    before = {f: f.stat().st_mtime_ns for f in out.parent.iterdir()}
    theirs = tmp_path / "notes.idx"  # someone's file that a new prefix would land on
    theirs.write_text("mine")
    for prefix in (out, theirs.with_suffix(""), tmp_path, f"{tmp_path}/new/", "."):
        again = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(CORPUS), f"out={prefix}"], cwd=REPO,
                               capture_output=True, text=True)
        assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
        assert any(why in again.stderr for why in ("would replace", "names a folder, not a prefix",
                                                   "names no file or folder of its own"))
    assert {f: f.stat().st_mtime_ns for f in out.parent.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.idx"] and theirs.read_text() == "mine"


def test_a_folder_or_glob_of_shards_reads_in_sorted_order(tmp_path):
    for name, body in (("b.txt", "second"), ("a.txt", "first"), ("sub/c.jsonl", '{"text": "third"}\n'),
                       ("skip.md", "not a shard")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(body)
    got = read_documents(corpus_files(str(tmp_path), "text"), "text", "text").texts
    assert got == ["first", "second", "third"]
    assert read_documents(corpus_files(str(tmp_path / "*.txt"), "text"), "text", "text").texts == ["first", "second"]


# --------------------------------------------------------------------------- tokenizers


def test_model_tokenizer_is_model_weights_tokenizer(tmp_path):
    for f in TOKENIZER.glob("tokenizer*.json"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tok = load_tokenizer("model", str(tmp_path), "r.toml")
    assert (tok.vocab_size, tok.eos_id) == (384, 0)
    with pytest.raises(ConfigError, match="needs model.weights"):
        load_tokenizer("model", None, "r.toml")


# --------------------------------------------------------------------------- the check before launch


def _dry(capsys, *overrides: str) -> tuple[int, str, str]:
    rc = main(["run", TINY, *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(capsys, *overrides: str) -> str:
    rc, _, err = _dry(capsys, *overrides)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    return lines[0]


def test_bad_text_files_are_one_line_before_launch(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 5}\n')
    array = tmp_path / "array.jsonl"
    array.write_text('["text"]\n{"text": "fine"}\n')
    cases = {empty: "is empty", latin: "byte 3 is not UTF-8", numbers: 'line 1 has a "text" of type int, not a string',
             array: "line 1 is a JSON list, not an object"}
    for path, problem in cases.items():
        line = _refused(capsys, "data.source=text", f"data.path={path}")
        assert line.startswith(f'error: {path}: data.path="{path}" {problem}'), line
    line = _refused(capsys, "data.source=text", f"data.path={tmp_path / 'gone.txt'}")
    assert "gone.txt" in line and "does not exist" in line


def test_a_parquet_without_the_column_is_one_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a b c"] * 3}), tmp_path / "x.parquet")
    line = _refused(capsys, "data.source=parquet", f"data.path={tmp_path / 'x.parquet'}")
    assert 'has no column "text"' in line and "data.text_field" in line
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "x.parquet").read_bytes()[:40])
    line = _refused(capsys, "data.source=parquet", f"data.path={tmp_path / 'cut.parquet'}")
    assert "is not a readable Parquet file" in line


def test_a_truncated_bin_is_one_line(prepared, tmp_path, capsys):
    out = tmp_path / "cut"
    (tmp_path / "cut.idx").write_bytes(prepared[0].with_suffix(".idx").read_bytes())
    whole = prepared[0].with_suffix(".bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(whole[: len(whole) - 10])
    line = _refused(capsys, "data.source=megatron", f"data.path={out}", f"data.tokenizer={TOKENIZER}")
    assert "cut.bin is truncated" in line and f"{len(whole) - 10:,} bytes" in line


def test_a_damaged_record_in_a_large_corpus_is_skipped_and_named(tmp_path, capsys):
    good = [json.dumps({"text": f"document {i} " * 3}) for i in range(400)]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(good[:200] + ['{"text": null}'] + good[200:]) + "\n")
    rc, out, err = _dry(capsys, "data.source=text", f"data.path={big}")
    assert rc == 0, err
    assert f"1 damaged record(s) skipped of 401 (first: {big} line 201" in out
    docs = read_documents([big], "text", "text")
    assert docs.texts == [json.loads(g)["text"] for g in good]  # the damaged one alone is left out
    # one damaged record in three is a wrong file, not noise
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(good[:2] + ['{"text": null}']) + "\n")
    assert 1 / 3 > MAX_DAMAGED
    with pytest.raises(CorpusError, match=r"line 3: has a \"text\" of type NoneType.*1 of 3 records damaged"):
        read_documents([small], "text", "text")


def test_tokenizer_and_validation_refusals(tmp_path, capsys):
    text = ("data.source=text", f"data.path={CORPUS}")
    line = _refused(capsys, *text, f"data.tokenizer={tmp_path}")
    assert "holds no tokenizer.json" in line
    line = _refused(capsys, *text, "model.name=tiny-llama", "data.tokenizer=model")
    assert "needs model.weights" in line
    line = _refused(capsys, *text, "train.eval_every=5")
    assert "needs held-out rows" in line and "data.valid_fraction" in line
    line = _refused(capsys, *text, "data.valid_fraction=0.01", "train.eval_every=5")
    assert "validation rows, fewer than one global batch of 8" in line
    line = _refused(capsys, *text, "data.valid_fraction=nan")
    assert "data.valid_fraction" in line
    line = _refused(capsys, "train.eval_every=5")
    assert 'needs a corpus (data.source="synthetic")' in line


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text((TOKENIZER / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text((TOKENIZER / "tokenizer_config.json").read_text())
    r = resolve_path(TINY, ["data.source=text", f"data.path={CORPUS}", f"data.tokenizer={tmp_path}",
                            "model.name=tiny-llama"])
    object.__setattr__(r.model, "vocab_size", 300)  # a model whose embedding is smaller than the tokenizer's 384 ids
    with pytest.raises(ConfigError, match="has 384 ids, more than the model's embedding of 300"):
        check(r)


def test_the_check_counts_rows_and_steps(capsys):
    rc, out, err = _dry(capsys, "data.source=text", f"data.path={CORPUS}", f"data.tokenizer={TOKENIZER}",
                        "data.valid_fraction=0.15", "train.eval_every=10")
    assert rc == 0, err
    n = len(oracle_ids()) // 64
    valid = -(-n * 15 // 100)
    assert f"{len(oracle_ids()):,} tokens" in out
    assert f"data: {n - valid:,} training rows of 64 tokens ({(n - valid) // 8:,} steps an epoch), {valid:,} " \
           "validation rows" in out


def test_a_prefix_beyond_the_embedding_or_of_another_tokenizer_is_refused(prepared, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "wide.bin"), dtype=np.uint16)  # Megatron's own writer, no sidecar
    builder.add_document(np.array([5, 600, 0] * 400), [1200])
    builder.finalize(str(tmp_path / "wide.idx"))
    line = _refused(capsys, "data.source=megatron", f"data.path={tmp_path / 'wide'}")
    assert "holds id 600, beyond the model's embedding of 512 ids" in line
    line = _refused(capsys, "data.source=megatron", f"data.path={prepared[0]}")  # data.tokenizer left at byte
    assert f"is not the tokenizer the prefix was prepared with ({TOKENIZER}, 384 ids)" in line


def test_calibrate_and_export_accelerate_check_the_data_first(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 5}\n')
    runs = tmp_path / "runs"
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(runs))
    for command in (["calibrate", TINY], ["export-accelerate", TINY]):
        assert main([*command, "data.source=text", f"data.path={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "line 2 has a \"text\" of type int" in err[0], err
    assert not runs.exists()  # refused before any run folder was made


def test_a_fraction_holds_out_its_exact_share():
    # 100 rows × 0.07 is 7.000000000000001 in floats: ceil would hold out 8
    assert [split_rows(1000, 10, f).valid_rows for f in (0.07, 0.15, 0.5, 0.001)] == [7, 15, 50, 1]


def test_records_python_or_utf8_cannot_take_are_damaged_not_tracebacks(tmp_path):
    f = tmp_path / "odd.jsonl"
    lines = [json.dumps({"text": f"fine {i}"}) for i in range(300)]
    lines[10] = '{"text": ' + "9" * 5000 + "}"  # past Python's 4,300-digit integer limit
    lines[20] = '{"text": "\\ud800 lone"}'  # an unpaired surrogate escape: valid JSON, not UTF-8 text
    f.write_text("\ufeff" + "\n".join(lines) + "\n")  # and a byte-order mark before line 1
    docs = read_documents([f], "text", "text")
    assert [(d.where, d.why) for d in docs.damaged] == [
        ("line 11", "is not JSON"), ("line 21", 'has a "text" with an unpaired surrogate escape (not UTF-8 text)')]
    assert docs.texts[0] == "fine 0" and len(docs.texts) == 298
    assert len(BYTE.encode(docs.texts)) == 298


def test_an_existing_name_with_glob_characters_is_a_file_not_a_pattern(tmp_path):
    f = tmp_path / "data[1].jsonl"
    f.write_text('{"text": "one"}\n')
    assert corpus_files(str(f), "text") == [f]


def test_a_dictionary_encoded_parquet_column_is_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(["a b", "c d", "a b"]).dictionary_encode()
    pq.write_table(pa.table({"text": column}), tmp_path / "cat.parquet")
    assert read_documents([tmp_path / "cat.parquet"], "parquet", "text").texts == ["a b", "c d", "a b"]


def test_damaged_indexes_are_one_line(prepared, tmp_path, capsys):
    idx, bin_ = prepared[0].with_suffix(".idx").read_bytes(), prepared[0].with_suffix(".bin").read_bytes()
    # Megatron's MMIDIDX layout, read here with struct: a 34-byte header (magic, version, dtype code, sequence and
    # document counts), then int32 lengths, int64 byte pointers, int64 document boundaries
    n, d = struct.unpack_from("<QQ", idx, 18)
    assert len(idx) == 34 + 12 * n + 8 * d and n >= 3 and d >= 3
    mid = n // 2

    def patched(offset: int, fmt: str, value: int) -> bytes:
        out = bytearray(idx)
        struct.pack_into(fmt, out, offset, value)
        return bytes(out)

    pointer = struct.unpack_from("<q", idx, 34 + 4 * n + 8 * mid)[0]
    cases = {"short_idx": (idx[:12], bin_, "is not a readable Megatron index"),
             "odd_bin": (idx, bin_ + b"\0", "not a whole number of 2-byte ids"),
             # a middle length or pointer that lies: the dry run read only the last sequence and passed both
             "negative_length": (patched(34 + 4 * mid, "<i", -5), bin_, f"gives sequence {mid:,} a length of -5"),
             "middle_pointer": (patched(34 + 4 * n + 8 * mid, "<q", pointer + 2), bin_,
                                f"points sequence {mid:,} at byte {pointer + 2:,}; the lengths before it end at byte "
                                f"{pointer:,}"),
             # (the last boundary past the sequences Megatron's reader asserts on itself; one that falls back, not)
             "documents": (patched(34 + 12 * n + 8, "<q", n), bin_, "do not run from 0 up to its")}
    for name, (i, b, problem) in cases.items():
        (tmp_path / f"{name}.idx").write_bytes(i)
        (tmp_path / f"{name}.bin").write_bytes(b)
        line = _refused(capsys, "data.source=megatron", f"data.path={tmp_path / name}", f"data.tokenizer={TOKENIZER}")
        assert problem in line and f"data.path=\"{tmp_path / name}\"" in line, line


def test_prepare_data_refuses_outs_that_name_no_new_prefix(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "gone.bin").symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = {str(tmp_path / "file" / "x"): "which is a file", str(tmp_path / "c.bin"): "ends in .bin",
             str(tmp_path / "gone"): "would replace"}
    for out, problem in cases.items():
        p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(CORPUS), f"out={out}"], cwd=REPO,
                           capture_output=True, text=True)
        assert p.returncode == 2 and problem in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(CORPUS), "out=~/c"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "home" / "c.bin").is_file() and not (tmp_path / "~").exists()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["file", "gone.bin", "home"]


def test_prepare_data_never_writes_inside_what_it_reads(tmp_path, capsys):
    """README: no command's output lies inside or is one of its inputs; prepare-data wrote a prefix inside the corpus
    folder it read (and the tokenizer folder is an input as much)."""
    from launch.commands.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(CORPUS.read_text())
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for f in TOKENIZER.iterdir():
        if f.is_file():
            (tokenizer / f.name).write_bytes(f.read_bytes())
    for given, out, says in ((corpus, corpus / "prep", f"lies inside an input of this command ({corpus})"),
                             (corpus / "a.jsonl", corpus / "a.jsonl", f"is an input of this command ({corpus / 'a.jsonl'})"),
                             (corpus, tokenizer / "p", f"lies inside an input of this command ({tokenizer})")):
        assert main(["prepare-data", str(given), f"out={out}", f"data.tokenizer={tokenizer}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert sorted(p.name for p in corpus.iterdir()) == ["a.jsonl"]
    assert sorted(p.name for p in tokenizer.iterdir()) == sorted(p.name for p in TOKENIZER.iterdir() if p.is_file())


def test_the_corpus_digest_changes_with_its_text(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(CORPUS.read_text())
    r = resolve_path(TINY, ["data.source=text", f"data.path={f}"])
    before = check(r).fingerprint
    assert check(r).fingerprint == before
    f.write_text(CORPUS.read_text() + json.dumps({"text": "one more document"}) + "\n")
    assert check(r).fingerprint != before  # run.resume=auto then refuses the old checkpoints (training_identity)


def test_synthetic_data_refuses_corpus_settings(capsys):
    for setting in ("data.valid_fraction=0.1", f"data.tokenizer={TOKENIZER}"):
        line = _refused(capsys, setting)
        assert 'data.source="synthetic" reads no corpus' in line, line
