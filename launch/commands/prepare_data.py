"""`python -m launch prepare-data IN... out=PREFIX [data.tokenizer=...]`: tokenize a corpus once into Megatron's indexed
format (PREFIX.bin + PREFIX.idx), for `data.source=megatron data.path=PREFIX`.

This side checks the arguments and never replaces a file; the tokenizing and Megatron-Core's IndexedDatasetBuilder run
as a process (`python -m launch.ranks.indexed build`), like every program that imports Megatron.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from launch.commands.args import Option, choice, read, text
from launch.data.corpus import PREPARED, SUFFIXES, CorpusError, corpus_files
from launch.data.tokenizer import load_tokenizer
from launch.errors import ConfigError

USAGE = "usage: python -m launch prepare-data FILE|FOLDER|GLOB... out=PREFIX [data.tokenizer=byte|model|DIR]"
OPTIONS = (Option("out", "the prefix to write: PREFIX.bin and PREFIX.idx (never replaced)", text),
           Option("data.tokenizer", "byte, model (model.weights' tokenizer) or a Hugging Face tokenizer folder", text,
                  "byte"),
           Option("data.text_field", "the JSONL field or Parquet column that holds each document", text, "text"),
           Option("data.source", "text (.txt, .jsonl) or parquet (default: from the files' suffixes)",
                  choice("text", "parquet")),
           Option("model.weights", "the model folder whose tokenizer data.tokenizer=model uses", text))


def cmd_prepare_data(args: Sequence[str]) -> int:
    a = read(args, command="prepare-data", usage=USAGE, options=OPTIONS, positional=(1, 10_000))
    o = a.options
    if o["out"] is None:
        raise ConfigError("command line", "out", None, "is missing", USAGE)
    source = o["data.source"] or ("parquet" if all(p.endswith(SUFFIXES["parquet"]) for p in a.positional) else "text")
    files: list[Path] = []
    try:
        for given in a.positional:
            files += corpus_files(given, source)
    except CorpusError as e:
        raise ConfigError(e.file, "argument", e.file, e.problem, e.fix) from None
    for f in files:
        if not f.is_file():
            raise ConfigError("command line", "argument", str(f), "does not exist", "give the corpus files to tokenize")
    tok = o["data.tokenizer"]
    load_tokenizer(tok if tok in ("byte", "model") else str(Path(tok).resolve()), o["model.weights"], "command line")
    if o["out"].endswith(("/", os.sep)) or Path(o["out"]).is_dir():
        raise ConfigError("command line", "out", o["out"], "names a folder, not a prefix",
                          f"give a name inside it: out={Path(o['out']) / 'corpus'} writes corpus.bin and corpus.idx there")
    prefix = str(Path(o["out"]).resolve())
    for suffix in (".bin", ".idx", PREPARED):
        if Path(prefix + suffix).exists():
            raise ConfigError("command line", "out", o["out"], f"would replace {prefix + suffix}",
                              "name a new prefix (prepare-data never overwrites one)")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    spec = {"out": prefix, "files": [str(f) for f in files], "source": source, "text_field": o["data.text_field"],
            "tokenizer": tok if tok in ("byte", "model") else str(Path(tok).resolve()),
            "model_weights": str(Path(o["model.weights"]).resolve()) if o["model.weights"] else None}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        return subprocess.run([sys.executable, "-m", "launch.ranks.indexed", "build", f.name], check=False,
                              env=os.environ).returncode
    finally:
        os.unlink(f.name)
