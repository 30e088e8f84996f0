"""torch backend checkpoints (torch.distributed.checkpoint): resume bit-identical, reshard onto another tp, dp or zero
stage, refuse a checkpoint of another model in one line, export a Hugging Face folder that reproduces the logged loss.

Resharded resumes continue the uninterrupted curve within 1e-5 (test_torch_parity.py says why that tolerance): the
layouts already agree with each other to that level, and DCP restores every fp32 parameter and AdamW moment exactly.
"""
import json
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.dist.conftest import EVERY_5, SHORT, TORCH, TORCH_LAYOUTS, exported_losses, interrupted_copy, train, worst

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5
CKPT = (*SHORT, *EVERY_5)



@pytest.fixture(scope="module")
def interrupted(shared_run):
    """`interrupted(runs, name)`: a copy of the shared torch run of that layout whose step-10 save never completed."""
    return lambda runs, name: interrupted_copy(shared_run(*SHORT, *TORCH_LAYOUTS[name], recipe=TORCH), runs)


def test_resume_same_layout_is_bit_identical(runs_root, interrupted):
    runs = runs_root / "torch_resume"
    full = interrupted(runs, "fsdp2_z3")
    resumed = train(runs, *CKPT, *TORCH_LAYOUTS["fsdp2_z3"], recipe=TORCH)
    meta = resumed.metrics().meta
    assert meta.start_step == 5 and meta.resumed_from == str(full.root / "checkpoints" / "step5")
    assert [s.step for s in resumed.metrics().steps] == [6, 7, 8, 9, 10]
    assert resumed.losses() == full.losses()[5:]  # exactly: same layout, fp32 state restored as saved


@pytest.mark.parametrize("source, target", [  # FSDP2 -> DDP in README's suite, the other two -m full (CI)
    pytest.param("tp2_dp2", ("hardware.gpus_per_node=4", "parallel.tp=1", "parallel.zero_stage=3",
                             "batch.micro_batch_size=2"), marks=pytest.mark.full, id="tp2xdp2_to_dp4"),
    pytest.param("fsdp2_z3", ("hardware.gpus_per_node=2", "parallel.zero_stage=0", "batch.micro_batch_size=2"),
                 id="fsdp2_to_ddp"),
    pytest.param("pp2_dp2_z2", ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3",
                                "batch.micro_batch_size=4"), marks=pytest.mark.full, id="pp2xdp2_zero2_to_tp2_sp_zero3"),
])
def test_resharded_resume_continues_the_curve(runs_root, interrupted, source, target):
    runs = runs_root / f"torch_reshard_{source}"
    full = interrupted(runs, source)
    moved = train(runs, *CKPT, *target, f"run.resume={full.root}", recipe=TORCH)
    meta = moved.metrics().meta
    assert meta.start_step == 5
    assert (meta.tp, meta.dp, meta.zero_stage) != (full.metrics().meta.tp, full.metrics().meta.dp,
                                                   full.metrics().meta.zero_stage)
    assert worst(moved.losses(), full.losses()[5:]) <= TOL


