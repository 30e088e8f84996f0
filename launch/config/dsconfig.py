"""Compose the final DeepSpeed config: a base from ds_configs/ + the fields the recipe owns."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Collection

from launch import REPO_ROOT, inputs
from launch.errors import ConfigError

DS_CONFIGS = REPO_ROOT / "ds_configs"


# The shipped bases that hold exactly one offload combination; any other combination starts from the
# plain stage base and the resolver adds the offload sections (OFFLOAD_DEFAULTS).
_OFFLOAD_BASES = {
    (2, "cpu", "none"): "zero2_offload_optimizer_cpu.json",
    (3, "cpu", "none"): "zero3_offload_optimizer_cpu.json",
    (3, "cpu", "cpu"): "zero3_offload_all_cpu.json",
    (3, "nvme", "nvme"): "zero3_offload_nvme.json",
}

OFFLOAD_DEFAULTS = {
    ("offload_optimizer", "cpu"): {"device": "cpu", "pin_memory": True},
    ("offload_param", "cpu"): {"device": "cpu", "pin_memory": True},
    ("offload_optimizer", "nvme"): {"device": "nvme", "pin_memory": True, "buffer_count": 4, "fast_init": False},
    ("offload_param", "nvme"): {"device": "nvme", "pin_memory": True, "buffer_count": 5, "buffer_size": 100_000_000,
                                "max_in_cpu": 1_000_000_000},
}
AIO_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True}


def default_base(zero_stage: int, offload_optimizer: str, offload_params: str) -> Path:
    name = _OFFLOAD_BASES.get((zero_stage, offload_optimizer, offload_params), f"zero{zero_stage}.json")
    return DS_CONFIGS / name


def read_json(path: Path, *, context: str, field: str) -> dict[str, Any]:
    data = inputs.parse_json(path, context=context, field=field,
                             fix=f"name a JSON file (paths are relative to the recipe); shipped bases are in {DS_CONFIGS}")
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", type(data).__name__, "must be a JSON object", "wrap it in {}")
    for section in OBJECT_SECTIONS:
        value = _get(data, section)
        if value is not _ABSENT and value is not None and not isinstance(value, dict):
            raise ConfigError(str(path), section, json.dumps(value)[:60], "must be a JSON object (DeepSpeed reads "
                              "its fields by name)", f'write "{section.rsplit(".", 1)[-1]}": {{...}}, or leave it out')
    return data


# DeepSpeed config sections that DeepSpeed reads as objects (config.py / zero/config.py): anything else there
# fails deep inside deepspeed.initialize.
OBJECT_SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                   "optimizer", "optimizer.params", "scheduler", "scheduler.params", "fp16", "bf16", "amp",
                   "tensor_parallel", "activation_checkpointing", "flops_profiler", "comms_logger", "checkpoint",
                   "data_types", "aio", "tensorboard", "csv_monitor", "wandb", "compression_training")


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _ABSENT
        d = d[part]
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


_ABSENT = object()


def compose(base: dict[str, Any], base_file: str, owned: dict[str, tuple[Any, str]], *,
            yields: Collection[str] = frozenset()) -> dict[str, Any]:
    """Apply the recipe-owned fields over `base`.

    `owned` maps a dotted DeepSpeed key to (value, recipe field that decides it). A base that sets one of them
    explicitly to something else is refused: silently letting either side win is how a run ends up with a batch size
    or ZeRO stage nobody asked for. The keys in `yields` are the exception: a shipped base's tuning (e.g.
    overlap_comm) that gives way where a backend must decide the field itself.
    """
    out = json.loads(json.dumps(base))
    for key, (value, recipe_field) in owned.items():
        have = _get(out, key)
        if have is not _ABSENT and have != value and key not in yields:
            raise ConfigError(base_file, key, have, f"contradicts the recipe ({recipe_field} gives {value!r})",
                              f"remove {key} from the base or set {recipe_field} to match")
        _set(out, key, value)
    return out


# ZeRO-3 sizes a base may leave "auto" (as Hugging Face's DeepSpeed integration reads the word), filled from the
# model: the reduce and prefetch buckets hold one decoder layer of this rank (its TP shard), so the next layer's
# parameters are gathered while one computes and one layer's gradients leave in one reduce; parameters below ten
# hidden sizes (norms, biases) stay whole, as Hugging Face's "auto" keeps them, and never fewer than DeepSpeed's own
# default keeps (below it, a small model's every tensor would be gathered one call at a time).
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
AUTO_FIELDS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def layer_params_per_rank(model, tp: int) -> int:
    """One decoder layer's parameters on one rank of a TP group (rounded up)."""
    return -(-model.param_counts().per_layer // tp)


def fill_auto(cfg: dict[str, Any], model, tp: int, base_file: str) -> None:
    """Replace "auto" in `cfg`'s zero_optimization with numbers derived from `model` at tensor parallelism `tp`."""
    zo = cfg.get("zero_optimization", {})
    layer = layer_params_per_rank(model, tp)
    values = {"reduce_bucket_size": layer, "stage3_prefetch_bucket_size": layer,
              "stage3_param_persistence_threshold": max(10 * model.hidden_size, ZERO3_PERSISTENCE_THRESHOLD)}
    for key, value in zo.items():
        if value == "auto":
            if key not in values:
                raise ConfigError(base_file, f"zero_optimization.{key}", value, "has no automatic value here",
                                  f"give a number (\"auto\" is understood for {', '.join(AUTO_FIELDS)})")
            zo[key] = values[key]


def merge_fragment(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for k, v in fragment.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_fragment(out[k], v)
        elif k not in out:
            out[k] = v
    return out
