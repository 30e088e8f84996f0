"""The recommender's enumeration and ranking, and the sweep's refusals and dry run (no ranks start)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.commands.cli import main
from launch.config.resolve import resolve_path
from launch.plan.search import candidates, layouts, ranked, search
from launch.run import envinfo

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_every_layout_of_two_cpu_ranks_is_enumerated():
    base = resolve_path(RECIPES / "tiny_zero2", [])
    labels = [label for label, _ in layouts(base)]
    assert len(labels) == len(set(labels))
    ds = [x for x in labels if x.startswith("deepspeed")]
    # tp1 × dp2: 4 ZeRO stages × 2 checkpointing modes × micro-batches 1, 2, 4 (global 8 / dp 2); tp2 × dp1: × 1, 2, 4, 8.
    # No offload on CPU ranks, no pp or sp on the DeepSpeed backend.
    assert len(ds) == 4 * 2 * 3 + 4 * 2 * 4
    mg = [x for x in labels if x.startswith("megatron")]
    assert any(" pp2 " in x for x in mg) and any(" sp" in x for x in mg) and not any(" off=" in x for x in labels)


def test_ranking_holds_only_what_fits_and_what_the_resolver_builds():
    cands = candidates(str(RECIPES / "tiny_zero2"), [])
    fit = ranked(cands)
    assert fit and all(c.fits for c in fit) and len(fit) == sum(c.fits for c in cands)
    refused = [c for c in cands if c.plan is None]
    # Megatron's PP/SP × ZeRO-2/3 (48); torch DDP with TP 2, with and without SP, or with PP 2: 3 × 3 checkpointing
    # modes × micro-batches 1, 2, 4, 8 (36); torch PP 2 at micro-batch 8, one micro-batch for two stages: stages 2, 3
    # × 3 checkpointing modes (6).
    by_field = {c.refused.split(":")[0] for c in refused}
    assert len(refused) == 48 + 36 + 6 and by_field == {"parallel.zero_stage", "batch.global_batch_size"}
    assert sum(c.refused.startswith("batch.global_batch_size") for c in refused) == 6
    # The nominal cpu profile: every extra all-reduce costs its nominal latency, so of two layouts differing only
    # in stage, ZeRO-0 (one gradient all-reduce) ranks above ZeRO-3 (a gather per persistent parameter).
    order = [c.label for c in fit]
    assert order.index("deepspeed tp1 pp1 dp2 z0 mb4") < order.index("deepspeed tp1 pp1 dp2 z3 mb4")


def test_calibrated_layouts_are_ranked_apart_from_nominal_ones(tmp_path):
    import dataclasses

    from tests.unit.test_calibration import _calibration, _write

    calib = _calibration()
    ds_only = dataclasses.replace(calib, compute=dataclasses.replace(
        calib.compute, passes=tuple(p for p in calib.compute.passes if p.backend == "deepspeed")))
    cands = candidates(str(RECIPES / "tiny_zero2"), [f"hardware.profile={_write(tmp_path, ds_only, 'ds.json')}"], envinfo.machine())
    fit = ranked(cands)
    # Without Megatron's and torch's passes only the deepspeed backend's layouts are timed: theirs stay out.
    assert fit and {c.plan.step.timing for c in fit} == {"calibrated"}
    assert all(c.label.startswith("deepspeed") for c in fit)
    assert any(c.fits and c.label.startswith("megatron") for c in cands)
    assert any(c.fits and c.label.startswith("torch") for c in cands)
    # With them, every backend's layouts are ranked together.
    both = ranked(candidates(str(RECIPES / "tiny_zero2"), [f"hardware.profile={_write(tmp_path, calib)}"], envinfo.machine()))
    assert {c.label.split()[0] for c in both} == {"deepspeed", "megatron", "torch"}


def test_offload_is_tried_only_where_the_layout_does_not_fit_without_it():
    cands = candidates(str(RECIPES / "7b_tp2_zero3"), ["hardware.nodes=1", "hardware.gpus_per_node=4"])
    labels = {c.label for c in cands}
    for c in cands:
        if " off=" in c.label:
            plain = next(x for x in cands if x.label == c.label.split(" off=")[0])
            assert not plain.fits, c.label
    assert any(" off=" in x for x in labels)


def test_no_layout_fits_names_the_closest(capsys):
    rc = main(["recommend", str(RECIPES / "tiny_zero2"), "model.name=llama-2-7b", "batch.seq_len=4096"])
    out = capsys.readouterr().out
    assert rc == 1 and "no layout fits; the closest is" in out and "GiB" in out


@pytest.mark.parametrize("arg, says", [("top=0", "top"), ("verify=yes", "verify"), ("steps=x", "steps")])
def test_recommend_bad_own_arguments(capsys, arg, says):
    assert main(["recommend", str(RECIPES / "tiny_zero2"), arg]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err


def test_sweep_refuses_a_set_that_is_not_held_equal(capsys):
    rc = main(["sweep", str(RECIPES / "tiny_zero2"), str(RECIPES / "0.5b_t4_zero2_ac"), "hardware.profile=cpu",
               "precision.dtype=fp32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    # 0.5b_t4_zero2_ac trains another global batch than tiny_zero2: both values named, with the fix.
    assert "batch.global_batch_size" in err and "differs from tiny_zero2's 8" in err
    assert "hold it equal on the command line" in err


def test_sweep_dry_run_prints_the_plan_table_for_the_set(capsys):
    # tiny_tp2_zero3 extends tiny_zero2: the same batch, sequence length and steps, on 4 ranks instead of 2.
    rc = main(["sweep", str(RECIPES / "tiny_zero2"), str(RECIPES / "tiny_tp2_zero3"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("│ tiny")]
    assert [r.split("│")[1].strip() for r in rows] == ["tiny_zero2", "tiny_tp2_zero3"]
    assert all("yes" in r for r in rows)


@pytest.mark.parametrize("args, says", [([str(RECIPES / "tiny_zero2")], "fewer than two recipes"),
                                        ([str(RECIPES / "tiny_zero2"), str(RECIPES / "tiny_zero2"), "--fast"],
                                         "is not a flag of sweep.sh")])
def test_sweep_usage_errors(capsys, args, says):
    assert main(["sweep", *args]) == 2
    assert says in capsys.readouterr().err


def test_feed_back_writes_a_new_calibration_only_from_calibrated_predictions(tmp_path):
    from rich.console import Console

    from launch.commands.recommend import _feed_back
    from launch.commands.sweep import Measured, member
    from tests.unit.test_calibration import _calibration, _write

    original = json.dumps(_calibration().to_dict())
    console = Console(file=open(tmp_path / "out.txt", "w"), width=200)
    nominal = member("n", str(RECIPES / "tiny_zero2"), [])
    _feed_back([Measured(nominal, tmp_path, 0, 0.03, 0.001)], console)
    path = _write(tmp_path, _calibration())
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["calib.json"]  # nothing written for a nominal plan
    m = member("c", str(RECIPES / "tiny_zero2"), [f"hardware.profile={path}"])
    _feed_back([Measured(m, tmp_path, 0, 0.03, 0.001), Measured(m, tmp_path, 0, 0.06, 0.001)], console)
    (fed,) = tmp_path.glob("calib.verified-*.json")
    doc = json.loads(fed.read_text())
    predicted = m.plan.step.total_s
    assert doc["correction"] == pytest.approx(((0.03 / predicted) * (0.06 / predicted)) ** 0.5, rel=1e-12)
    assert path.read_text() == original  # the original untouched


def test_every_candidate_is_either_ranked_or_dropped_with_a_counted_reason(tmp_path):
    from launch.plan.search import recommend
    from tests.unit.test_calibration import _calibration, _write

    path = _write(tmp_path, _calibration())
    cands = candidates(str(RECIPES / "tiny_zero2"), [f"hardware.profile={path}"], envinfo.machine())
    rec = recommend(cands)
    assert rec.tried == len(cands) == len(rec.ranked) + sum(n for _, n in rec.dropped)
    reasons = dict(rec.dropped)
    # 48 Megatron PP/SP × ZeRO-2/3 layouts and 36 torch DDP × TP or PP ones cannot be built; every fitting layout,
    # pipelines included (a calibration times their stages), is ranked on the calibration.
    assert sum(n for why, n in reasons.items() if why.startswith("parallel.zero_stage")) == 48 + 36
    pipelined_fit = sum(c.fits and " pp1 " not in c.label for c in cands)
    assert sum(" pp1 " not in c.label for c in rec.ranked) == pipelined_fit > 0
    assert not [why for why in reasons if why.startswith("not ranked")]


def _calibrate_into(runs: Path, stamp: str, calib, name: str = "calibration.json") -> Path:
    """A calibration where `calibrate` leaves one: runs/calibration/<stamp>/<name>."""
    from tests.unit.test_calibration import _write

    folder = runs / "calibration" / stamp
    folder.mkdir(parents=True, exist_ok=True)
    return _write(folder, calib, name)


@pytest.fixture(autouse=True)
def _own_runs_folder(tmp_path, monkeypatch):
    """recommend reads calibrations from the runs folder: these tests must not see the developer's ./runs."""
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))


