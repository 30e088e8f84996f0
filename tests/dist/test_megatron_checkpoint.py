"""Megatron checkpoints: resume reproduces the uninterrupted run, another layout is refused before launch,
a checkpoint of other shapes is refused at load, `launch export` gives a folder transformers loads, and
model.weights starts a Megatron run from such a folder.

Tolerances. Resume: 1e-5 on losses of about 6, as tests/dist/test_deepspeed_checkpoint.py; the resumed run
restores the same fp32 weights and Adam moments and replays the same batches with the same ops, so it
agrees to the last bit (measured: 0.0 at TP2+SP, PP2 and TP2 x DP2 ZeRO-3); a lost or stale optimizer
state moves the loss by 1e-3 or more within a step at lr 3e-3. Export and model.weights: 1e-5, as
tests/dist/test_megatron_parity.py allows between Megatron's and transformers' forward of the same weights
(fused qkv, vocab-parallel cross entropy: other orders of summation; measured 0 to 1e-6 here).

The export oracle: a run logs step N's loss from the forward *before* step N's update, so the weights of
checkpoint step5 are the ones step 6 ran its forward on; transformers' loss of the exported step-5 folder on
step 6's global batch must equal the uninterrupted run's logged step-6 loss. The run logs the data-parallel
mean of per-micro-batch means, which for equal-length rows is the mean over the whole global batch.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from launch.data.rows import global_batch_indices
from launch.run.metrics import read_metrics
from launch.config.resolve import Resolved
from launch.ranks.data import sources
from tests.conftest import REPO
from tests.dist.conftest import MEGATRON, MEGATRON_LAYOUTS, SHORT, interrupted_copy, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5
# The parity tests' runs of these layouts, which checkpoint every 5 steps.
LAYOUTS = {name: (*SHORT, *MEGATRON_LAYOUTS[layout])
           for name, layout in (("tp2", "tp2_sp"), ("pp2", "pp2"), ("tp2_zero3", "tp2_dp2_zero3"),
                                ("zero1", "dp2_zero1"), ("tp2_sp_zero1", "tp2_sp_dp2_zero1"))}


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def run_of(shared_run):
    """`run_of(name)`: the shared run of that layout (10 steps, checkpoints at 5 and 10), only read here; a test
    that resumes works on an interrupted copy (conftest.interrupted_copy)."""
    return lambda name: shared_run(*LAYOUTS[name], recipe=MEGATRON)


def export(root, out) -> None:
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(root), "step=5", f"out={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[0] == str(out)  # then how to load it
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # Megatron's Apex / Transformer Engine fallback warnings go to the run's log, not the terminal
    assert "Warning" not in p.stderr, p.stderr[-2000:]
    assert "Apex is not installed" in (root / "logs" / "export.err").read_text()


@pytest.fixture(scope="module")
def exported(runs_root, run_of):
    cache = {}

    def get(name):
        if name not in cache:
            out = runs_root / f"mc_export_{name}"
            export(run_of(name).root, out)
            cache[name] = out
        return cache[name]

    return get


def hf_loss(folder, run_root, step: int) -> float:
    """transformers' mean token loss of the model in `folder` on the global batch of 0-based `step` of the run
    (the batch rebuilt from the run's resolved.json with launch.ranks.data, as every rank reads its rows)."""
    from transformers import AutoModelForCausalLM

    resolved = Resolved.load(run_root / "resolved.json")
    src = sources(resolved).train
    idx = global_batch_indices(step, resolved.recipe.batch.global_batch_size, src.rows_per_epoch())
    x = torch.from_numpy(np.stack([src.row(i) for i in idx]))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=x, labels=x).loss.item()


# tp2 (with SP) and zero1 (Megatron's distributed optimizer) stay in README's suite; the others are -m full (CI)
NAMES = [name if name in ("tp2", "zero1") else pytest.param(name, marks=pytest.mark.full) for name in LAYOUTS]


@pytest.mark.parametrize("name", NAMES)
def test_resume_reproduces_the_uninterrupted_losses(runs_root, run_of, name):
    runs = runs_root / f"mc_ckpt_{name}"
    full = interrupted_copy(run_of(name), runs)  # its step-10 save never completed: resume from step 5
    resumed = train(runs, *LAYOUTS[name], recipe=MEGATRON)
    meta = resumed.metrics().meta
    assert meta.start_step == 5 and meta.resumed_from.endswith("step5")
    assert [s.step for s in resumed.metrics().steps] == [6, 7, 8, 9, 10]
    assert close(resumed.losses(), full.losses()[5:]) <= TOL, (resumed.losses(), full.losses()[5:])


