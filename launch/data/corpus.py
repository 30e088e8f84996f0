"""Documents from a user's corpus files: .txt (one document per file), .jsonl (one object per line, its
`data.text_field` the document) and .parquet (that column, one document per row).

Damage policy: a file that is missing, empty, unreadable, not UTF-8 where text is expected, or a Parquet file without
the column is refused (CorpusError). A damaged record (a JSONL line that is not an object, whose field is missing or
not a string, or is not UTF-8; a Parquet null) is skipped and counted; a file that loses more than MAX_DAMAGED of its
records, or all of them, is refused: that is a wrong field or a wrong file, not a few bad lines in a large corpus.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from launch import inputs

SUFFIXES = {"text": (".txt", ".jsonl"), "parquet": (".parquet",)}
PREPARED = ".prepared.json"  # PREFIX.prepared.json: the tokenizer and counts `prepare-data` wrote a prefix with
MAX_DAMAGED = 0.01
_GLOB = set("*?[")


class CorpusError(ValueError):
    """A file the user must fix: `where` is the line or row ("" for the whole file)."""

    def __init__(self, file: str | Path, where: str, problem: str, fix: str) -> None:
        self.file, self.where, self.problem, self.fix = str(file), where, problem, fix
        super().__init__(f"{self.file}{', ' + where if where else ''}: {problem}; {fix}")


@dataclass(frozen=True)
class Damaged:
    file: str
    where: str  # "line 7" / "row 7"
    why: str


@dataclass
class Documents:
    """The documents of a corpus in file order, and the records skipped on the way."""

    texts: list[str] = field(default_factory=list)
    damaged: list[Damaged] = field(default_factory=list)
    files: int = 0

    def warning(self) -> str | None:
        if not self.damaged:
            return None
        first = self.damaged[0]
        return (f"{len(self.damaged)} damaged record(s) skipped of {len(self.texts) + len(self.damaged)} "
                f"(first: {first.file} {first.where}: {first.why})")


def corpus_files(path: str, source: str) -> list[Path]:
    """The files `path` names for `source`: the file itself, a folder's files of the source's kind (recursively), or
    a glob's matches, in sorted order (the order of the documents)."""
    suffixes = SUFFIXES[source]
    if is_glob(path):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
        files = [p for p in files if p.suffix in suffixes]
        what = "matches no"
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.suffix in suffixes and p.is_file())
        what = "holds no"
    else:
        return [Path(path)]
    if not files:
        raise CorpusError(path, "", f"{what} {' or '.join(suffixes)} files",
                          f"give a file, folder or glob of {' or '.join(suffixes)} files (data.source={source})")
    return files


def is_glob(path: str) -> bool:
    """A pattern to expand: glob characters in a path that names nothing as it is (data[1].jsonl is a file)."""
    return bool(_GLOB & set(path)) and not os.path.lexists(path)


def read_documents(files: list[Path], source: str, text_field: str) -> Documents:
    docs = Documents(files=len(files))
    for f in files:
        before_ok, before_bad = len(docs.texts), len(docs.damaged)
        records = _parquet(f, text_field) if source == "parquet" else _text(f, text_field)
        for where, text, why in records:
            if why is None:
                docs.texts.append(text)
            else:
                docs.damaged.append(Damaged(str(f), where, why))
        ok, bad = len(docs.texts) - before_ok, len(docs.damaged) - before_bad
        if bad and (ok == 0 or bad > MAX_DAMAGED * (ok + bad)):
            first = docs.damaged[before_bad]
            raise CorpusError(f, first.where, f"{first.why} ({bad} of {ok + bad} records damaged)",
                              _fix(f, source, text_field))
        if ok == 0:
            raise CorpusError(f, "", "holds no document", "remove the empty file or give the file you meant")
    return docs


def _fix(f: Path, source: str, text_field: str) -> str:
    if source == "parquet":
        return f"give Parquet files whose column data.text_field=\"{text_field}\" holds the text"
    if f.suffix == ".jsonl":
        return f"write one JSON object per line with the text in its \"{text_field}\" field (data.text_field)"
    return "save the file as UTF-8 text"