WANT = dict(base_profile="cpu", world_size=2, ranks_per_node=2, model="tiny-llama", dtype="fp32", seq_len=64)


def _this_machine() -> dict:
    from launch.run import envinfo

    return dict(machine_kind=envinfo.machine_kind(), versions=envinfo.package_versions(), **WANT)


def test_only_a_calibration_of_this_machine_model_and_world_is_found(tmp_path):
    import dataclasses

    from launch.config.calibration import newest_for
    from tests.unit.test_calibration import _calibration

    mine = _calibration()
    old = _calibrate_into(tmp_path, "20261201-000000", mine)
    # Newer ones that do not apply, each for one reason, and damaged ones: none of them is taken.
    later = iter(f"2026-12-02T00:00:{i:02d}+00:00" for i in range(60))
    compute = mine.compute
    for bad in (dict(machine_kind="8 × NVIDIA H100 80GB HBM3"), dict(base_profile="h200"),
                dict(world_size=4), dict(ranks_per_node=1), dict(compute=None),
                dict(versions={**mine.versions, "torch": "1.0.0"}),
                dict(versions={**mine.versions, "deepspeed": "0.1.0"}),
                dict(compute=dataclasses.replace(compute, seq_len=128)),
                dict(compute=dataclasses.replace(compute, dtype="bf16",
                                                 fitted=dataclasses.replace(compute.fitted, dtype="bf16"))),
                dict(compute=dataclasses.replace(compute, model="tiny-qwen2"))):
        created = next(later)
        _calibrate_into(tmp_path, created[:19].replace(":", ""), dataclasses.replace(mine, created=created, **bad))
    _calibrate_into(tmp_path, "20261203-000000", '{"kind": "layoutlab-calibration", "version": 3, "created": "2')
    (tmp_path / "calibration" / "20261203-000001" / "calibration.json").mkdir(parents=True)
    (tmp_path / "calibration" / "20261203-000002").mkdir()
    (tmp_path / "calibration" / "20261203-000002" / "calibration.json").symlink_to(tmp_path / "nowhere.json")
    found = newest_for(tmp_path, **_this_machine())
    assert found.path == old
    # The damaged ones are named with their problem (the others are another machine's or model's, not damage).
    damaged = [str(tmp_path / "calibration" / s / "calibration.json")
               for s in ("20261203-000000", "20261203-000001", "20261203-000002")]  # cut short, a folder, a dangling link
    assert [u.split(": ", 1)[0] for u in found.unreadable] == damaged
    assert "cannot be read as JSON" in found.unreadable[0]
    assert newest_for(tmp_path / "nothing here", **_this_machine()).path is None