@pytest.mark.parametrize("override, field", [("parallel.tp=1", "parallel.tp=2 (now 1)"),
                                             pytest.param("hardware.gpus_per_node=2", "parallel.dp=2 (now 1)",
                                                          marks=pytest.mark.full)])
def test_resume_onto_another_layout_is_refused_before_launch(runs_root, run_of, override, field):
    runs = runs_root / f"mc_refuse_{override.split('=')[0]}"
    full = interrupted_copy(run_of("tp2_zero3"), runs)
    before = sorted(full.root.parent.iterdir())
    p = subprocess.run(["bash", "launch/run.sh", MEGATRON, *LAYOUTS["tp2_zero3"], override, f"run.resume={full.root}"],
                       cwd=REPO,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(runs)}, capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "run.resume=never" in lines[0], p.stderr
    assert sorted(full.root.parent.iterdir()) == before  # no run directory, so no rank, was started


@pytest.mark.full
def test_zero3_resume_refuses_a_partition_saved_with_another_shape(runs_root, run_of):
    """DeepSpeed's ZeRO-3 load copies flat fp32 partitions without their shapes (a transposed weight of equal size
    loads silently): the backend compares the saved ds_shapes with the live parameters before it loads."""
    full = run_of("tp2_zero3")
    runs = runs_root / "mc_ckpt_tampered"
    copy = runs / full.root.parent.name / full.root.name
    shutil.copytree(full.root / "checkpoints" / "step5", copy / "checkpoints" / "step5")
    f = copy / "checkpoints" / "step5" / "zero_pp_rank_1_mp_rank_01_model_states.pt"
    state = torch.load(f, map_location="cpu", weights_only=False)
    key = "0.decoder.layers.0.self_attention.linear_proj.weight"
    (group,) = state["param_shapes"]
    assert group[key] == torch.Size([64, 32])
    group[key] = torch.Size([32, 64])  # the same elements, so DeepSpeed alone would load it
    torch.save(state, f)
    t = train(runs, *LAYOUTS["tp2_zero3"], recipe=MEGATRON, check=False)
    assert t.proc.returncode != 0
    said = f"{key} was saved with shape [32, 64], this run's model has [64, 32]"
    assert said in t.proc.stdout and "zero_pp_rank_1_mp_rank_01_model_states.pt" in t.proc.stdout, t.proc.stdout
    for rank in range(4):  # every rank stopped with the same ResumeError, none in a collective
        assert said in (t.root / "logs" / f"rank{rank}.err").read_text()
    records = t.root / "metrics" / "rank0.jsonl"
    assert not records.is_file() or not read_metrics(records).steps


@pytest.mark.parametrize("name", NAMES)
def test_export_reproduces_the_logged_loss_of_the_next_step(run_of, exported, name):
    full = run_of(name)
    assert hf_loss(exported(name), full.root, 5) == pytest.approx(full.losses()[5], abs=TOL)


@pytest.mark.full
def test_model_weights_start_an_interleaved_run_that_exports_back(runs_root, run_of, exported):
    """model.weights: the first logged loss (before any update) is transformers' loss of that folder on the
    first batch, clearly not the seeded init's; and the interleaved (pp2 × vpp2) run exports like the others."""
    folder = exported("tp2")
    first = hf_loss(folder, run_of("tp2").root, 0)
    assert abs(first - run_of("tp2").losses()[0]) > 0.1  # the trained folder, not the random init
    warm = train(runs_root / "mc_weights", *SHORT, *MEGATRON_LAYOUTS["pp2_vpp2"], "train.steps=6",
                 "train.checkpoint_every=5", f'model.weights="{folder}"', "run.resume=never", recipe=MEGATRON)
    assert warm.losses()[0] == pytest.approx(first, abs=TOL)
    out = runs_root / "mc_export_pp2_vpp2"
    export(warm.root, out)
    assert hf_loss(out, warm.root, 5) == pytest.approx(warm.losses()[5], abs=TOL)
