"""A catalogue model as `transformers` builds it: the one place a model spec becomes a transformers config."""
from __future__ import annotations

from launch.config.models import ModelSpec


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
