"""Model catalogue: counts match the published numbers and real transformers builds; errors say what to fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config.models import (
    ModelSpec,
    ParamCounts,
    catalogue_dir,
    catalogue_names,
    load_model,
)
from launch.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/test/recipe.toml"

# Totals as the model cards and papers publish them; the meta-device test rechecks each against transformers.
PUBLISHED_TOTALS = {
    "llama-2-7b": 6_738_415_616,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-0.5b": 494_032_768,
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.1-70b": 70_553_706_496,
}
TINY = ("tiny-llama", "tiny-qwen2", "tiny-llama2")
HUB_SOURCES = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
}


def _build(spec: ModelSpec, *, meta: bool):
    """The real transformers model for a spec; meta tensors for the big ones, random init for the tiny ones."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**spec.to_dict()["hf_config"])
    if meta:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        model = getattr(transformers, spec.architecture)(cfg)
    assert type(model).__name__ == spec.architecture
    return model


def _own_params(module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _assert_matches_transformers(spec: ModelSpec, model) -> ParamCounts:
    counts = spec.param_counts()
    inner = model.model
    layer = inner.layers[0]
    attn = layer.self_attn
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.embedding == inner.embed_tokens.weight.numel()
    tied = model.lm_head.weight is inner.embed_tokens.weight
    assert tied == spec.tie_word_embeddings
    assert counts.lm_head == (0 if tied else model.lm_head.weight.numel())
    assert counts.attention_per_layer == sum(p.numel() for p in attn.parameters())
    assert counts.mlp_per_layer == sum(p.numel() for p in layer.mlp.parameters())
    assert counts.norms_per_layer == sum(p.numel() for p in layer.input_layernorm.parameters()) + sum(
        p.numel() for p in layer.post_attention_layernorm.parameters()
    )
    assert counts.final_norm == sum(p.numel() for p in inner.norm.parameters())
    assert len(inner.layers) == spec.num_layers
    # DeepSpeed's estimate_zero3_model_states_mem_needs_all_live takes the max over modules of own parameters.
    assert counts.largest_layer == max(_own_params(m) for m in model.modules())
    assert attn.head_dim == spec.head_dim
    assert attn.k_proj.out_features == spec.num_kv_heads * spec.head_dim
    assert (attn.q_proj.bias is not None) == spec.attention_bias
    assert (layer.mlp.gate_proj.bias is not None) == spec.mlp_bias
    assert counts.per_layer == counts.attention_per_layer + counts.mlp_per_layer + counts.norms_per_layer
    assert counts.non_embedding == counts.total - counts.embedding
    return counts


def _write_config(tmp_path: Path, base: str, **changes) -> Path:
    raw = json.loads((catalogue_dir() / f"{base}.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


_DROP = object()


def test_catalogue_lists_every_shipped_model():
    assert catalogue_names() == sorted([*PUBLISHED_TOTALS, *TINY])


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_published_parameter_totals(name):
    assert load_model(name).param_counts().total == PUBLISHED_TOTALS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_big_models_match_transformers_on_meta_device(name):
    spec = load_model(name)
    counts = _assert_matches_transformers(spec, _build(spec, meta=True))
    assert counts.total == PUBLISHED_TOTALS[name]


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_transformers_and_train(name):
    torch = pytest.importorskip("torch")
    spec = load_model(name)
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size) == (512, 64, 128)
    # tiny-llama2 is Llama-2's multi-head attention in small (as many key/value heads as heads: TP 4 divides them)
    kv_heads = 4 if name == "tiny-llama2" else 2
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.max_position_embeddings) == (4, 4, kv_heads, 256)
    torch.manual_seed(0)
    model = _build(spec, meta=False)
    _assert_matches_transformers(spec, model)
    ids = torch.randint(0, spec.vocab_size, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_tiny_model_shapes_follow_their_families():
    llama, qwen = load_model("tiny-llama"), load_model("tiny-qwen2")
    assert (llama.architecture, llama.tie_word_embeddings, llama.attention_bias) == ("LlamaForCausalLM", False, False)
    assert (qwen.architecture, qwen.tie_word_embeddings, qwen.attention_bias) == ("Qwen2ForCausalLM", True, True)
    assert llama.hf_config["rms_norm_eps"] == 1e-5 and llama.hf_config["rope_theta"] == 10000.0


def test_tied_counts_keep_the_lm_head_matmul_in_flops_params():
    spec = load_model("qwen2.5-0.5b")
    c = spec.param_counts()
    shared = spec.vocab_size * spec.hidden_size
    assert (c.embedding, c.lm_head) == (shared, 0)
    assert c.non_embedding == c.total - shared
    assert c.flops_params == c.total
    assert c.largest_layer == shared


def test_untied_counts_put_the_lm_head_in_non_embedding():
    spec = load_model("llama-3.1-8b")
    c = spec.param_counts()
    matrix = spec.vocab_size * spec.hidden_size
    assert c.lm_head == matrix
    assert c.non_embedding == c.total - matrix
    assert c.flops_params == c.non_embedding
    assert c.total == c.embedding + c.lm_head + spec.num_layers * c.per_layer + c.final_norm


@pytest.mark.parametrize("name", [*sorted(PUBLISHED_TOTALS), *TINY])
def test_catalogue_files_name_their_source_and_loader_drops_underscore_keys(name):
    raw = json.loads((catalogue_dir() / f"{name}.json").read_text())
    assert raw["_source"] == HUB_SOURCES.get(name, "layoutlab tiny test model")
    spec = load_model(name)
    assert not any(k.startswith("_") for k in spec.hf_config)
    assert dict(spec.hf_config).keys() == {k for k in raw if not k.startswith("_")}
    assert spec.source == f"launch/config/catalogue/models/{name}.json"
    assert spec.name == name


def test_hf_config_is_read_only_all_the_way_down():
    spec = load_model("llama-3.1-8b")
    with pytest.raises(TypeError):
        spec.hf_config["vocab_size"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.hf_config["rope_scaling"]["factor"] = 2.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        spec.hf_config["architectures"].append("X")  # type: ignore[union-attr]


@pytest.mark.parametrize("name", catalogue_names())
def test_to_dict_from_dict_round_trip(name):
    spec = load_model(name)
    d = json.loads(json.dumps(spec.to_dict()))
    again = ModelSpec.from_dict(d)
    assert again == spec
    assert hash(again) == hash(spec)
    assert again.to_dict() == spec.to_dict()
    assert again.param_counts() == spec.param_counts()


def test_load_by_path_names_the_model_after_its_folder(tmp_path):
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    path = _write_config(folder, "llama-2-7b")
    spec = load_model(config_path=path)
    assert spec.name == "Llama-2-7b-hf"
    assert spec.source == str(path.resolve())
    assert spec.param_counts() == load_model("llama-2-7b").param_counts()


def test_explicit_head_dim_and_default_kv_heads(tmp_path):
    path = _write_config(tmp_path, "tiny-llama", head_dim=32, num_key_value_heads=_DROP)
    spec = load_model(config_path=path)
    assert (spec.head_dim, spec.num_kv_heads) == (32, spec.num_heads)
    _assert_matches_transformers(spec, _build(spec, meta=True))


def test_llama_biases_follow_the_config(tmp_path):
    path = _write_config(tmp_path, "tiny-llama", attention_bias=True, mlp_bias=True)
    spec = load_model(config_path=path)
    assert (spec.attention_bias, spec.mlp_bias) == (True, True)
    _assert_matches_transformers(spec, _build(spec, meta=True))


def test_mistral_is_counted_like_llama(tmp_path):
    path = _write_config(
        tmp_path,
        "tiny-llama",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        head_dim=None,
        sliding_window=None,
        attention_bias=True,
    )
    spec = load_model(config_path=path)
    # transformers' Mistral has no attention_bias switch; the count must follow what it builds.
    assert spec.attention_bias is False
    counts = _assert_matches_transformers(spec, _build(spec, meta=True))
    assert counts == load_model("tiny-llama").param_counts()


# --- errors -------------------------------------------------------------------------------------------


def test_unknown_catalogue_name_lists_known_names():
    with pytest.raises(ConfigError) as info:
        load_model("llama-2-7", context=RECIPE)
    e = info.value
    assert (e.file, e.field, e.value) == (RECIPE, "model.name", "llama-2-7")
    assert "is not in the model catalogue" in e.problem
    assert "did you mean 'llama-2-7b'?" in e.fix
    for name in catalogue_names():
        assert name in e.fix
    assert str(e).startswith(f'{RECIPE}: model.name="llama-2-7" is not in the model catalogue; ')


@pytest.mark.parametrize("kwargs", [{}, {"name": "tiny-llama", "config_path": "x.json"}])
def test_exactly_one_of_name_or_path(kwargs):
    with pytest.raises(ConfigError) as info:
        load_model(**kwargs, context=RECIPE)
    assert (info.value.file, info.value.field) == (RECIPE, "model")
    assert "exactly one" in info.value.problem


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path, context=RECIPE)
    e = info.value
    assert (e.file, e.field, e.value) == (RECIPE, "model.config", str(path))
    assert e.problem == "does not exist"
    assert str(path) in str(e)


def test_config_path_to_a_folder_points_at_its_config_json(tmp_path):
    _write_config(tmp_path, "tiny-llama")
    with pytest.raises(ConfigError) as info:
        load_model(config_path=tmp_path, context=RECIPE)
    assert info.value.fix == f"use {tmp_path / 'config.json'}"


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "vocab_size": 512,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path, context=RECIPE)
    e = info.value
    assert e.file == str(path.resolve())
    assert e.field == "line 3 col 1"
    assert e.value == "}"
    assert e.problem.startswith("is not valid JSON (Expecting property name")
    assert "trailing commas" in e.fix


def test_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path)
    assert (info.value.field, info.value.value, info.value.problem) == ("model.config", "[1, 2]", "is not a JSON object")


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _write_config(tmp_path, "tiny-llama", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path, context=RECIPE)
    e = info.value
    assert (e.file, e.field, e.value) == (str(path.resolve()), "architectures", ["GPT2LMHeadModel"])
    assert "GPT2LMHeadModel" in e.problem and RECIPE in e.problem
    assert (
        e.fix == "use a model whose architectures[0] is one of: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    )


@pytest.mark.parametrize(
    "key", ["architectures", "model_type", "vocab_size", "intermediate_size", "max_position_embeddings"]
)
def test_missing_required_key_is_named(tmp_path, key):
    path = _write_config(tmp_path, "tiny-qwen2", **{key: _DROP})
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path, context=RECIPE)
    e = info.value
    assert (e.file, e.field, e.value) == (str(path.resolve()), key, None)
    assert e.problem == f"is missing (model referenced from {RECIPE})"
    assert key in e.fix or key == "architectures"


