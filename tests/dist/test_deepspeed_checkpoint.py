"""Checkpoints: resume with identical losses, reshard to another layout, refuse the impossible, export."""
import os
import signal
import subprocess
import time

import pytest

from launch.run.metrics import read_metrics
from launch.run.checkpoints import complete_checkpoints
from tests.conftest import REPO
from tests.dist.conftest import DS_DP2, EVERY_5, SHORT, ds_autotp, exported_losses, interrupted_copy, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CKPT = (*SHORT, *EVERY_5)
TOL = 1e-5


@pytest.fixture(scope="module")
def interrupted(shared_run):
    """`interrupted(runs, zero)`: in the runs folder `runs`, a copy of the shared 2-rank tiny_zero2 run at that ZeRO
    stage (DS_DP2: checkpoints every 5 steps) whose final save never completed (conftest.interrupted_copy)."""
    return lambda runs, zero: interrupted_copy(shared_run(*DS_DP2[zero]), runs)


# ZeRO-3's resume and reshard stay in README's suite; ZeRO-2's are -m full (CI)
BOTH = [pytest.param(2, marks=pytest.mark.full), 3]


@pytest.mark.parametrize("zero", BOTH)
def test_resume_same_layout_reproduces_losses(runs_root, interrupted, zero):
    runs = runs_root / f"resume_z{zero}"
    full = interrupted(runs, zero)
    resumed = train(runs, *CKPT, f"parallel.zero_stage={zero}")
    meta = resumed.metrics().meta
    assert meta.start_step == 5 and meta.resumed_from == str(full.root / "checkpoints" / "step5")
    assert [s.step for s in resumed.metrics().steps] == [6, 7, 8, 9, 10]
    assert max(abs(a - b) for a, b in zip(resumed.losses(), full.losses()[5:])) <= TOL


@pytest.mark.full  # the universal conversion; the same-layout resume stays in README's suite
@pytest.mark.parametrize("zero", [2, 3])
def test_two_rank_checkpoint_resumes_on_one_rank(runs_root, interrupted, zero):
    runs = runs_root / f"reshard_z{zero}"
    full = interrupted(runs, zero)
    # another layout is resumed only when named: run.resume=auto starts it fresh
    one = train(runs, *CKPT, f"parallel.zero_stage={zero}", "hardware.gpus_per_node=1", "batch.micro_batch_size=4",
                f"run.resume={full.root}")
    assert one.metrics().meta.start_step == 5 and one.metrics().meta.dp == 1
    assert max(abs(a - b) for a, b in zip(one.losses(), full.losses()[5:])) <= TOL
    assert (full.root / "checkpoints" / "step5_universal" / "zero").is_dir()


@pytest.mark.full
def test_autotp_tp2dp2_checkpoint_resumes_on_one_rank(runs_root, shared_run):
    runs = runs_root / "reshard_tp"
    full = interrupted_copy(shared_run(*ds_autotp(4, 1)), runs)  # the AutoTP parity test's run
    one = train(runs, *CKPT, "parallel.zero_stage=1", "hardware.gpus_per_node=1", "batch.micro_batch_size=4",
                f"run.resume={full.root}")
    assert one.metrics().meta.start_step == 5
    assert max(abs(a - b) for a, b in zip(one.losses(), full.losses()[5:])) <= TOL


def test_stage_change_2_to_3_is_refused_before_launch(runs_root, interrupted):
    runs = runs_root / "refuse"
    full = interrupted(runs, 2)
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_zero2", *CKPT, "parallel.zero_stage=3",
                        f"run.resume={full.root}"],
                       cwd=REPO, env={**os.environ, "LAYOUTLAB_RUNS": str(runs)}, capture_output=True, text=True)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "zero_stage=2" in line and "zero_stage=3" in line and "run.resume=never" in line
    assert len(list((runs / "tiny_zero2").iterdir())) == 1  # no run directory was created


