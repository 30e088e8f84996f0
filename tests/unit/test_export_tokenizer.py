"""`launch export` writes the tokenizer the run read its rows with beside the weights, so `AutoTokenizer` loads the
export (a newcomer's `from_pretrained` on an export failed: no tokenizer in it). The oracles: Python's own UTF-8
encoding for the byte tokenizer, the `tokenizers` library reading the source folder for a tokenizer folder."""
import json

import pytest

from launch.config.resolve import resolve_path
from launch.torchtools.export import Exported, save_tokenizer
from tests.conftest import RECIPES, REPO

FOLDER = REPO / "tests" / "fixtures" / "tokenizer"
CORPUS = REPO / "tests" / "fixtures" / "text" / "genesis.jsonl"
TEXTS = ["In the beginning God created the heaven and the earth.", "héllo wörld\n\t 日本 ∑ x", " leading space", ""]


def _resolved(*overrides):
    return resolve_path(RECIPES / "tiny_zero2", ['data.source="text"', f'data.path="{CORPUS}"', *overrides])


def test_the_byte_tokenizer_loads_in_transformers_and_gives_each_byte_its_id(tmp_path):
    from transformers import AutoTokenizer

    assert save_tokenizer(_resolved(), tmp_path).startswith("the byte tokenizer")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 256)  # launch.data.tokenizer's end of a document


def test_a_tokenizer_folder_is_copied_and_encodes_as_its_source(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    said = save_tokenizer(_resolved(f'data.tokenizer="{FOLDER}"'), tmp_path)
    assert said == f"copied from {FOLDER}: tokenizer.json, tokenizer_config.json"
    source = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for line in CORPUS.read_text().splitlines()[:20]:
        text = json.loads(line)["text"]
        assert tok(text).input_ids == source.encode(text).ids
    assert tok.eos_token == json.loads((FOLDER / "tokenizer_config.json").read_text())["eos_token"]


def test_synthetic_rows_have_no_tokenizer_and_the_hint_says_so(tmp_path):
    resolved = resolve_path(RECIPES / "tiny_zero2", [])
    assert save_tokenizer(resolved, tmp_path) == "" and not any(tmp_path.iterdir())
    assert Exported(tmp_path, "").lines()[-1] == "(no tokenizer: the run trained on synthetic token ids)"


@pytest.mark.parametrize("tokenizer", ["byte", "folder"])
def test_the_printed_hint_loads_both(tokenizer, tmp_path):
    said = save_tokenizer(_resolved(*([f'data.tokenizer="{FOLDER}"'] if tokenizer == "folder" else [])), tmp_path)
    first, model, tok = Exported(tmp_path, said).lines()
    assert first == str(tmp_path)
    assert model == f"load it with: AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    assert tok.startswith(f"and AutoTokenizer.from_pretrained({str(tmp_path)!r}) (")


def test_a_tokenizer_that_transformers_saved_is_read_back_for_data(tmp_path):
    """transformers' save_pretrained writes model_max_length = 1e30 ("no limit") when a tokenizer has none, as real
    model repositories carry it; prepare-data refused it as "not a finite number within 64 bits". An export's
    tokenizer is now a data.tokenizer like any other."""
    from launch.data.tokenizer import load_tokenizer

    save_tokenizer(_resolved(), tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] > 2**64
    tok = load_tokenizer(str(tmp_path), None, "test")
    (ids,) = tok.encode(["héllo"])
    assert ids.tolist() == [*"héllo".encode("utf-8"), 256]


@pytest.mark.parametrize("name, text", [("tokenizer_config.json", "[1, 2]"), ("tokenizer_config.json", '"eos"'),
                                        ("config.json", "[]"), ("config.json", "7")])
def test_a_tokenizer_file_that_is_json_but_no_object_is_one_line(tmp_path, name, text):
    from launch.data.tokenizer import load_tokenizer
    from launch.errors import ConfigError

    (tmp_path / "tokenizer.json").write_bytes((FOLDER / "tokenizer.json").read_bytes())
    if name == "config.json":  # read when tokenizer_config.json names no end-of-document token
        (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(tmp_path), None, "recipe.toml")
    said = str(e.value)
    assert said.startswith(f"{tmp_path / name}: data.tokenizer=") and "is not a JSON object" in said, said
    assert "\n" not in said


def test_a_tokenizer_named_by_its_file_is_copied_from_its_folder_and_a_missing_one_is_one_line(tmp_path):
    """data.tokenizer may name the tokenizer.json itself (load_tokenizer takes it): its folder's files are copied;
    a folder that no longer holds it refuses the export instead of printing a loading hint that fails."""
    from launch.errors import ConfigError

    (tmp_path / "a").mkdir()  # the export's folder, which save_pretrained has made by then
    said = save_tokenizer(_resolved(f'data.tokenizer="{FOLDER / "tokenizer.json"}"'), tmp_path / "a")
    assert said == f"copied from {FOLDER}: tokenizer.json, tokenizer_config.json"
    gone = tmp_path / "gone"
    gone.mkdir()
    with pytest.raises(ConfigError, match="no longer holds the tokenizer.json"):
        save_tokenizer(_resolved(f'data.tokenizer="{gone}"'), tmp_path / "b")