def test_the_newest_measurement_wins_then_its_copy_with_the_most_verified_runs(tmp_path):
    import dataclasses
    import os

    from launch.config.calibration import newest_for
    from tests.unit.test_calibration import _calibration

    mine = _calibration()
    # Measured later, but in a folder whose name sorts first and written first (older mtime): when it was measured
    # decides, not the folder's name or the file's age.
    newer = dataclasses.replace(mine, created="2026-12-05T00:00:00+00:00")
    fed = _calibrate_into(tmp_path, "00-renamed",
                          dataclasses.replace(newer, verified=({"layout": "x"},), correction=1.1),
                          "calibration.verified-20261205-010000.json")
    plain = _calibrate_into(tmp_path, "00-renamed", newer)
    older = _calibrate_into(tmp_path, "20261201-000000", mine)
    os.utime(fed, (1, 1))
    os.utime(plain, (2, 2))
    assert newest_for(tmp_path, **_this_machine()).path == fed
    # Of one measurement's copies, more verified runs first; then the later fed-back stamp.
    more = _calibrate_into(tmp_path, "00-renamed", dataclasses.replace(
        newer, verified=({"layout": "x"}, {"layout": "y"}), correction=1.1),
        "calibration.verified-20261205-000000.json")
    assert newest_for(tmp_path, **_this_machine()).path == more
    again = _calibrate_into(tmp_path, "00-renamed", dataclasses.replace(
        newer, verified=({"layout": "x"}, {"layout": "z"}), correction=1.2),
        "calibration.verified-20261205-020000.json")
    os.utime(again, (0, 0))
    assert newest_for(tmp_path, **_this_machine()).path == again
    assert older.exists()