def test_model_type_must_match_architecture(tmp_path):
    path = _write_config(tmp_path, "tiny-qwen2", model_type="llama")
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path)
    assert (info.value.field, info.value.value) == ("model_type", "llama")
    assert info.value.fix.startswith('set "model_type": "qwen2"')


@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_size", "64"), ("num_hidden_layers", True), ("vocab_size", 0), ("intermediate_size", 12.5)],
)
def test_sizes_must_be_positive_integers(tmp_path, key, value):
    path = _write_config(tmp_path, "tiny-llama", **{key: value})
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path)
    assert (info.value.field, info.value.value, info.value.problem) == (key, value, "must be a positive integer")


def test_kv_heads_must_divide_heads(tmp_path):
    path = _write_config(tmp_path, "tiny-llama", num_key_value_heads=3)
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path)
    assert (info.value.field, info.value.value) == ("num_key_value_heads", 3)
    assert "must divide num_attention_heads=4" in info.value.problem


def test_flags_must_be_booleans(tmp_path):
    path = _write_config(tmp_path, "tiny-llama", tie_word_embeddings="false")
    with pytest.raises(ConfigError) as info:
        load_model(config_path=path)
    assert (info.value.field, info.value.value, info.value.problem) == (
        "tie_word_embeddings",
        "false",
        "must be a boolean",
    )


def test_from_dict_rejects_missing_unknown_and_mistyped_fields():
    good = load_model("tiny-llama").to_dict()
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict({k: v for k, v in good.items() if k != "head_dim"}, context="runs/x/resolved.json")
    assert (info.value.file, info.value.field) == ("runs/x/resolved.json", "model.head_dim")
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict({**good, "hidden": 64})
    assert info.value.field == "model.hidden"
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict({**good, "num_heads": "4"})
    assert (info.value.field, info.value.value) == ("model.num_heads", "4")
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict({**good, "architecture": "GPT2LMHeadModel"})
    assert info.value.field == "model.architecture"


def test_importing_and_loading_does_not_import_torch():
    code = (
        "import sys, launch.config.models as m\n"
        "[m.load_model(n).param_counts() for n in m.catalogue_names()]\n"
        "heavy = {'torch', 'transformers', 'deepspeed', 'megatron', 'numpy'}\n"
        "print(','.join(sorted(k for k in sys.modules if k.split('.')[0] in heavy)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