def _check_file(f: Path) -> None:
    problem = inputs.not_a_file(f)
    if problem:
        raise CorpusError(f, "", problem, "give a file, a folder of them or a glob")
    if f.stat().st_size == 0:
        raise CorpusError(f, "", "is empty", "remove it or give the file you meant")


def _text(f: Path, text_field: str) -> Iterator[tuple[str, str, str | None]]:
    _check_file(f)
    try:
        with open(f, "rb") as stream:
            if f.suffix == ".jsonl":
                yield from _jsonl(stream, text_field)  # line by line: the file's bytes are never held whole
                return
            data = stream.read()
    except OSError as e:
        raise CorpusError(f, "", f"cannot be read ({e.strerror})", "make it readable") from None
    if not data.strip():
        raise CorpusError(f, "", "is empty", "remove it or give the file you meant")
    try:
        yield "", data.decode("utf-8-sig"), None  # a byte-order mark is not text
    except UnicodeDecodeError as e:
        raise CorpusError(f, f"byte {e.start}", "is not UTF-8", _fix(f, "text", text_field)) from None


def _jsonl(stream, text_field: str) -> Iterator[tuple[str, str, str | None]]:
    for n, raw in enumerate(stream, 1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            rec = json.loads(raw.decode("utf-8-sig" if n == 1 else "utf-8"))  # a byte-order mark opens some files
        except UnicodeDecodeError:
            yield where, "", "is not UTF-8"
            continue
        except (ValueError, RecursionError):  # JSONDecodeError, an integer past Python's 4,300 digits, deep nesting
            yield where, "", "is not JSON"
            continue
        if not isinstance(rec, dict):
            yield where, "", f"is a JSON {type(rec).__name__}, not an object"
        elif text_field not in rec:
            yield where, "", f"has no \"{text_field}\" field"
        elif not isinstance(rec[text_field], str):
            yield where, "", f"has a \"{text_field}\" of type {type(rec[text_field]).__name__}, not a string"
        elif not _encodable(rec[text_field]):
            yield where, "", f"has a \"{text_field}\" with an unpaired surrogate escape (not UTF-8 text)"
        else:
            yield where, rec[text_field], None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _parquet(f: Path, column: str) -> Iterator[tuple[str, str, str | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_file(f)
    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f, "", f"is not a readable Parquet file ({str(e).splitlines()[0]})",
                          "give the file you meant, or rewrite it") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise CorpusError(f, "", f"has no column \"{column}\" (columns: {', '.join(names[:8])})",
                          "set data.text_field to the column that holds the text")
    kind = pf.schema_arrow.field(column).type
    if pa.types.is_dictionary(kind):  # pandas categoricals: the values are what counts
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f, "", f"column \"{column}\" holds {kind}, not text",
                          "set data.text_field to the column that holds the text")
    n = 0
    try:
        for batch in pf.iter_batches(columns=[column], batch_size=8192):
            for value in batch.column(0).to_pylist():
                n += 1
                if value is None:
                    yield f"row {n}", "", "is null"
                elif not _encodable(value):
                    yield f"row {n}", "", "holds an unpaired surrogate (not UTF-8 text)"
                else:
                    yield f"row {n}", value, None
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f, f"row {n + 1}", f"cannot be read ({str(e).splitlines()[0]})",
                          "rewrite the file (it is damaged)") from None


def megatron_prefixes(path: str) -> list[str]:
    """The indexed datasets `path` names: a prefix (PREFIX.bin + PREFIX.idx; a path ending in .bin or .idx names its
    prefix), a folder's or a glob's .idx files, in sorted order."""
    if path.endswith((".bin", ".idx")):
        path = path[:-4]
    if os.path.lexists(path + ".idx") or os.path.lexists(path + ".bin"):
        return [path]
    if is_glob(path) or Path(path).is_dir():
        pattern = path if is_glob(path) else str(Path(path) / "*.idx")
        found = sorted(str(Path(p).with_suffix("")) for p in glob.glob(pattern, recursive=True) if p.endswith(".idx"))
        if not found:
            raise CorpusError(path, "", "holds no .idx files (Megatron indexed datasets)",
                              "give a prefix written by `python -m launch prepare-data` or Megatron's preprocess_data.py")
        return found
    return [path]
