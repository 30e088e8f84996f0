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
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
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
    assert note.startswith(f"not resumed: an earlier run trains a different configuration (the newest, {root}, ")
    assert differs in note.split("differs in")[1]
    assert last.startswith("starting fresh")


def test_many_runs_of_other_configurations_are_one_line(tmp_path):
    """A newcomer's every run printed one 'not resumed' line per earlier run: they are counted in one."""
    for i, other in enumerate((["parallel.zero_stage=3"], ["batch.micro_batch_size=1"], ["parallel.zero_stage=1"])):
        newest = _run_with_checkpoint(tmp_path, f"2026120{i + 1}-000000", other)
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    assert choice.lines == (f"not resumed: 3 earlier runs of this recipe train a different configuration (the newest, "
                            f"{newest}, differs in zero_stage)",
                            "starting fresh: no earlier run of this recipe has this configuration")


def test_a_finished_run_is_not_continued_a_new_one_starts_and_says_so(tmp_path):
    """Re-running the quickstart after it finished trained nothing ('nothing to do'), and the Accelerate launch
    resumed a finished step-80 run of another train.steps: auto continues only an unfinished run."""
    done = _run_with_checkpoint(tmp_path, "20261201-000000", ["train.steps=8"], step=8)
    for steps in (8, 12):
        choice = choose_resume(resolve_path(TINY, [f"train.steps={steps}"]), tmp_path / "tiny_zero2")
        assert choice.checkpoint is None
        assert choice.lines == (f"starting a new run: the newest run of this configuration, {done}, finished at step 8 "
                                f"(run.resume={done} continues it where its schedule allows)",)


def test_an_unfinished_run_whose_schedule_would_stretch_is_passed_over_and_named(tmp_path):
    """A cosine schedule laid over 20 steps, cut at step 12, continued over 40 would jump from lr_at(12, total=20) to
    lr_at(12, total=40): computed here from the cosine formula itself."""
    import math

    cut = _run_with_checkpoint(tmp_path, "20261201-000000", ["train.steps=20"], step=12)
    t = resolve_path(TINY, ["train.steps=40"]).recipe.train
    assert t.lr_schedule == "cosine"

    def cosine(total):
        progress = (12 - t.lr_warmup_steps) / (total - t.lr_warmup_steps)
        return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    choice = choose_resume(resolve_path(TINY, ["train.steps=40"]), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    (line,) = choice.lines
    assert line.startswith(f"starting a new run: the newest run of this configuration, {cut}, train.steps=40 "
                           "re-stretches the cosine learning-rate schedule its run laid over 20 steps: step 13 would "
                           f"train at {cosine(40):.3g} where that schedule gives {cosine(20):.3g}"), line
    assert choose_resume(resolve_path(TINY, ["train.steps=20"]), tmp_path / "tiny_zero2").checkpoint.step == 12


def test_extending_a_finished_run_is_refused_unless_its_schedule_continues(tmp_path):
    done = _run_with_checkpoint(tmp_path, "20261201-000000", ["train.steps=8"], step=8)
    with pytest.raises(ResumeError, match=r"re-stretches the cosine .* resume it with train.steps=8"):
        choose_resume(resolve_path(TINY, [f"run.resume={done}", "train.steps=16"]), tmp_path)
    flat = _run_with_checkpoint(tmp_path, "20261202-000000", ["train.steps=8", "train.lr_schedule=constant"], step=8)
    choice = choose_resume(resolve_path(TINY, [f"run.resume={flat}", "train.steps=16", "train.lr_schedule=constant"]),
                           tmp_path)
    assert choice.checkpoint.dir == flat / "checkpoints" / "step8"


def test_a_marker_whose_step_is_not_its_folders_is_not_resumed(tmp_path):
    import json

    root = _run_with_checkpoint(tmp_path, "20261201-000000", [], step=3)
    path = root / "checkpoints" / "step3" / "layoutlab_checkpoint.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "step": 99}))
    choice = choose_resume(resolve_path(TINY, []), tmp_path / "tiny_zero2")
    assert choice.checkpoint is None
    assert any("step=99 is not its folder's (step3)" in line for line in choice.lines), choice.lines


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


def test_the_accelerate_export_decides_as_run_sh_and_pins_it_in_its_command(tmp_path, monkeypatch, capsys):
    """The command export-accelerate prints resumed another run's finished checkpoint when Accelerate started it: the
    choice is now made at export, by run.sh's rule, and travels in the command (an empty pin: start fresh)."""
    import shlex

    from launch.commands.cli import main
    from launch.run.rankenv import RESUME_PINNED

    runs = tmp_path / "runs"
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(runs))
    for key in ("MASTER_ADDR", "MASTER_PORT", "LAYOUTLAB_RUN_DIR"):
        monkeypatch.delenv(key, raising=False)
    done = _run_with_checkpoint(runs, "20261201-000000", ["train.steps=8"], step=8)

    def pinned(out: str) -> str:
        assert main(["export-accelerate", str(TINY), "train.steps=8", f"out={tmp_path / out}"]) == 0
        printed = capsys.readouterr().out
        command = printed.strip().splitlines()[-1]
        (pin,) = [w.split("=", 1)[1] for w in shlex.split(command) if w.startswith(f"{RESUME_PINNED}=")]
        return pin, printed

    pin, printed = pinned("a")
    assert pin == "" and f"starting a new run: the newest run of this configuration, {done}, finished" in printed
    cut = _run_with_checkpoint(runs, "20261202-000000", ["train.steps=8"], step=4)
    pin, printed = pinned("b")
    assert pin == str(cut / "checkpoints" / "step4") and f"resuming {cut} at step 4" in printed


