"""Tokenizers: "byte" (UTF-8 bytes, ids 0-255, 256 ends a document) or a local Hugging Face tokenizer folder
(its tokenizer.json, through the `tokenizers` library, offline; "model" is the folder of model.weights).

Each document becomes its ids followed by the end-of-document id, as Megatron's preprocess_data.py --append-eod
writes them; the tokenizer's own template applies first (a Llama tokenizer's leading <s>).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from launch import inputs
from launch.errors import ConfigError

EOS_BYTE = 256
TOKENIZER_FILE = "tokenizer.json"
ENCODE_BATCH = 1024  # documents per encode_batch call: bounded memory, and the library's threads stay busy


@dataclass(frozen=True)
class Tokenizer:
    name: str  # "byte" or the folder
    vocab_size: int  # ids are below this
    eos_id: int
    sha256: str  # of tokenizer.json ("byte" for bytes): two tokenizers of one size are told apart by it
    backend: Any = None  # a tokenizers.Tokenizer; None for bytes

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's ids, the end-of-document id last."""
        out = []
        if self.backend is None:
            for t in texts:
                out.append(np.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32), EOS_BYTE))
            return out
        for i in range(0, len(texts), ENCODE_BATCH):
            for enc in self.backend.encode_batch_fast(texts[i:i + ENCODE_BATCH], add_special_tokens=True):
                out.append(np.append(np.asarray(enc.ids, dtype=np.int32), self.eos_id))
        return out


BYTE = Tokenizer("byte", EOS_BYTE + 1, EOS_BYTE, "byte")


def tokenizer_folder(spec: str, model_weights: str | None, context: str) -> Path | None:
    """The folder `data.tokenizer` names (None for "byte")."""
    if spec == "byte":
        return None
    if spec == "model":
        if not model_weights:
            raise ConfigError(context, "data.tokenizer", spec, "needs model.weights (the folder with the tokenizer files)",
                              "set model.weights, or data.tokenizer to a tokenizer folder or \"byte\"")
        return Path(model_weights)
    return Path(spec)


def tokenizer_file(folder: Path) -> Path:
    """The tokenizer.json that data.tokenizer's folder (or the file it names) stands for."""
    return folder / TOKENIZER_FILE if folder.is_dir() else folder


def load_tokenizer(spec: str, model_weights: str | None, context: str) -> Tokenizer:
    """`data.tokenizer` loaded, or one ConfigError naming what is missing."""
    folder = tokenizer_folder(spec, model_weights, context)
    if folder is None:
        return BYTE
    fix = "give a local Hugging Face tokenizer folder holding tokenizer.json (or \"byte\")"
    path = tokenizer_file(folder)
    if not path.is_file():
        missing = "does not exist" if not folder.exists() else f"holds no {TOKENIZER_FILE}"
        if (folder / "tokenizer.model").is_file():
            fix = ("write its fast tokenizer once: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) "
                   "(transformers converts tokenizer.model)")
        raise ConfigError(context, "data.tokenizer", spec, f"{missing} ({folder})", fix)
    from tokenizers import Tokenizer as HFTokenizer

    text = inputs.read_text(path, context=context, field="data.tokenizer", fix=fix)
    try:
        backend = HFTokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a malformed file
        raise ConfigError(str(path), "data.tokenizer", spec, f"is not a tokenizers file ({str(e)[:120]})", fix) from None
    eos = _eos_id(path.parent, backend, context, spec)
    return Tokenizer(str(path.parent), backend.get_vocab_size(with_added_tokens=True), eos,
                     hashlib.sha256(text.encode("utf-8")).hexdigest(), backend)


def _eos_id(folder: Path, backend, context: str, spec: str) -> int:
    """tokenizer_config.json's eos_token, else config.json's eos_token_id (the first of a list)."""
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        # transformers' own files hold numbers no field of ours takes (model_max_length = 1e30 for "no limit"):
        # only the end-of-document token is read, and checked below
        token = inputs.parse_json_object(cfg, context=context, field="data.tokenizer", numbers=False).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and backend.token_to_id(token) is not None:
            return int(backend.token_to_id(token))
    model_cfg = folder / "config.json"
    if model_cfg.is_file():
        eos = inputs.parse_json_object(model_cfg, context=context, field="data.tokenizer",
                                       numbers=False).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < backend.get_vocab_size(True):
            return eos
    raise ConfigError(context, "data.tokenizer", spec, f"names no end-of-document token ({folder})",
                      "set eos_token in its tokenizer_config.json")


def tokenize(docs: list[str], tok: Tokenizer) -> np.ndarray:
    """The documents as one stream of ids (int32), each ending in the end-of-document id."""
    if not docs:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(tok.encode(docs))
