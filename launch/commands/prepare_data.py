"""`python -m launch prepare-data IN... out=PREFIX [data.tokenizer=...]`: tokenize a corpus once into Megatron's indexed
format (PREFIX.bin + PREFIX.idx), for `data.source=megatron data.path=PREFIX`.

This side checks the arguments and never replaces a file; the tokenizing and Megatron-Core's IndexedDatasetBuilder run
as a process (`python -m launch.torchtools.indexed build`), like every program that imports Megatron.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from launch import inputs
from launch.commands.args import Option, choice, read, text
from launch.config.schema import TOKENIZER_NAMES
from launch.data.check import INDEXED_MODULE
from launch.data.corpus import PREPARED, SUFFIXES, CorpusError, corpus_files
from launch.data.tokenizer import load_tokenizer
from launch.errors import ConfigError
from launch.outputs import input_problem, place_problem

USAGE = "usage: python -m launch prepare-data FILE|FOLDER|GLOB... out=PREFIX [data.tokenizer=byte|model|DIR]"
OPTIONS = (Option("out", "the prefix to write: PREFIX.bin and PREFIX.idx (never replaced)", text),
           Option("data.tokenizer", "byte, model (model.weights' tokenizer) or a Hugging Face tokenizer folder", text,
                  "byte"),
           Option("data.text_field", "the JSONL field or Parquet column that holds each document", text, "text"),
           Option("data.source", "text (.txt, .jsonl) or parquet (default: from the files' suffixes)",
                  choice("text", "parquet")),
           Option("model.weights", "the model folder whose tokenizer data.tokenizer=model uses", text))


def _source(given: Sequence[str]) -> str:
    """parquet when the inputs are .parquet files or folders holding only those, else text."""
    def parquet(p: str) -> bool:
        if Path(p).is_dir():
            found = {f.suffix for f in Path(p).rglob("*") if f.suffix in SUFFIXES["parquet"] + SUFFIXES["text"]}
            return found == set(SUFFIXES["parquet"])
        return p.endswith(SUFFIXES["parquet"])
    return "parquet" if all(parquet(p) for p in given) else "text"


def _prefix(out: str, inputs_read: list[Path]) -> str:
    """The absolute prefix `out=` names, or one line saying why it names none: it may neither lie inside nor be
    what the command reads (`inputs_read`: the files and folders given, the tokenizer's folder)."""
    fix = "give a new prefix such as out=data/corpus (writes data/corpus.bin and data/corpus.idx)"
    path = Path(out).expanduser()
    problem = place_problem(path) or input_problem(path, inputs_read)  # before resolving: a dangling link would
    # name its target, elsewhere
    if problem:
        raise ConfigError("command line", "out", out, problem, fix)
    if out.endswith(("/", os.sep)) or path.is_dir():
        raise ConfigError("command line", "out", out, "names a folder, not a prefix", fix)
    if path.suffix in (".bin", ".idx"):
        raise ConfigError("command line", "out", out, f"ends in {path.suffix}; the prefix is the name without it", fix)
    prefix = str(path.resolve())
    for suffix in (".bin", ".idx", PREPARED):
        if os.path.lexists(prefix + suffix):  # a dangling link too: never written through
            raise ConfigError("command line", "out", out, f"would replace {prefix + suffix}",
                              "name a new prefix (prepare-data never overwrites one)")
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("command line", "out", out, f"cannot be made ({e.strerror})", fix) from None
    if not os.access(Path(prefix).parent, os.W_OK):
        raise ConfigError("command line", "out", out, f"is in a folder this user cannot write ({Path(prefix).parent})",
                          fix)
    return prefix


def cmd_prepare_data(args: Sequence[str]) -> int:
    a = read(args, command="prepare-data", usage=USAGE, options=OPTIONS, positional=(1, 10_000))
    o = a.options
    if o["out"] is None:
        raise ConfigError("command line", "out", None, "is missing", USAGE)
    source = o["data.source"] or _source(a.positional)
    files: list[Path] = []
    try:
        for given in a.positional:
            files += [f for f in corpus_files(given, source) if f not in files]  # a file named twice is read once
    except CorpusError as e:
        raise ConfigError(e.file, "argument", e.file, e.problem, e.fix) from None
    for f in files:
        problem = inputs.not_a_file(f)
        if problem:
            raise ConfigError("command line", "argument", str(f), problem, "give the corpus files to tokenize")
    tok = o["data.tokenizer"]
    tok = tok if tok in TOKENIZER_NAMES else str(Path(tok).expanduser().resolve())
    load_tokenizer(tok, o["model.weights"], "command line")
    given = [Path(g).expanduser() for g in a.positional if Path(g).expanduser().exists()]  # globs: their files
    prefix = _prefix(o["out"], [*given, *files, *([Path(tok)] if tok not in TOKENIZER_NAMES else [])])
    spec = {"out": prefix, "files": [str(f) for f in files], "source": source, "text_field": o["data.text_field"],
            "tokenizer": tok, "model_weights": str(Path(o["model.weights"]).resolve()) if o["model.weights"] else None}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        return subprocess.run([sys.executable, "-m", INDEXED_MODULE, "build", f.name], check=False,
                              env=os.environ).returncode
    finally:
        os.unlink(f.name)
