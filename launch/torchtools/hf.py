"""A catalogue model as `transformers` builds it: the one place a model spec becomes a transformers config (and a
recipe's [peft] a peft config); and the byte tokenizer (launch/data/tokenizer.py) as a `transformers` tokenizer, for
exports of runs that read bytes."""
from __future__ import annotations

import logging
import os

from launch.config.models import ModelSpec
from launch.config.schema import PeftSection
from launch.data.tokenizer import EOS_BYTE


def hf_config(spec: ModelSpec):
    """The `transformers` config object of a model spec ."""
    from transformers import AutoConfig

    cfg = dict(spec.to_dict()["hf_config"])
    model_type = cfg.pop("model_type")
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(model_type, **cfg)
    config.architectures = [spec.architecture]
    return config


def offline_bitsandbytes() -> None:
    """Before peft is imported (it imports bitsandbytes whenever installed): bitsandbytes 0.50's CPU backend fetches a
    4-bit GEMM kernel from the Hugging Face Hub at import where the `kernels` package is installed, and warns on every
    import where it is not. A run downloads nothing (HF_HUB_OFFLINE, unless the user set it), and the fallback that runs,
    bitsandbytes' own CPU code, needs no warning."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def lora_config(spec: PeftSection):
    """peft's LoraConfig of a recipe's [peft] (launch.config.adapters): what the ranks add to the model and what an
    export writes beside its adapters."""
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")


BYTE_EOS_TOKEN = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which `tokenizers`' ByteLevel pre-tokenizer maps bytes to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # controls, space: the code points past 255, in order
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def byte_tokenizer():
    """launch.data.tokenizer's "byte" tokenizer as a transformers fast tokenizer: each UTF-8 byte its own id (0-255),
    the end-of-document token EOS_BYTE; no merges, no prefix space, no template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()} | {BYTE_EOS_TOKEN: EOS_BYTE}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS_TOKEN)
