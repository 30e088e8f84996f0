"""Issue 29's launch-side classes, each refused in one line (exit 2) before any work, nothing of the user's touched:
damaged run records, outputs that would land on an input or a file, a runs root that cannot hold folders, overrides
that cannot work, and model.weights that cannot start the model (checked against transformers' own model)."""
import json
import os

import pytest

from launch.commands.cli import main
from launch.config.schema import load_recipe
from launch.errors import ConfigError
from tests.conftest import RECIPES, REPO
from tests.unit.report_support import make_run_dir

TINY = RECIPES / "tiny_zero2"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def _tree(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage, says", [
    (lambda t: "", "JSONDecodeError"),
    (lambda t: t[:100], "JSONDecodeError"),
    (lambda t: "[1, 2]", "AttributeError"),
    (lambda t: json.dumps({**json.loads(t), "grid": None}), "TypeError"),
    (lambda t: json.dumps({**json.loads(t), "hardware": {**json.loads(t)["hardware"], "memory_bytes": "80GB"}}),
     "hardware.memory_bytes='80GB' is not int"),
])
@pytest.mark.parametrize("command", [["export"], ["export-accelerate"]])
def test_a_damaged_resolved_json_is_one_line(tmp_path, capsys, damage, says, command):
    run = make_run_dir(tmp_path / "runs", traces=False)
    (run / "resolved.json").write_text(damage((run / "resolved.json").read_text()))
    before = _tree(tmp_path)
    assert main([*command, str(run)]) == 2
    err = _one_line(capsys)
    assert "resolved.json: (contents)=" in err and says in err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("marker, says", [
    ("[1,2]", "is not a JSON object"), ("{}", "step=None is not a whole number"),
    (b"\xe9\xe9", '(encoding)="byte 0xe9 at offset 0" is not UTF-8'),
    ('{"step": 1e400}', "step=inf is not a finite number within 64 bits"),
])
def test_export_names_the_damaged_checkpoint_marker(tmp_path, capsys, marker, says):
    run = make_run_dir(tmp_path / "runs", traces=False)
    path = run / "checkpoints" / "step12" / "layoutlab_checkpoint.json"
    path.write_bytes(marker if isinstance(marker, bytes) else marker.encode())
    assert main(["export", str(run)]) == 2
    err = _one_line(capsys)
    assert f"{path}: {says}" in err


def test_export_out_never_lands_on_an_input(tmp_path, capsys):
    run = make_run_dir(tmp_path / "runs", traces=False)
    for out, says in ((run / "resolved.json", "is an input of this command"),
                      (run / "checkpoints" / "x", "lies inside an input of this command"),
                      (run.parent, "holds an input of this command")):
        before = _tree(tmp_path)
        assert main(["export", str(run), f"out={out}"]) == 2
        assert says in _one_line(capsys)
        assert _tree(tmp_path) == before


def test_export_accelerate_out_that_cannot_be_a_new_folder(tmp_path, capsys):
    run = make_run_dir(tmp_path / "runs", traces=False)
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out, says in ((tmp_path / "dangling", "is a symlink to nothing"),
                      (tmp_path / "file" / "sub", "which is a file"),
                      (run / "sub", "lies inside an input of this command"),
                      (tmp_path / "file", "already exists")):
        before = _tree(tmp_path)
        assert main(["export-accelerate", str(run), f"out={out}"]) == 2
        assert says in _one_line(capsys)
        assert _tree(tmp_path) == before and (tmp_path / "dangling").is_symlink()


@pytest.mark.parametrize("kind", ["file", "loop"])
def test_a_runs_root_that_cannot_hold_folders_is_one_line(tmp_path, capsys, monkeypatch, kind):
    root = tmp_path / "runs"
    if kind == "file":
        root.write_text("not a folder")
    else:
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        root = tmp_path / "a"
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(root))
    says = "which is a file" if kind == "file" else "goes through a symlink loop"
    assert main(["run", str(TINY), "train.steps=7"]) == 2
    assert "LAYOUTLAB_RUNS" in (err := _one_line(capsys)) and says in err
    assert main(["sweep", str(TINY), str(RECIPES / "tiny_ddp"), "train.steps=7"]) == 2
    assert "LAYOUTLAB_RUNS" in (err := _one_line(capsys)) and says in err
    assert main(["plan", "model=tiny-llama", "world_size=2"]) == 2
    assert says in _one_line(capsys)