def test_recommend_without_a_profile_ranks_on_this_machines_calibration(tmp_path, capsys, monkeypatch):
    from tests.unit.test_calibration import _calibration, _write

    runs = tmp_path / "runs"
    monkeypatch.setenv("COLUMNS", "240")
    path = _calibrate_into(runs, "20261201-000000", _calibration())
    assert main(["recommend", str(RECIPES / "tiny_zero2"), "top=3"]) == 0
    out = capsys.readouterr().out
    assert f"timed with {path}" in out and "hardware.profile=cpu gives nominal figures" in out
    assert "passed over" not in out
    rows = [line for line in out.splitlines() if line.startswith("│ ")]
    assert len(rows) == 3 and all("calibrated" in r for r in rows)
    # A profile named on the command line is used as asked, however the key is spelled.
    for named in ("hardware.profile=cpu", " hardware.profile = cpu"):
        assert main(["recommend", str(RECIPES / "tiny_zero2"), "top=3", named]) == 0
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith("│ ")]
        assert "timed with" not in out and len(rows) == 3 and all("nominal" in r for r in rows), named
    # A damaged calibration beside it is named in a warning, and the good one still used.
    damaged = _calibrate_into(runs, "20261202-000000", path.read_text()[:100])
    assert main(["recommend", str(RECIPES / "tiny_zero2"), "top=3"]) == 0
    out = capsys.readouterr().out
    assert f"warning: passed over 1 calibration file(s) that cannot be read, e.g. {damaged}: " in out
    assert f"timed with {path}" in out
    # So is a recipe whose own profile is a calibration: that file, not the newest one.
    own = _write(tmp_path, _calibration(created="2026-11-01T00:00:00+00:00"), "own.json")
    recipe = tmp_path / "recipes" / "calibrated"
    recipe.mkdir(parents=True)
    (recipe / "recipe.toml").write_text(f'extends = "{RECIPES / "tiny_zero2"}"\n[hardware]\nprofile = "{own}"\n')
    assert main(["recommend", str(recipe), "top=3"]) == 0
    out = capsys.readouterr().out
    assert "timed with" not in out and "calibrated on" in out and "2026-11-01" in out


