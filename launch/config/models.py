"""Model catalogue: Hugging Face config.json files read into typed, frozen specs with exact parameter counts.

Stdlib only. The planner imports this and must answer in under two seconds, so torch and transformers are
never imported here; tests/unit/test_models.py checks every count against a real transformers build.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from launch import REPO_ROOT, inputs
from launch.errors import ConfigError


@dataclass(frozen=True)
class _Architecture:
    """How transformers builds one decoder family; only what changes the parameter count is recorded."""

    model_type: str
    # Qwen2 hard-codes q/k/v biases and ignores any attention_bias key; Llama reads attention_bias and
    # applies it to o_proj as well; Mistral never has biases.
    qkv_bias_from_config: bool
    qkv_bias_fixed: bool
    o_bias_follows_qkv: bool
    mlp_bias_from_config: bool


_ARCHITECTURES: Mapping[str, _Architecture] = MappingProxyType(
    {
        "LlamaForCausalLM": _Architecture("llama", True, False, True, True),
        "MistralForCausalLM": _Architecture("mistral", False, False, False, False),
        "Qwen2ForCausalLM": _Architecture("qwen2", False, True, False, False),
    }
)

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ParamInfo:
    name: str  # as Hugging Face names it
    shape: tuple[int, ...]  # as Hugging Face stores it (Linear weights are [out, in])
    split: str  # "out" | "in" | "vocab" | "replicated" under tensor parallelism
    layer: int  # decoder layer index; -1 for the embedding, num_layers for the final norm and lm_head

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model as transformers instantiates it (shared tensors counted once)."""

    embedding: int
    lm_head: int
    attention_per_layer: int
    mlp_per_layer: int
    norms_per_layer: int
    final_norm: int
    total: int
    per_layer: int
    # lm_head counts as non-embedding, as torchtitan does; a tied matrix is already in `embedding` only.
    non_embedding: int
    # DeepSpeed's estimate_zero3 "largest_layer_params": the most parameters owned by one module.
    largest_layer: int
    # The 6*N in MFU: a tied lm_head has no parameters of its own but its matmul still runs per token.
    flops_params: int


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only model, read from an HF config.json; everything the planner needs to size it."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    source: str
    # Excluded from the hash because a mapping is unhashable; equality still compares it.
    hf_config: Mapping[str, Any] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.hf_config, MappingProxyType):
            object.__setattr__(self, "hf_config", _freeze(self.hf_config))

    def param_counts(self) -> ParamCounts:
        arch = _ARCHITECTURES[self.architecture]
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        qkv_bias = self.attention_bias
        o_bias = self.attention_bias and arch.o_bias_follows_qkv

        q_proj = h * q_out + (q_out if qkv_bias else 0)
        kv_proj = h * kv_out + (kv_out if qkv_bias else 0)
        o_proj = q_out * h + (h if o_bias else 0)
        up_proj = h * i + (i if self.mlp_bias else 0)  # gate_proj has the same shape
        down_proj = i * h + (h if self.mlp_bias else 0)

        attention = q_proj + 2 * kv_proj + o_proj
        mlp = 2 * up_proj + down_proj
        norms = 2 * h
        per_layer = attention + mlp + norms
        embedding = v * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        total = embedding + lm_head + self.num_layers * per_layer + h
        return ParamCounts(
            embedding=embedding,
            lm_head=lm_head,
            attention_per_layer=attention,
            mlp_per_layer=mlp,
            norms_per_layer=norms,
            final_norm=h,
            total=total,
            per_layer=per_layer,
            non_embedding=total - embedding,
            # A tied lm_head module still owns the shared weight, so v*h stands either way.
            largest_layer=max(embedding, q_proj, kv_proj, o_proj, up_proj, down_proj),
            flops_params=total - embedding + (v * h if self.tie_word_embeddings else 0),
        )

    def parameters(self) -> list["ParamInfo"]:
        """Every parameter tensor in module order, with how tensor parallelism splits it.

        split: "out" (column-parallel: rows split over tp), "in" (row-parallel: columns split),
        "vocab" (embedding / lm_head rows), "replicated" (norms, row-parallel output biases).
        """
        arch = _ARCHITECTURES[self.architecture]
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias, o_bias = self.attention_bias, self.attention_bias and arch.o_bias_follows_qkv
        out = [ParamInfo("model.embed_tokens.weight", (v, h), "vocab", -1)]
        for layer in range(self.num_layers):
            pre = f"model.layers.{layer}."
            for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                out.append(ParamInfo(f"{pre}self_attn.{name}.weight", (rows, h), "out", layer))
                if qkv_bias:
                    out.append(ParamInfo(f"{pre}self_attn.{name}.bias", (rows,), "out", layer))
            out.append(ParamInfo(f"{pre}self_attn.o_proj.weight", (h, q_out), "in", layer))
            if o_bias:
                out.append(ParamInfo(f"{pre}self_attn.o_proj.bias", (h,), "replicated", layer))
            for name in ("gate_proj", "up_proj"):
                out.append(ParamInfo(f"{pre}mlp.{name}.weight", (i, h), "out", layer))
                if self.mlp_bias:
                    out.append(ParamInfo(f"{pre}mlp.{name}.bias", (i,), "out", layer))
            out.append(ParamInfo(f"{pre}mlp.down_proj.weight", (h, i), "in", layer))
            if self.mlp_bias:
                out.append(ParamInfo(f"{pre}mlp.down_proj.bias", (h,), "replicated", layer))
            out.append(ParamInfo(f"{pre}input_layernorm.weight", (h,), "replicated", layer))
            out.append(ParamInfo(f"{pre}post_attention_layernorm.weight", (h,), "replicated", layer))
        out.append(ParamInfo("model.norm.weight", (h,), "replicated", self.num_layers))
        if not self.tie_word_embeddings:
            out.append(ParamInfo("lm_head.weight", (v, h), "vocab", self.num_layers))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hf_config"] = _thaw(self.hf_config)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, context: str = "<model spec>") -> ModelSpec:
        if not isinstance(d, Mapping):
            raise ConfigError(
                context, "model", type(d).__name__, "is not a mapping", "pass the dict that ModelSpec.to_dict() wrote"
            )
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ConfigError(
                context,
                f"model.{missing[0]}",
                None,
                "is missing",
                f"pass every key ModelSpec.to_dict() writes: {', '.join(names)}",
            )
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(
                context,
                f"model.{unknown[0]}",
                d[unknown[0]],
                "is not a ModelSpec field",
                f"remove it; known fields are {', '.join(names)}",
            )
        for key in ("name", "architecture", "source"):
            if not isinstance(d[key], str) or not d[key]:
                raise ConfigError(
                    context, f"model.{key}", d[key], "must be a non-empty string", f"set model.{key} to a string"
                )
        if d["architecture"] not in _ARCHITECTURES:
            raise ConfigError(
                context,
                "model.architecture",
                d["architecture"],
                "is not supported",
                f"use one of: {', '.join(_ARCHITECTURES)}",
            )
        ints = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for key in ints:
            _require_positive_int(d[key], context, f"model.{key}")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            _require_bool(d[key], context, f"model.{key}")
        if not isinstance(d["hf_config"], Mapping):
            raise ConfigError(
                context,
                "model.hf_config",
                type(d["hf_config"]).__name__,
                "is not a mapping",
                "pass the hf_config dict that ModelSpec.to_dict() wrote",
            )
        return cls(**{n: d[n] for n in names})


