"""Every writer, one property: for outputs drawn at random from a tree of a user's files (their notes, a folder of
shards, a file, a dangling link, the command's own inputs, a path under a file, a new path), a command either refuses
in one line (exit 2) with nothing changed, or changes only the outputs it declares. The tree is hashed before and
after each command (issue 29, part 6). HOSTILE_HUNT=20 draws twenty times as many."""
import hashlib
import os
import random
from pathlib import Path

import pytest

from analysis.__main__ import main as analysis_main
from launch.commands.cli import main
from tests.conftest import RECIPES, REPO
from tests.unit.report_support import make_run_dir

HUNT = int(os.environ.get("HOSTILE_HUNT", "1"))
DRAWS = 8 * HUNT


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and link under `root` (relative path -> content digest, or the link's target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    run = make_run_dir(root / "runs", traces=False)
    (root / "notes.md").write_text("my notes\n\n# layoutlab report\nsee above\n")
    (root / "shards").mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors"):
        (root / "shards" / name).write_text(name)
    (root / "file.txt").write_text("a file of mine")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "corpus.jsonl").write_text((REPO / "tests" / "fixtures" / "text" / "genesis.jsonl").read_text())
    return root, run


def _targets(root: Path, run: Path) -> list[str]:
    rel = os.path.relpath
    fixed = ["notes.md", "shards", "shards/config.json", "file.txt", "file.txt/sub", "dangling", "corpus.jsonl",
             rel(run, root), rel(run / "resolved.json", root), rel(run / "metrics" / "rank0.jsonl", root),
             rel(run / "checkpoints", root), rel(run / "checkpoints" / "step12", root), ".", "runs",
             "new/out", "new2/report"]
    return [str(root / t) if t != "." else str(root) for t in fixed]


def _declared(command: str, out: str, run: Path, root: Path) -> list[Path]:
    """What `command` may write for `out=` (files under these paths)."""
    o = Path(out)
    if command == "plan":
        return [Path(f"{out}.{ext}") for ext in ("png", "html", "json")]
    if command == "report":
        return [o, o.with_name(o.stem + "_plots")]
    if command == "prepare-data":
        return [Path(out + s) for s in (".bin", ".idx", ".prepared.json")]
    if command == "export":
        return [o, run / "logs" / "export.err"]
    return [o]  # export-accelerate: the new folder


def _run(command: str, out: str, run: Path, root: Path) -> int:
    if command == "plan":
        return main(["plan", "model=tiny-llama", "world_size=2", f"out={out}"])
    if command == "report":
        return analysis_main(["report", str(run), "-o", out])
    if command == "prepare-data":
        return main(["prepare-data", str(root / "corpus.jsonl"), f"out={out}"])
    if command == "export":
        return main(["export", str(run), f"out={out}"])
    return main(["export-accelerate", str(run), f"out={out}"])


@pytest.mark.parametrize("command", ["plan", "report", "prepare-data", "export", "export-accelerate"])
def test_a_writer_changes_only_what_it_declares(world, capsys, monkeypatch, command):
    root, run = world
    monkeypatch.chdir(root)
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(root / "runs"))
    rng = random.Random(f"{command}-{HUNT}")
    targets = _targets(root, run)
    fresh = [t for t in targets if "/new" in t]  # always one that is accepted: the writes it makes are checked too
    # prepare-data starts Megatron's builder for each accepted prefix (4 s): fewer draws
    draws = DRAWS // 2 if command == "prepare-data" else DRAWS
    # and always the dangling link: written through, it puts the output where the link points (prepare-data did)
    picks = rng.sample(targets, min(draws, len(targets))) + [rng.choice(fresh), str(root / "dangling")]
    if command == "report":  # a report's name carries its format
        picks = [p + rng.choice(["", ".md", ".html"]) if not p.endswith((".md",)) else p for p in picks]
    for out in picks:
        before = _snapshot(root)
        rc = _run(command, out, run, root)
        err = capsys.readouterr().err
        after = _snapshot(root)
        changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
        if rc == 2:
            assert err.count("\n") >= 1 and "Traceback" not in err, (out, err)
            assert not changed, (command, out, sorted(changed))
            continue
        assert rc == 0, (command, out, rc, err[-2000:])
        allowed = [Path(os.path.abspath(p)) for p in _declared(command, out, run, root)]
        for p in changed:
            full = Path(os.path.abspath(root / p))
            assert p not in before, (command, out, "replaced a file it had not written", p)
            assert any(full == a or a in full.parents for a in allowed), (command, out, "wrote outside", p)
        for p in set(before) - set(after):
            raise AssertionError((command, out, "deleted", p))


@pytest.mark.parametrize("root_kind", ["file", "loop", "under-file"])
def test_run_sweep_and_calibrate_never_create_under_a_runs_root_that_is_no_folder(tmp_path, capsys, monkeypatch,
                                                                                   root_kind):
    (tmp_path / "file.txt").write_text("a file of mine")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    runs = {"file": tmp_path / "file.txt", "loop": tmp_path / "a", "under-file": tmp_path / "file.txt" / "runs"}
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(runs[root_kind]))
    before = _snapshot(tmp_path)
    for argv in (["run", str(RECIPES / "tiny_zero2"), "train.steps=7"],
                 ["sweep", str(RECIPES / "tiny_zero2"), str(RECIPES / "tiny_ddp"), "train.steps=7"],
                 ["calibrate", str(RECIPES / "tiny_zero2")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "LAYOUTLAB_RUNS" in err, err
        assert _snapshot(tmp_path) == before