def test_run_and_sweep_plan_with_this_machines_calibration_too(tmp_path, capsys, monkeypatch):
    """One time source: after `calibrate`, run.sh --dry-run and sweep.sh --dry-run time with the same file recommend
    finds, and say so; a profile named on the command line still wins."""
    from tests.unit.test_calibration import _calibration

    monkeypatch.setenv("COLUMNS", "240")
    path = _calibrate_into(tmp_path / "runs", "20261201-000000", _calibration())
    assert main(["run", str(RECIPES / "tiny_zero2"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"timed with {path}" in out and "time: calibrated on" in out
    assert main(["sweep", str(RECIPES / "tiny_zero2"), str(RECIPES / "tiny_zero2"), "batch.micro_batch_size=4",
                 "--dry-run"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")]
    assert len(rows) == 2 and all("calibrated" in r for r in rows), rows
    assert main(["run", str(RECIPES / "tiny_zero2"), "hardware.profile=cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "timed with" not in out and "time: calibrated" not in out


def test_the_sweeps_measured_step_time_is_the_reports(tmp_path):
    """The console line `N ms measured` and the report's median step time are one number: warm-up left out, each
    step its slowest rank's (rank 1 is made slower here, so rank 0's own median would differ)."""
    from analysis.report import build_report
    from launch.commands.sweep import median_step_time
    from launch.run.rundir import RunDir
    from tests.unit.report_support import make_run_dir

    d = make_run_dir(tmp_path)
    f = d / "metrics" / "rank1.jsonl"
    records = [json.loads(line) for line in f.read_text().splitlines()]
    f.write_text("".join(json.dumps({**r, "step_time_s": r["step_time_s"] * 1.5} if r["kind"] == "step" else r) + "\n"
                         for r in records))
    measured, _ = median_step_time(RunDir.open(d))
    report = build_report([("run", d)]).runs[0].stats.rows()
    assert measured == pytest.approx(next(report)["step_time_median_s"], rel=1e-12)
    rank0 = sorted(r["step_time_s"] for r in records if r["kind"] == "step" and not r["warmup"])
    assert measured != pytest.approx(rank0[len(rank0) // 2])


def test_plan_times_a_world_size_with_this_machines_calibration(tmp_path, capsys, monkeypatch):
    from tests.unit.test_calibration import _calibration

    monkeypatch.chdir(tmp_path)
    path = _calibrate_into(tmp_path / "runs", "20261201-000000", _calibration())
    args = ["plan", "model=tiny-llama", "hardware=cpu", "dtype=fp32", "seq_len=64", "micro_batch_size=4",
            "global_batch_size=8", f"out={tmp_path / 'p'}"]
    assert main([*args, "world_size=2"]) == 0
    assert f"world size 2: timed with {path}" in capsys.readouterr().out
    rows = json.loads((tmp_path / "p.json").read_text())
    assert any(r["plan"]["step"]["timing"] == "calibrated" for r in rows)
    assert main([*args, "world_size=4"]) == 0  # measured on 2 ranks: a world of 4 stays nominal
    assert "timed with" not in capsys.readouterr().out
    assert all(r["plan"]["step"]["timing"] == "nominal" for r in json.loads((tmp_path / "p.json").read_text()))


def test_sweeps_and_verifications_run_in_folders_of_their_own(tmp_path, monkeypatch):
    """Their members never land in runs/<recipe>/, where run.resume=auto of a later run.sh would look."""
    from launch.commands.sweep import sweep_folder

    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    a, b = sweep_folder("sweep"), sweep_folder("recommend")
    assert a.parent == b.parent == tmp_path / "runs" / "sweeps" and a != b
    assert a.name.startswith("sweep-") and b.name.startswith("recommend-")
    assert sweep_folder("sweep") != a  # claimed, never joined


def test_sweep_members_write_no_final_checkpoint_unless_asked():
    from launch.commands.sweep import member

    default = member("a", str(RECIPES / "tiny_zero2"), [])
    asked = member("b", str(RECIPES / "tiny_zero2"), ["run.save_final=true"])
    assert default.resolved.recipe.run.save_final is False and asked.resolved.recipe.run.save_final is True
    assert resolve_path(RECIPES / "tiny_zero2", []).recipe.run.save_final is True  # a run's own default


def test_piped_recommend_keeps_every_number_whole_and_every_message_on_one_line(tmp_path):
    """Piped or under 120 columns the table showed `st…` and `28…`, and the dropped reasons wrapped mid-phrase:
    columns now narrow by kind (headers wrap at their spaces, the bar goes first) and piped text is not wrapped. The
    oracle is the ranking itself (plan.search.search, as recommend calls it): its figures appear in the output as
    written at every width."""
    import os
    import re
    import subprocess
    import sys

    from tests.conftest import REPO

    recipe = str(RECIPES / "tiny_zero2")  # LAYOUTLAB_RUNS below holds no calibration: nominal figures both sides
    rec = search(recipe, [], envinfo.machine())
    fit = rec.ranked
    want = [(f"{c.plan.step.total_s * 1e3:.1f}", f"{c.plan.step.tokens_per_s_per_device:,.0f}") for c in fit[:3]]
    for width in ("60", "80", "100"):
        env = {**os.environ, "COLUMNS": width, "LAYOUTLAB_RUNS": str(tmp_path)}
        out = subprocess.run([sys.executable, "-m", "launch", "recommend", recipe, "top=3"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120).stdout
        rows = [line for line in out.splitlines() if re.match(r"│ \d+ │", line)]
        assert "…" not in "".join(rows), (width, out)
        for row, (step_ms, tokens) in zip(rows, want, strict=True):
            cells = [c.strip() for c in row.strip("│").split("│")]
            assert cells[2] == step_ms and cells[3] == tokens, (width, row)
        for why, n in rec.dropped:  # each reason whole on its own line
            assert f"  dropped {n}: {why}" in out.splitlines(), (width, why, out)
        assert all(line.startswith(("  ", "recommend", "layouts", "┏", "┃", "┡", "│", "└")) for line in
                   out.splitlines() if line), (width, out)


@pytest.mark.parametrize("dry", [True, False])
def test_sweep_checks_every_members_data_as_run_sh_does(tmp_path, capsys, monkeypatch, dry):
    """sweep.sh --dry-run passed a missing corpus that run.sh --dry-run refuses, and the real sweep then made member run
    directories that each failed: the sweep checks every member's inputs first, before its folder exists."""
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    bad = tmp_path / "missing.jsonl"
    argv = ["sweep", str(RECIPES / "tiny_zero2"), str(RECIPES / "tiny_tp2_zero3"), 'data.source="text"',
            f"data.path={bad}", *(["--dry-run"] if dry else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f'data.path="{bad}" does not exist' in err, err
    assert not (tmp_path / "runs").exists()
