"""Real Hugging Face Hub files (tests/fixtures/hub, with their provenance) through the readers a user's folders go
through: model.config gives the catalogue's own shapes, and a tokenizer folder holding the Hub's tokenizer_config.json
and config.json (Llama-2's model_max_length past 64 bits, AddedToken objects, Qwen's null bos) is accepted and finds
its end-of-document token. The oracle: the parameter counts the model authors publish."""
import json
import shutil

import pytest

from launch.config.models import load_model
from launch.data.tokenizer import load_tokenizer
from tests.conftest import REPO

HUB = REPO / "tests" / "fixtures" / "hub"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer" / "tokenizer.json"
MODELS = ["qwen2.5-0.5b", "llama-2-7b", "tinyllama-1.1b"]


# The parameter counts the model authors publish (Qwen2.5's model card: 0.49B, 494,032,768 by transformers'
# num_parameters(); Llama-2-7B: 6,738,415,616; TinyLlama-1.1B: 1,100,048,384).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "llama-2-7b": 6_738_415_616, "tinyllama-1.1b": 1_100_048_384}


@pytest.mark.parametrize("name", MODELS)
def test_a_hub_config_json_gives_the_published_parameter_count_and_the_catalogues_shapes(name):
    hub, catalogue = load_model(config_path=HUB / name / "config.json"), load_model(name)
    assert hub.param_counts().total == PUBLISHED[name]
    fields = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias")
    assert [getattr(hub, f) for f in fields] == [getattr(catalogue, f) for f in fields]


@pytest.mark.parametrize("name", MODELS)
def test_a_tokenizer_folder_with_the_hubs_own_configs_is_accepted(tmp_path, name):
    # the tokenizer model is the tiny fixture's (the Hub's tokenizer.json files are megabytes); the configs are real
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    for f in ("tokenizer_config.json", "config.json"):
        shutil.copy(HUB / name / f, folder / f)
    tok = load_tokenizer(str(folder), None, "recipe.toml")
    config = json.loads((HUB / name / "tokenizer_config.json").read_text())
    eos = config["eos_token"]["content"] if isinstance(config["eos_token"], dict) else config["eos_token"]
    own = json.loads(TOKENIZER.read_text())["model"]["vocab"].get(eos)
    # the Hub's eos token where the tiny vocabulary has it (Qwen's <|endoftext|>), else config.json's eos_token_id
    want = own if own is not None else json.loads((HUB / name / "config.json").read_text())["eos_token_id"]
    assert tok.eos_id == want