@pytest.mark.parametrize("saved, now", [(1, 2), (2, 1)])
def test_megatron_zero1_and_zero2_checkpoints_do_not_cross(tmp_path, saved, now):
    """On the deepspeed backend ZeRO-1 and ZeRO-2 checkpoints load into each other (DeepSpeed's own files); on the
    megatron backend ZeRO-1 is Megatron's distributed optimizer and ZeRO-2 DeepSpeed's, so a checkpoint of one is
    refused before launch at the other, naming both stages."""
    from launch.run.checkpoints import Checkpoint, check_resume_compatible

    mc = RECIPES / "tiny_tp2_sp"
    base = ["parallel.tp=1", "parallel.sp=false", "hardware.gpus_per_node=2", "batch.micro_batch_size=2"]
    written = resolve_path(mc, [*base, f"parallel.zero_stage={saved}"])
    ckpt = Checkpoint(tmp_path, "step5", marker_info(written, 5))
    with pytest.raises(ResumeError) as e:
        check_resume_compatible(ckpt, resolve_path(mc, [*base, f"parallel.zero_stage={now}"]))
    assert f"zero_stage={saved}; this run has zero_stage={now}" in str(e.value) and "distributed optimizer" in str(e.value)
    ds = [resolve_path(TINY, [f"parallel.zero_stage={z}"]) for z in (saved, now)]
    assert check_resume_compatible(Checkpoint(tmp_path, "step5", marker_info(ds[0], 5)), ds[1]) is False


def test_a_fine_tune_continues_on_its_base_by_content_not_by_path(tmp_path):
    """A fine-tune's checkpoint holds the adapters alone. They continue on the same base weights moved to another
    folder, and not on other weights put where the base was (here: the same file with its tensor bytes past the
    header turned over, as a re-download of another revision would)."""
    import shutil

    from launch.commands.run import check_inputs

    base = RECIPES / "weights" / "tiny-llama2"
    first, moved, other = tmp_path / "first", tmp_path / "moved", tmp_path / "other"
    for folder in (first, moved, other):
        shutil.copytree(base, folder)
    blob = (other / "model.safetensors").read_bytes()
    start = 8 + int.from_bytes(blob[:8], "little")
    (other / "model.safetensors").write_bytes(blob[:start] + blob[start:][::-1])

    def checked(folder):
        return check_inputs(resolve_path(RECIPES / "tiny_7b_lora_1gpu", [f'model.weights="{folder}"']))[0]

    root = tmp_path / "runs" / "tiny_7b_lora_1gpu" / "20261201-000000"
    (root / "checkpoints" / "step5").mkdir(parents=True)
    write_marker(root / "checkpoints", "step5", marker_info(checked(first), 5))
    assert choose_resume(checked(moved), root.parent).checkpoint.dir == root / "checkpoints" / "step5"
    choice = choose_resume(checked(other), root.parent)
    assert choice.checkpoint is None and choice.lines[0].endswith("differs in base_weights)"), choice.lines