def test_calibrate_out_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out, says in ((tmp_path / "dangling", "is a symlink to nothing"), (tmp_path / "file" / "c.json", "a file"),
                      (tmp_path / "file", "never replaces a file")):
        assert main(["calibrate", str(TINY), f"out={out}"]) == 2
        assert says in _one_line(capsys)
    assert not (tmp_path / "runs").exists() and (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("override, says", [
    ("train.lr=" + "[" * 3000 + "]" * 3000, "nests too deep"),  # RecursionError in the TOML parser before
    ("commbench.max_bytes=4611686018427387904 run.mode=commbench", "exceeds the cpu profile's device memory"),
    (f"deepspeed.config={REPO / 'ds_configs' / 'zero3.json'}",
     "zero_optimization.stage=3 contradicts the recipe (parallel.zero_stage gives 2)"),
])
def test_overrides_that_cannot_work_are_one_line(tmp_path, capsys, override, says):
    assert main(["run", str(TINY), *override.split(" "), "--dry-run"]) == 2
    assert says in _one_line(capsys)


def test_model_named_twice_by_overrides_is_refused():
    config = REPO / "tests" / "fixtures" / "models" / "tall-llama" / "config.json"
    with pytest.raises(ConfigError, match="names the model twice"):
        load_recipe(TINY, [f"model.config={config}", "model.name=tiny-llama"])
    # one way at a time still replaces the recipe's own (the base names tiny-llama)
    assert load_recipe(TINY, [f"model.config={config}"]).recipe.model.name is None


@pytest.mark.parametrize("field", ["model.config", "model.weights", "data.path", "deepspeed.config",
                                   "parallel.nvme_path", "data.tokenizer"])
def test_a_nul_byte_in_a_recipe_path_is_one_line(tmp_path, capsys, field):
    section, key = field.split(".")
    d = tmp_path / "r"
    d.mkdir()
    (d / "recipe.toml").write_text(f'extends = "{TINY}"\n[{section}]\n{key} = "a\\u0000b"\n')
    assert main(["run", str(d), "--dry-run"]) == 2
    assert f'{field}="a\\x00b" holds a NUL byte' in _one_line(capsys)


@pytest.fixture(scope="module")
def hf_weights(tmp_path_factory):
    """tiny-llama saved by transformers itself (the oracle of names and shapes), as model.weights holds it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("weights")
    config = json.loads((REPO / "launch" / "config" / "catalogue" / "models" / "tiny-llama.json").read_text())
    AutoModelForCausalLM.from_config(LlamaConfig(**config)).save_pretrained(folder, safe_serialization=True)
    return folder


def _rewrite(src, dst, change):
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    save_file(change(load_file(src / "model.safetensors")), dst / "model.safetensors")


def test_model_weights_are_checked_against_the_model_before_launch(tmp_path, capsys, hf_weights):
    assert main(["run", str(TINY), f"model.weights={hf_weights}", "--dry-run"]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    _rewrite(hf_weights, other, lambda s: {"foo": s["model.norm.weight"]})
    assert main(["run", str(TINY), f"model.weights={other}", "--dry-run"]) == 2
    assert "lacks 39 of the 39 tensors tiny-llama needs" in _one_line(capsys)
    part = tmp_path / "part"
    _rewrite(hf_weights, part, lambda s: {k: v for k, v in s.items() if "layers.1." not in k})
    assert main(["run", str(TINY), f"model.weights={part}", "--dry-run"]) == 2
    assert "lacks 9 of the 39 tensors tiny-llama needs (first: model.layers.1." in _one_line(capsys)
    turned = tmp_path / "turned"
    _rewrite(hf_weights, turned, lambda s: {**s, "model.layers.0.mlp.up_proj.weight":
                                            s["model.layers.0.mlp.up_proj.weight"].T.copy()})
    assert main(["run", str(TINY), f"model.weights={turned}", "--dry-run"]) == 2
    assert "model.layers.0.mlp.up_proj.weight=" in (err := _one_line(capsys)) and "is not the shape" in err
    for name, cut in (("cut", lambda b: b[:-100]), ("empty", lambda b: b""), ("text", lambda b: b"{}")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "model.safetensors").write_bytes(cut((hf_weights / "model.safetensors").read_bytes()))
        assert main(["run", str(TINY), f"model.weights={bad}", "--dry-run"]) == 2
        assert ("is cut short" if name == "cut" else "is not a safetensors file") in _one_line(capsys)


def test_a_sweep_run_from_inside_a_recipe_folder_labels_it_by_name(tmp_path, capsys, monkeypatch):
    from launch.commands.sweep import distinct_labels, member

    monkeypatch.chdir(TINY)
    members = distinct_labels([member("", r, ["train.steps=7"]) for r in (".", "../tiny_ddp", str(TINY))])
    assert [m.label for m in members] == ["tiny_zero2", "tiny_ddp", "tiny_zero2-2"]
    assert os.getcwd() == str(TINY)


def test_a_safetensors_header_whose_ranges_cannot_hold_its_tensors_is_refused(tmp_path, capsys, hf_weights):
    """A header that declares 1000 x 1000 F32 in 4 bytes, or nests past any parser, is damage named in one line."""
    import struct

    for name, header in (("small", {"model.norm.weight": {"dtype": "F32", "shape": [1000, 1000],
                                                          "data_offsets": [0, 4]}}),
                         ("deep", None)):
        folder = tmp_path / name
        folder.mkdir()
        text = (json.dumps(header) if header else '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
        assert main(["run", str(TINY), f"model.weights={folder}", "--dry-run"]) == 2
        err = _one_line(capsys)
        assert ("which do not hold it" if name == "small" else "not JSON") in err, err


def test_a_requeued_slurm_job_that_would_start_over_is_refused(tmp_path, capsys, monkeypatch):
    """resume=never in a requeued job would train from step 0 and be stopped and requeued again, for ever."""
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert main(["run", str(TINY), "run.resume=never", "train.steps=7"]) == 2
    assert "in a requeued SLURM job would train again from step 0" in _one_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_an_extends_name_too_long_for_the_file_system_is_one_line(tmp_path, capsys):
    d = tmp_path / "r"
    d.mkdir()
    (d / "recipe.toml").write_text(f'extends = "{"a" * 5000}"\n')
    assert main(["run", str(d), "--dry-run"]) == 2
    assert "which does not exist" in _one_line(capsys)


def test_a_resolved_json_nested_past_any_parser_is_one_line(tmp_path, capsys):
    run = make_run_dir(tmp_path / "runs", traces=False)
    (run / "resolved.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["export", str(run)]) == 2
    assert "resolved.json: (contents)=" in _one_line(capsys)