def catalogue_dir() -> Path:
    return Path(__file__).resolve().parent / "catalogue" / "models"


def catalogue_names() -> list[str]:
    return sorted(p.stem for p in catalogue_dir().glob("*.json"))


def load_model(name: str | None = None, config_path: str | Path | None = None, *, context: str = "") -> ModelSpec:
    """Read a catalogue model by name, or any supported HF config.json by path; exactly one of the two.

    `context` names the file that asked for the model (a recipe); errors about the reference itself name it,
    errors inside a config.json name that config.json, where the line to fix is.
    """
    where = context or "<load_model>"
    if (name is None) == (config_path is None):
        raise ConfigError(
            where,
            "model",
            {"name": name, "config_path": None if config_path is None else str(config_path)},
            "needs exactly one of a catalogue name or a config.json path",
            f"set model.name to one of {', '.join(catalogue_names())}, or model.config to an HF config.json",
        )
    if name is not None:
        known = catalogue_names()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                where,
                "model.name",
                name,
                "is not in the model catalogue",
                f"{hint}use one of: {', '.join(known)}; or set model.config to an HF config.json",
            )
        path = catalogue_dir() / f"{name}.json"
        spec_name = name
    else:
        path = Path(config_path)  # type: ignore[arg-type]
        if path.is_dir():
            hint = (
                f"use {path / 'config.json'}"
                if (path / "config.json").is_file()
                else "point it at the config.json file itself"
            )
            raise ConfigError(where, "model.config", str(path), "is a directory, not a config.json", hint)
        if not path.is_file():
            raise ConfigError(
                where,
                "model.config",
                str(path),
                "does not exist",
                "point it at an existing HF config.json, or use model.name for a catalogue model",
            )
        # An HF snapshot is a folder holding config.json, so the folder names the model.
        spec_name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return _parse(_read_json(path, where), spec_name, path, context)


