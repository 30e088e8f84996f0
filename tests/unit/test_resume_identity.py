"""Runs have an identity: `run.resume=auto` continues only a checkpoint written by the same configuration (backend,
layout, model, data, batch, precision, optimizer) and says which; anything else starts fresh and says why; another
layout is resumed only when named. Checkpoints here are completion markers written as the loop writes them."""
import pytest

from launch.config.resolve import resolve_path
from launch.run.checkpoints import ResumeError, choose_resume, marker_info, write_marker
from tests.conftest import RECIPES

TINY = RECIPES / "tiny_zero2"


def _run_with_checkpoint(runs, name, overrides, step=5):
    """runs/tiny_zero2/<name>/checkpoints/step{step}/ with the marker a run of `overrides` writes."""
    resolved = resolve_path(TINY, list(overrides))
    root = runs / "tiny_zero2" / name
    (root / "checkpoints" / f"step{step}").mkdir(parents=True)
    write_marker(root / "checkpoints", f"step{step}", marker_info(resolved, step))
    return root


def test_auto_resumes_the_same_configuration_and_says_so(tmp_path):
    root = _run_with_checkpoint(tmp_path, "20261201-000000", [])
    choice = choose_resume(resolve_path(TINY, ["train.steps=40"]), tmp_path / "tiny_zero2")  # more steps: same run
    assert choice.checkpoint is not None and choice.checkpoint.dir == root / "checkpoints" / "step5"
    assert choice.lines[-1].startswith(f"resuming {root} at step 5")


@pytest.mark.parametrize("other, differs", [
    (["backend=megatron"], "backend"),
    (["parallel.zero_stage=3"], "zero_stage"),
    (["parallel.tp=2", "hardware.gpus_per_node=4"], "tp"),
    (["batch.micro_batch_size=1"], "micro_batch_size"),
])
def test_auto_starts_fresh_beside_another_configuration_and_says_why(tmp_path, other, differs):
    root = _run_with_checkpoint(tmp_path, "20261201-000000", other)
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    note, last = choice.lines
    assert note.startswith(f"{root / 'checkpoints' / 'step5'}: not resumed") and differs in note.split("differs in")[1]
    assert last.startswith("starting fresh")


def test_auto_passes_over_a_newer_other_configuration_for_its_own(tmp_path):
    own = _run_with_checkpoint(tmp_path, "20261201-000000", [])
    _run_with_checkpoint(tmp_path, "20261202-000000", ["parallel.zero_stage=3"], step=8)
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint.dir == own / "checkpoints" / "step5"


def test_never_ignores_every_checkpoint(tmp_path):
    _run_with_checkpoint(tmp_path, "20261201-000000", [])
    choice = choose_resume(resolve_path(TINY, ["run.resume=never"]), tmp_path / "tiny_zero2")
    assert (choice.checkpoint, choice.lines) == (None, ())


def test_a_named_run_of_another_layout_is_resumed(tmp_path):
    root = _run_with_checkpoint(tmp_path, "20261201-000000", ["parallel.zero_stage=1"])
    choice = choose_resume(resolve_path(TINY, [f"run.resume={root}"]), tmp_path / "elsewhere")
    assert choice.checkpoint.dir == root / "checkpoints" / "step5" and "run.resume names it" in choice.lines[0]
    step = choose_resume(resolve_path(TINY, [f"run.resume={root / 'checkpoints' / 'step5'}"]), tmp_path)
    assert step.checkpoint.dir == root / "checkpoints" / "step5"


def test_a_named_run_of_another_training_or_without_checkpoints_is_refused(tmp_path):
    root = _run_with_checkpoint(tmp_path, "20261201-000000", ["batch.seq_len=48"])
    with pytest.raises(ResumeError, match="differs in seq_len"):
        choose_resume(resolve_path(TINY, [f"run.resume={root}"]), tmp_path)
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        choose_resume(resolve_path(TINY, [f"run.resume={tmp_path / 'nothing'}"]), tmp_path)


def test_a_relative_resume_path_is_made_absolute_at_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_path(TINY, ["run.resume=runs/x/1"]).recipe.run.resume == str(tmp_path / "runs" / "x" / "1")


@pytest.mark.parametrize("marker", [b"[1,2]", b"{}", b'{"step": 1e400, "backend": "deepspeed"}', "{'step': 5}".encode(),
                                    "{\"step\": 5, \"backend\": \"d\u00e9\"}".encode("latin-1"), b'{"step": true}',
                                    b'{"step": 5, "backend": "deepspeed", "zero_stage": 2, "tp": 1, "dp": 2, "identity": null}'])
def test_a_damaged_marker_is_passed_over_with_a_note_never_a_traceback(tmp_path, marker):
    root = _run_with_checkpoint(tmp_path, "20261201-000000", [])
    (root / "checkpoints" / "step5" / "layoutlab_checkpoint.json").write_bytes(marker)
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    assert any("layoutlab_checkpoint.json: " in line and "not resumed" in line for line in choice.lines), choice.lines
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):  # named: refused in one line
        choose_resume(resolve_path(TINY, [f"run.resume={root}"]), tmp_path)


def test_a_marker_from_before_the_layout_was_part_of_the_identity_says_what_it_did_not_record(tmp_path):
    import json

    root = _run_with_checkpoint(tmp_path, "20261201-000000", [])
    path = root / "checkpoints" / "step5" / "layoutlab_checkpoint.json"
    info = json.loads(path.read_text())
    for key in ("backend", "tp", "pp", "vpp", "dp", "zero_stage", "offload_optimizer", "offload_params",
                "micro_batch_size"):
        info["identity"].pop(key)  # what markers held before: the training only, the layout beside it
    path.write_text(json.dumps(info))
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    note = choice.lines[0].split("differs in ")[1]
    assert "micro_batch_size (not recorded)" in note and "backend" not in note and "zero_stage" not in note


@pytest.mark.parametrize("value", ["Auto", "NEVER", ""])
def test_a_misspelt_resume_mode_is_refused_not_taken_as_a_path(value):
    from launch.errors import ConfigError

    with pytest.raises(ConfigError, match="is neither auto, never nor a path"):
        resolve_path(TINY, [f"run.resume={value}"])
