"""`python -m launch export out=` never replaces or deletes what it did not write: a folder of someone else's files
(transformers' save_pretrained deletes the shards it finds there), a file, a dangling link; refused in one line, exit
2, before the export starts (issue 29, in part)."""
import os

import pytest

from launch.commands.cli import main
from launch.run.rundir import EXPORT_MARKER, export_target_problem
from tests.unit.report_support import make_run_dir


@pytest.mark.parametrize("kind", ["shards", "file", "dangling"])
def test_an_out_that_holds_the_users_files_is_refused_untouched(tmp_path, capsys, kind):
    run = make_run_dir(tmp_path / "runs", traces=False)
    out = tmp_path / "out"
    if kind == "shards":
        out.mkdir()
        for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
            (out / name).write_text(name)
    elif kind == "file":
        out.write_text("a file of mine")
    else:
        out.symlink_to(tmp_path / "nowhere")
    before = sorted((p.name, p.read_text()) for p in out.iterdir()) if out.is_dir() else os.readlink(out) \
        if out.is_symlink() else out.read_text()
    assert main(["export", str(run), f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'out="' in err
    after = sorted((p.name, p.read_text()) for p in out.iterdir()) if out.is_dir() else os.readlink(out) \
        if out.is_symlink() else out.read_text()
    assert after == before


def test_an_empty_folder_or_an_earlier_export_of_ours_may_receive_one(tmp_path):
    assert export_target_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert export_target_problem(tmp_path / "empty") is None
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "model.safetensors").write_text("x")
    assert "did not write (model.safetensors, ...)" in export_target_problem(ours)
    (ours / EXPORT_MARKER).write_text('{"files": ["config.json", "model.safetensors"]}')
    assert export_target_problem(ours) is None
    # a file the user added to an earlier export (a model card) makes it theirs: never replaced, never deleted
    (ours / "README.md").write_text("my model card")
    assert "did not write" in export_target_problem(ours)
    (ours / "README.md").unlink()
    (ours / EXPORT_MARKER).write_text("{}")  # a marker that lists nothing vouches for nothing
    assert "did not write" in export_target_problem(ours)
    link = tmp_path / "link"
    link.symlink_to(ours)
    assert "is a symlink" in export_target_problem(link)  # a swap would replace the link, rmtree follow it


def test_a_stale_run_dir_in_the_environment_never_joins_an_earlier_run(tmp_path, capsys, monkeypatch):
    """LAYOUTLAB_RUN_DIR left in the shell from an earlier launch: node 0 refuses to append to that run (issue 29)."""
    from tests.conftest import RECIPES

    earlier = make_run_dir(tmp_path / "runs", traces=False)
    before = {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()}
    monkeypatch.setenv("LAYOUTLAB_RUN_DIR", str(earlier))
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    assert main(["run", str(RECIPES / "tiny_zero2"), "train.steps=12"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LAYOUTLAB_RUN_DIR" in err and "node 0 never joins one" in err
    assert {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("plant", ["link", "fifo", "logs link"])
def test_the_export_log_is_never_written_through_what_a_run_directory_holds(tmp_path, plant):
    """A run directory from elsewhere whose logs/export.err is a link to the user's file: export appended torch's
    warnings to it. Now only a regular file of its own is appended to; anything else sends them to a temporary file."""
    import warnings

    from launch.torchtools.export import warnings_to

    victim = tmp_path / "mine.txt"
    victim.write_text("my notes\n")
    logs = tmp_path / "run" / "logs"
    if plant == "logs link":
        (tmp_path / "elsewhere").mkdir()
        logs.parent.mkdir()
        logs.symlink_to(tmp_path / "elsewhere")
    else:
        logs.mkdir(parents=True)
        if plant == "link":
            (logs / "export.err").symlink_to(victim)
        else:
            os.mkfifo(logs / "export.err")
    before = warnings.showwarning
    try:
        warnings_to(logs / "export.err")
        warnings.warn("a library's advice", UserWarning, stacklevel=1)
    finally:
        warnings.showwarning = before
    assert victim.read_text() == "my notes\n"
    if plant == "logs link":
        assert not any((tmp_path / "elsewhere").iterdir())


def test_an_export_folder_that_is_a_link_inside_the_run_is_refused(tmp_path, capsys):
    run = make_run_dir(tmp_path / "runs", traces=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (run / "export").symlink_to(theirs)
    (run / "checkpoints" / "step12" / "layoutlab_checkpoint.json").write_text(
        '{"step": 12, "backend": "deepspeed", "zero_stage": 2, "tp": 1, "dp": 2}')
    assert main(["export", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link inside the run directory" in err and err.count("\n") == 1
    assert not any(theirs.iterdir())


def test_a_merge_onto_other_weights_than_the_runs_base_is_refused(tmp_path, capsys):
    """merge=true adds the adapters to the base the run's recipe names, read again at export: other weights put
    there since (same names, same shapes, other values) would merge silently into a model the adapters never saw."""
    import shutil

    from launch.commands.run import check_inputs
    from launch.config.resolve import resolve_path
    from tests.conftest import RECIPES

    base = tmp_path / "base"
    shutil.copytree(RECIPES / "weights" / "tiny-llama2", base)
    resolved = check_inputs(resolve_path(RECIPES / "tiny_7b_lora_1gpu", [f'model.weights="{base}"']))[0]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "resolved.json").write_text(resolved.to_json() + "\n")
    assert main(["export", str(run), "merge=true"]) == 2  # the base is the run's: on to the checkpoint, which is missing
    assert "has no complete checkpoint" in capsys.readouterr().err
    blob = (base / "model.safetensors").read_bytes()
    start = 8 + int.from_bytes(blob[:8], "little")
    (base / "model.safetensors").write_bytes(blob[:start] + blob[start:][::-1])
    assert main(["export", str(run), "merge=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f'model.weights="{base}" no longer holds the base this run fine-tuned' in err
    assert main(["export", str(run)]) == 2  # the adapters alone need no base
    assert "has no complete checkpoint" in capsys.readouterr().err
