"""Files a command reads for itself inside what the user points at (checkpoint and export markers, a rehearsal's
record, a weights folder's configs, commbench results, an earlier plan at out=, whatever `python -m analysis` is
given): a FIFO there is named and never opened (its open would wait for a writer for ever), and a document nested
past Python's recursion is a note or one line, never a RecursionError. Issue 49's third hostile pass found each."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.errors import ConfigError
from tests.conftest import REPO, RECIPES

pytestmark = pytest.mark.timeout(60)  # a FIFO opened by mistake blocks: fail, do not hang the suite
DEEP = "[" * 100_000 + "]" * 100_000


def _marker(step_dir: Path, text: str | None) -> Path:
    step_dir.mkdir(parents=True)
    marker = step_dir / "layoutlab_checkpoint.json"
    if text is None:
        os.mkfifo(marker)
    else:
        marker.write_text(text)
    return marker


@pytest.mark.parametrize("content, says", [(DEEP, "nests too deep"), (None, "is a FIFO (named pipe)")])
def test_a_checkpoint_marker_nested_past_the_parser_or_a_fifo_is_named_and_passed_over(tmp_path, content, says):
    from launch.run.checkpoints import complete_checkpoints

    _marker(tmp_path / "checkpoints" / "step3", content)
    damaged: list[str] = []
    assert complete_checkpoints(tmp_path / "checkpoints", damaged) == []
    (note,) = damaged
    assert "step3" in note and says in note


def test_run_resume_naming_a_lying_marker_says_what_it_says(tmp_path):
    from launch.config.resolve import resolve_path
    from launch.run.checkpoints import ResumeError, explicit_resume

    step = tmp_path / "checkpoints" / "step3"
    _marker(step, json.dumps({"step": 99, "zero_stage": 2, "tp": 1, "dp": 2, "backend": "deepspeed"}))
    with pytest.raises(ResumeError, match=r"holds no complete checkpoint .*step=99 is not its folder's \(step3\)"):
        explicit_resume(step, resolve_path(RECIPES / "tiny_zero2", []))


@pytest.mark.parametrize("content", [None, DEEP])
def test_an_export_or_rehearsal_record_that_is_a_fifo_or_too_deep_is_not_ours(tmp_path, content):
    from launch.run.rehearsal import REHEARSAL, is_our_rehearsal
    from launch.run.rundir import EXPORT_MARKER, is_our_export

    for name, ours in ((EXPORT_MARKER, is_our_export), (REHEARSAL, is_our_rehearsal)):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        if content is None:
            os.mkfifo(folder / name)
        else:
            (folder / name).write_text(content)
        assert ours(folder) is False


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("content, says", [(None, "is a FIFO (named pipe)"), (DEEP, "nests too deep")])
def test_a_weights_folders_config_that_is_a_fifo_or_too_deep_is_one_line(tmp_path, name, content, says):
    from launch.config.resolve import resolve_path
    from launch.run.launcher import weights_preflight

    (tmp_path / "model.safetensors").write_bytes(b"")
    if content is None:
        os.mkfifo(tmp_path / name)
    else:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError) as e:
        weights_preflight("recipe.toml", tmp_path, resolve_path(RECIPES / "tiny_zero2", []).model)
    assert says in str(e.value) and "\n" not in str(e.value)


def _analysis(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=50)


def test_analysis_names_a_fifo_it_is_given_and_never_opens_it(tmp_path):
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    run = tmp_path / "run" / "commbench"
    run.mkdir(parents=True)
    os.mkfifo(run / "all_reduce.json")
    doctor = _analysis("doctor", str(fifo))
    assert doctor.returncode == 0 and "trace.json: is a FIFO (named pipe)" in doctor.stdout, doctor.stdout
    busbw = _analysis("busbw", str(fifo), "-o", str(tmp_path / "b.png"))
    assert "trace.json: cannot be read as a commbench result (is a FIFO (named pipe))" in busbw.stderr, busbw.stderr
    assert busbw.returncode != 0
    report = _analysis("report", str(tmp_path / "run"), "-o", str(tmp_path / "r.md"))
    assert report.returncode == 0 and "all_reduce.json — skipped: is a FIFO (named pipe)" in (tmp_path / "r.md").read_text()


def test_busbw_reads_past_a_commbench_result_that_is_a_fifo(tmp_path):
    from analysis.parsers.commbench import load

    (tmp_path / "commbench").mkdir()
    os.mkfifo(tmp_path / "commbench" / "all_gather.json")
    groups, warnings = load([tmp_path / "commbench" / "all_gather.json"])
    assert groups == {} and any("is a FIFO (named pipe)" in w for w in warnings), warnings


def test_a_checkpoint_holding_a_fifo_is_refused_before_anything_reads_it(tmp_path):
    # the untrusted check opened every shard (and DCP's .metadata) to read its pickle: a FIFO there blocked run.sh's
    # resume and export for ever
    for name in ("mp_rank_00_model_states.pt", ".metadata"):
        folder = tmp_path / name.strip(".")
        folder.mkdir()
        os.mkfifo(folder / name)
        p = subprocess.run([sys.executable, "-m", "launch.torchtools.untrusted", str(folder)], cwd=REPO,
                           capture_output=True, text=True, timeout=50)
        assert p.returncode == 2
        assert p.stderr.strip() == f"error: {folder / name}: is a FIFO (named pipe); a checkpoint holds regular files only"


def test_a_fifo_in_a_runs_place_of_metrics_or_as_the_ceiling_is_named_not_read(tmp_path):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "resolved.json").write_text("{}")  # a run directory of ours by its record
    os.mkfifo(run / "metrics" / "rank0.jsonl")
    os.mkfifo(tmp_path / "ceiling.txt")
    report = _analysis("report", str(run), "-o", str(tmp_path / "r.md"))
    assert report.returncode == 0 and "rank0.jsonl — skipped: is a FIFO (named pipe)" in (tmp_path / "r.md").read_text()
    doctor = _analysis("doctor", str(run))
    assert doctor.returncode == 0 and "rank0.jsonl — skipped: is a FIFO (named pipe)" in doctor.stdout, doctor.stdout
    ceiling = _analysis("doctor", str(run), f"ceiling={tmp_path / 'ceiling.txt'}")
    assert ceiling.returncode == 2 and "ceiling.txt: is a FIFO (named pipe)" in ceiling.stderr, ceiling.stderr


def test_busbw_refuses_an_output_that_is_an_input_a_dangling_link_or_someone_elses_png(tmp_path):
    nccl = REPO / "tests" / "fixtures" / "nccl" / "c_allreduce_v2_13_8xh100.txt"
    given = tmp_path / "a.txt"
    given.write_bytes(nccl.read_bytes())
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(b"\x89PNG someone's figure")
    for out, says in ((given, "is not a .png"), (tmp_path / "dangling.png", "is a symlink to nothing"),
                      (theirs, "was not written by python -m analysis busbw")):
        p = _analysis("busbw", str(given), "-o", str(out))
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert given.read_bytes() == nccl.read_bytes() and theirs.read_bytes() == b"\x89PNG someone's figure"
    ours = tmp_path / "ours.png"
    for _ in range(2):  # an earlier plot of ours is replaced
        p = _analysis("busbw", str(given), "-o", str(ours))
        assert p.returncode == 0 and p.stdout.strip() == str(ours), p.stderr


def test_prepare_data_says_when_documents_hold_no_text(tmp_path):
    """20 lines of {"text": ""} were prepared as 20 documents without a word; run.sh then refused the corpus."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": ""}\n' * 19 + '{"text": "one real line"}\n')
    p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(corpus), f"out={tmp_path / 'o' / 'c'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    assert "warning: 19 of the 20 documents hold no text: each is its end-of-document token alone" in p.stderr, p.stderr