def _read_json(path: Path, where: str) -> dict[str, Any]:
    return inputs.parse_json_object(path.resolve(), context=where, field="model.config",
                                    fix="point it at an existing HF config.json, or use model.name for a catalogue "
                                        "model")


def _parse(raw: Mapping[str, Any], spec_name: str, path: Path, context: str) -> ModelSpec:
    shown = _display(path)
    referenced = f" (model referenced from {context})" if context else ""
    # "_"-keys are ours (_source) or HF bookkeeping (_name_or_path); neither describes the network.
    hf = {k: v for k, v in raw.items() if not k.startswith("_")}
    architecture = _architecture(hf, shown, referenced)
    arch = _ARCHITECTURES[architecture]
    for key in _REQUIRED_INTS:
        if key not in hf:
            raise _missing(shown, key, referenced,
                           f'add "{key}": <positive integer> as in the model\'s published config.json')
        _require_positive_int(hf[key], shown, key)
    kv_heads = _kv_heads(hf, shown, referenced)
    head_dim = _head_dim(hf, shown, referenced)

    # The three supported config classes all default these to False.
    tie = _optional_bool(hf, "tie_word_embeddings", shown)
    attention_bias = arch.qkv_bias_fixed or (arch.qkv_bias_from_config and _optional_bool(hf, "attention_bias", shown))
    mlp_bias = arch.mlp_bias_from_config and _optional_bool(hf, "mlp_bias", shown)

    return ModelSpec(
        name=spec_name,
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        source=shown,
        hf_config=hf,
    )


def _missing(shown: str, key: str, referenced: str, fix: str) -> ConfigError:
    return ConfigError(shown, key, None, f"is missing{referenced}", fix)


def _architecture(hf: Mapping[str, Any], shown: str, referenced: str) -> str:
    """architectures[0], one we can count, and the model_type transformers builds it by."""
    if "architectures" not in hf:
        raise _missing(shown, "architectures", referenced,
                       f'add "architectures": ["<one of {", ".join(_ARCHITECTURES)}>"]')
    archs = hf["architectures"]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(
            shown,
            "architectures",
            archs,
            f"must be a non-empty list of class names{referenced}",
            'write it as HF does, e.g. ["LlamaForCausalLM"]',
        )
    architecture = archs[0]
    if architecture not in _ARCHITECTURES:
        raise ConfigError(
            shown,
            "architectures",
            archs,
            f"names {architecture}, which the planner cannot count{referenced}",
            f"use a model whose architectures[0] is one of: {', '.join(_ARCHITECTURES)}",
        )
    model_type = _ARCHITECTURES[architecture].model_type
    # transformers picks the classes by model_type, so a mismatch would build a different network than we count.
    if "model_type" not in hf:
        raise _missing(shown, "model_type", referenced, f'add "model_type": "{model_type}"')
    if hf["model_type"] != model_type:
        raise ConfigError(
            shown,
            "model_type",
            hf["model_type"],
            f"does not match architectures[0]={architecture}{referenced}",
            f'set "model_type": "{model_type}" or fix architectures',
        )
    return architecture


def _kv_heads(hf: Mapping[str, Any], shown: str, referenced: str) -> int:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = heads  # transformers' default: plain multi-head attention
    _require_positive_int(kv_heads, shown, "num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(
            shown,
            "num_key_value_heads",
            kv_heads,
            f"must divide num_attention_heads={heads}{referenced}",
            "use a divisor of num_attention_heads (grouped-query attention repeats each KV head evenly)",
        )
    return kv_heads


def _head_dim(hf: Mapping[str, Any], shown: str, referenced: str) -> int:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                shown,
                "hidden_size",
                hidden,
                f"is not divisible by num_attention_heads={heads}{referenced}",
                'set "head_dim" explicitly or pick hidden_size as a multiple of the head count',
            )
        head_dim = hidden // heads
    _require_positive_int(head_dim, shown, "head_dim")
    return head_dim


def _require_positive_int(value: Any, file: str, key: str) -> None:
    # bool is an int subclass; `true` where a size belongs is a typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            file,
            key,
            value,
            "must be a positive integer",
            f"set {key} to a whole number > 0 (no quotes, no decimal point)",
        )


def _require_bool(value: Any, file: str, key: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(file, key, value, "must be a boolean", f"set {key} to true or false")


def _optional_bool(hf: Mapping[str, Any], key: str, file: str) -> bool:
    value = hf.get(key, False)
    _require_bool(value, file, key)
    return value


def _display(path: Path) -> str:
    resolved = path.resolve()
    try:
        return resolved.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(resolved)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