@pytest.mark.full
def test_checkpoint_of_another_model_is_refused_in_one_line(runs_root, interrupted):
    """Every tensor's shape is checked before DCP loads: a checkpoint whose model differs is refused before launch by its
    marker, and where the marker does not say so (edited here to claim this run's identity, as a folder copied
    between runs by hand could) by the shapes on the ranks: one line, exit 2, not a load of slices of the wrong
    tensors."""
    from launch.config.resolve import resolve_path
    from launch.run.checkpoints import training_identity

    runs = runs_root / "torch_wrong_model"
    full = interrupted(runs, "fsdp2_z3")
    p = subprocess.run(["bash", "launch/run.sh", TORCH, *CKPT, *TORCH_LAYOUTS["fsdp2_z3"], "model.name=tiny-qwen2",
                        "run.resume=" + str(full.root)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(runs)})
    assert p.returncode == 2, p.stderr[-2000:]
    assert "differs in hf_config, model" in p.stderr and "run.resume=never" in p.stderr
    marker = full.root / "checkpoints" / "step5" / "layoutlab_checkpoint.json"
    info = json.loads(marker.read_text())
    overrides = [*CKPT, *TORCH_LAYOUTS["fsdp2_z3"], "model.name=tiny-qwen2"]
    claimed = training_identity(resolve_path(REPO / TORCH, overrides))
    marker.write_text(json.dumps({**info, "model": "tiny-qwen2", "identity": {**info["identity"], **claimed}}))
    p = subprocess.run(["bash", "launch/run.sh", TORCH, *overrides, "run.resume=" + str(full.root)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(runs)})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    said = [line for line in (p.stdout + p.stderr).splitlines() if "does not fit this model" in line]
    # tiny-qwen2 has tiny-llama's sizes but biases on q, k and v, which the checkpoint lacks
    assert said and "q_proj.bias: checkpoint missing" in said[0] and "run.resume=never" in said[0], said


@pytest.mark.full  # export: DeepSpeed's and Megatron's stay in README's suite
def test_export_loads_in_transformers_and_reproduces_the_loss(runs_root, interrupted):
    full = interrupted(runs_root / "torch_export", "tp2_dp2")
    out = runs_root / "torch_exported"
    p = subprocess.run(["python", "-m", "launch", "export", str(full.root), "step=5", f"out={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # step 6 ran forward on the step-5 weights; and step 0's batch is what a run from those weights sees first
    at_step_6, first = exported_losses(out, full.metrics().meta, (5, 0))
    assert at_step_6 == pytest.approx(full.losses()[5], abs=TOL)
    # a torch run starts from those weights when the recipe names the folder (model.weights): every rank reads them,
    # one tensor at a time, and keeps its shards
    warm = train(runs_root / "torch_from_weights", *SHORT, *TORCH_LAYOUTS["tp2_dp2"][:4], "train.steps=2",
                 "train.warmup_steps=1", f'model.weights="{out}"', "run.resume=never", recipe=TORCH)
    assert warm.losses()[0] == pytest.approx(first, abs=TOL)


def _dcp_tensors(folder) -> dict:
    """Every tensor of a DCP checkpoint folder, whole, read with torch.distributed.checkpoint alone."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_async_checkpoints_equal_the_synchronous_ones_and_resume_identically(runs_root, shared_run):
    """run.checkpoint_async=true (DCP async_save): the same losses as the synchronous shared run, checkpoints equal to
    its own bit for bit (a state copied before the next step changed it), each save's blocked time recorded on every
    rank, and a resume from the step-5 one continuing the uninterrupted curve exactly."""
    import torch

    layout = TORCH_LAYOUTS["fsdp2_z3"]
    sync = shared_run(*SHORT, *layout, recipe=TORCH)
    runs = runs_root / "torch_async"
    done = train(runs, *SHORT, *layout, "run.checkpoint_async=true", recipe=TORCH)
    assert done.losses() == sync.losses()
    for step in (5, 10):
        a, s = (_dcp_tensors(t.root / "checkpoints" / f"step{step}") for t in (done, sync))
        assert sorted(a) == sorted(s) and len(a) > 20
        for key in s:
            assert torch.equal(a[key], s[key]), (step, key)
        assert (done.root / "checkpoints" / f"step{step}" / "layoutlab_checkpoint.json").is_file()
    for rank in (0, 1):
        saves = [json.loads(line) for line in (done.root / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
                 if '"kind": "checkpoint"' in line]
        assert [(c["step"], c["asynchronous"]) for c in saves] == [(5, True), (10, True)]
        assert all(0 < c["blocked_s"] < 60 for c in saves)
    copy = interrupted_copy(done, runs_root / "torch_async_resume")
    resumed = train(runs_root / "torch_async_resume", *CKPT, *layout, recipe=TORCH)
    assert resumed.metrics().meta.resumed_from == str(copy.root / "checkpoints" / "step5")
    assert resumed.losses() == sync.losses()[5:]