def test_export_loads_in_transformers_and_reproduces_the_loss(runs_root, interrupted):
    full = interrupted(runs_root / "export", 3)
    out = runs_root / "exported"
    p = subprocess.run(["python", "-m", "launch", "export", str(full.root), "step=5", f"out={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # step 6 ran forward on the step-5 weights; and step 0's batch is what a run from those weights sees first
    at_step_6, first = exported_losses(out, full.metrics().meta, (5, 0))
    assert at_step_6 == pytest.approx(full.losses()[5], abs=TOL)
    # and a new run starts from those weights when the recipe names the folder (model.weights)
    warm = train(runs_root / "from_weights", *SHORT, "train.steps=2", "train.warmup_steps=1", f'model.weights="{out}"', "run.resume=never")
    assert warm.losses()[0] == pytest.approx(first, abs=TOL)


@pytest.mark.full  # a 5-step bf16 run and its export (~25 s)
def test_zero0_bf16_exports_the_optimizers_fp32_copies(shared_run, runs_root):
    """ZeRO-0 in bf16: the module holds rounded weights, its optimizer the fp32 copies they are rounded from. The export
    writes the copies: each rounds to the module's bf16 tensor exactly, and not every one is that tensor widened."""
    import torch
    from safetensors.torch import load_file

    run = shared_run(*DS_DP2[0], "precision.dtype=bf16", "train.steps=5")
    out = runs_root / "exported_zero0_bf16"
    p = subprocess.run(["python", "-m", "launch", "export", str(run.root), "step=5", f"out={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    exported = load_file(out / "model.safetensors")
    module = torch.load(run.root / "checkpoints" / "step5" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=True)["module"]
    assert sorted(exported) == sorted(module) and all(v.dtype == torch.bfloat16 for v in module.values())
    assert all(torch.equal(exported[k].to(torch.bfloat16), module[k]) for k in module)
    assert any(not torch.equal(exported[k].float(), module[k].float()) for k in module)


@pytest.mark.full
def test_killed_run_resumes_from_its_last_checkpoint(runs_root):
    runs = runs_root / "killed"
    # a constant learning rate: the resumed run stops 3 steps on, and another train.steps under a decaying schedule
    # is another run (checkpoints.schedule_break)
    args = ["bash", "launch/run.sh", "recipes/tiny_zero2", *SHORT, "train.steps=400", "train.checkpoint_every=3",
            "train.lr_schedule=constant"]
    env = {**os.environ, "LAYOUTLAB_RUNS": str(runs)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    ckpts = []
    while time.time() < deadline:
        roots = list((runs / "tiny_zero2").glob("*/checkpoints")) if (runs / "tiny_zero2").exists() else []
        ckpts = complete_checkpoints(roots[0]) if roots else []
        if len(ckpts) >= 2:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(ckpts) >= 2, "no checkpoints appeared"
    killed_root = roots[0].parent
    for _ in range(40):  # the ranks follow their parent down (PR_SET_PDEATHSIG): no orphans keep training
        if no_rank_left(killed_root):
            break
        time.sleep(0.25)
    assert no_rank_left(killed_root)
    done = {c.step for c in complete_checkpoints(killed_root / "checkpoints")}
    m = read_metrics(killed_root / "metrics" / "rank0.jsonl")  # logs stay readable after a kill
    assert m.meta is not None and len(m.steps) >= max(done)
    resumed = train(runs, *SHORT, "train.steps=400", "train.checkpoint_every=3", "train.lr_schedule=constant",
                    "train.steps=" + str(max(done) + 3))
    assert resumed.metrics().meta.start_step == max(done)


def no_rank_left(run_root) -> bool:
    """No process whose command line names this run directory is still alive."""
    import pathlib

    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(run_root) in (p / "cmdline").read_bytes().decode(errors="replace"):
                    return False
            except OSError:
                continue
    return True


@pytest.mark.full
def test_a_different_configuration_starts_fresh_with_a_note(runs_root, interrupted):
    runs = runs_root / "identity"
    first = interrupted(runs, 2)  # its newest complete checkpoint is step 5
    other = train(runs, *CKPT, "train.steps=5", "batch.seq_len=48")
    assert other.metrics().meta.start_step == 0 and other.metrics().meta.resumed_from is None
    assert (f"not resumed: an earlier run trains a different configuration (the newest, {first.root}, differs in "
            "seq_len)") in other.proc.stdout
    same = train(runs, *CKPT)  # the first run's configuration and schedule: continues it
    assert same.metrics().meta.start_step == 5
    assert f"resuming {first.root} at step 5" in same.proc.stdout


@pytest.mark.full
def test_another_layout_of_the_recipe_is_not_resumed_by_itself(runs_root, interrupted):
    """README's own override example after a ZeRO-2 run: the ZeRO-3 run starts fresh and says why, instead of
    refusing the earlier checkpoint (run.resume=auto resumes only its own configuration)."""
    runs = runs_root / "identity_layout"
    interrupted(runs, 2)
    other = train(runs, *CKPT, "train.steps=4", "parallel.zero_stage=3")
    assert other.metrics().meta.start_step == 0 and other.metrics().meta.resumed_from is None
    assert "differs in zero_stage" in other.proc.stdout and "starting fresh" in other.proc.stdout
