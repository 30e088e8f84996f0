"""Megatron-Core layouts reproduce the 1-rank run of the same global batch, step by step (fp32, gloo).

Gradient clipping (train.grad_clip = 1.0) takes effect at every step here: the reference's pre-clipping norms
are 1.3-3.3, so each layout's clipping (the backend's own at ZeRO-0, DeepSpeed's at ZeRO >= 1) is compared too.

Tolerance 1e-5 on losses of about 6: in fp32 a sharded layout changes only the order of summation (the
row-parallel all-reduce adds partial products, the pipeline hands activations over unchanged, ZeRO averages
the same gradients), about 1e-7 relative per operation; over 10 AdamW steps at lr 3e-3 that stays well below
1e-5, while one wrongly sharded or unsynchronised weight moves the loss by 1e-3 or more within a few steps.
"""
import json

import pytest
import torch

from launch.plan.build import plan_resolved

from launch.plan.layout import Layout

from launch.plan.memory import chunk_layers, zero3_partition_numel
from launch.config.resolve import Resolved
from tests.dist.conftest import MEGATRON, MEGATRON_LAYOUTS as LAYOUTS, SHORT, train, two_ranks_first

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5
ONE_RANK = ("hardware.gpus_per_node=1", "parallel.tp=1", "parallel.sp=false", "parallel.zero_stage=0",
            "batch.micro_batch_size=4")


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(shared_run):
    t = shared_run(*SHORT, *ONE_RANK, recipe=MEGATRON)
    losses = t.losses()
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"loss did not fall: {losses}"
    t.norms = [s.grad_norm for s in t.metrics().steps]
    assert all(n is not None and n > 0 for n in t.norms)
    return t


def test_one_rank_megatron_equals_hugging_face(reference, one_rank_reference):
    """The independent oracle: the DeepSpeed backend trains the Hugging Face model from the same weights (its
    one-rank ZeRO-0 run of the same global batch in micro-batches of 4, as ONE_RANK)."""
    hf = one_rank_reference
    assert close(reference.losses(), hf.losses()) <= 1e-4, (reference.losses(), hf.losses())
    assert abs(reference.losses()[0] - hf.losses()[0]) <= 1e-5  # before any update: the same function
    assert [s.grad_norm for s in hf.metrics().steps] == pytest.approx(reference.norms, rel=1e-3)


@pytest.fixture(scope="module")
def runs(shared_run):
    return lambda name: shared_run(*SHORT, *LAYOUTS[name], recipe=MEGATRON)


@pytest.mark.parametrize("name", two_ranks_first(LAYOUTS))
def test_layout_matches_one_rank(runs, reference, name):
    t = runs(name)
    resolved = Resolved.load(t.root / "resolved.json")
    for rank in range(resolved.world_size):
        assert close(t.losses(rank), reference.losses()) <= TOL, (name, rank, t.losses(rank), reference.losses())
    assert [s.grad_norm for s in t.metrics().steps] == pytest.approx(reference.norms, rel=1e-4)


@pytest.mark.parametrize("name", two_ranks_first({n: LAYOUTS[n] for n in ("tp2_pp2", "tp2_dp2_zero3", "pp2_vpp2")}))
def test_logged_grid_and_parameters_equal_the_plan(runs, name):
    """The trainer's rank grid (as logged) and each rank's stored parameter count against the dry-run's plan."""
    t = runs(name)
    resolved = Resolved.load(t.root / "resolved.json")
    par = resolved.recipe.parallel
    for rank in range(resolved.world_size):
        built = json.loads((t.root / "logs" / f"layout_rank{rank}.json").read_text())
        g = resolved.grid
        assert built["groups"] == {"tp": list(g.tp_group(rank)), "dp": list(g.dp_group(rank)),
                                   "pp": list(g.pp_group(rank))}
        stage = g.coords(rank)[2]
        assert built["chunk_layers"] == [list(c) for c in chunk_layers(resolved.model.num_layers, par.pp, par.vpp,
                                                                          stage)]
    plan = plan_resolved(resolved)
    layout = Layout.from_resolved(resolved)
    for rank in range(resolved.world_size):
        stage = resolved.grid.coords(rank)[2]
        held = t.metrics(rank).meta.param_numel_local
        rp = next(p for p in plan.ranks if rank in p.ranks)
        want = zero3_partition_numel(layout, stage) if resolved.recipe.parallel.zero_stage == 3 else rp.params
        assert held == want, (name, rank, held, want)


@pytest.mark.full  # reads tp2_pp2's run: 4 ranks (conftest.two_ranks_first)
def test_seeds_per_rank_are_megatrons(runs):
    """Megatron's rule (its _set_random_seed and model_parallel_cuda_manual_seed): the default seed is
    seed + 100 × pp rank, the same on every TP rank; the tracker's tensor-model-parallel stream is that + 2718 +
    tp rank, so TP ranks differ (its other streams: data-parallel = the default; expert = + 1024 + expert-TP
    rank, which is the TP rank without expert parallelism)."""
    t = runs("tp2_pp2")
    resolved = Resolved.load(t.root / "resolved.json")
    seed = resolved.recipe.train.seed
    for rank in range(resolved.world_size):
        tp_rank, _, pp_rank = resolved.grid.coords(rank)
        base = seed + 100 * pp_rank
        seeds = json.loads((t.root / "logs" / f"layout_rank{rank}.json").read_text())["seeds"]
        assert seeds == {"default": base, "rng_tracker": sorted([base, base + 1024 + tp_rank, base + 2718 + tp_rank])}


def test_replicated_weights_identical_across_tp_ranks(runs):
    """Norm weights are not sharded by TP: after training they must be bit-identical on both TP ranks, while a
    TP-sharded weight differs (each rank holds its own slice)."""
    t = runs("tp2_sp")  # SP is where norm gradients need the extra TP reduction
    ckpt = t.root / "checkpoints" / "step10"
    a, b = (torch.load(ckpt / f"mp_rank_0{i}_model_states.pt", map_location="cpu", weights_only=False)["module"]
            for i in (0, 1))
    norms = [k for k in a if "layernorm" in k or k.endswith("final_layernorm.weight")]
    assert norms, list(a)
    for k in norms:
        assert torch.equal(a[k], b[k]), k
    sharded = [k for k in a if k.endswith("linear_fc1.weight")]
    assert sharded and not torch.equal(a[sharded[0]], b[sharded[0]])


def test_recompute_runs_every_layer_twice_and_keeps_losses(runs_root, shared_run, runs, reference):
    t = shared_run(*SHORT, *LAYOUTS["tp2"], "train.activation_checkpointing=full", recipe=MEGATRON)
    assert close(t.losses(), reference.losses()) <= TOL
    calls = json.loads((t.root / "logs" / "layer_calls_rank0.json").read_text())["forward_calls_per_layer"]
    micro_batches = 10 * 2  # 10 steps × gradient accumulation 2
    assert calls == [2 * micro_batches] * 4
    s = train(runs_root / "mc_sel_ac", *SHORT, *LAYOUTS["tp2_sp"], "train.activation_checkpointing=selective",
              recipe=MEGATRON)
    assert close(s.losses(), reference.losses()) <= TOL
    plain = json.loads((runs("tp2_sp").root / "logs" / "layer_calls_rank0.json").read_text())
    assert json.loads((s.root / "logs" / "layer_calls_rank0.json").read_text()) == plain  # MLP not recomputed


@pytest.mark.parametrize("layout", ["tp2", pytest.param("dp2_zero1", marks=pytest.mark.full)])
def test_bf16_trains_and_tracks_fp32(runs_root, reference, layout):
    """bf16, the GPU default, runs the same code with DeepSpeed's bf16 optimizer (fp32 master weights). Its
    16-bit activations and weights carry ~3 significant digits, so it tracks the fp32 run only to ~1% of the
    loss (0.05 of ~6 over 10 steps); an update lost between the bf16 gradients and the fp32 master (the failure
    this guards) would leave the loss flat instead of falling like the reference's."""
    t = train(runs_root / f"mc_bf16_{layout}", *SHORT, *LAYOUTS[layout], "precision.dtype=bf16", recipe=MEGATRON)
    losses = t.losses()
    assert close(losses, reference.losses()) <= 0.05, (losses, reference.losses())
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses


def test_distributed_optimizer_reduces_bf16_gradients_as_planned(runs_root, reference):
    """precision.grad_reduce_dtype=bf16 under Megatron's distributed optimizer (NeMo's performance setting): DDP's
    gradient buffer, which it reduce-scatters, holds 2 B a parameter (4 B with the fp32 default) as measured between
    steps, rank 0 says so, the fit check is the "megatron" accounting, and the run tracks the fp32 reference as bf16
    does."""
    t = train(runs_root / "mc_bf16_reduce", *SHORT, *LAYOUTS["dp2_zero1"], "precision.dtype=bf16",
              "precision.grad_reduce_dtype=bf16", recipe=MEGATRON)
    assert "data-parallel gradients reduce-scattered in bf16" in (t.root / "logs" / "rank0.out").read_text()
    losses = t.losses()
    assert close(losses, reference.losses()) <= 0.05, (losses, reference.losses())
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    plan = json.loads((t.root / "plan.json").read_text())
    (rp,) = plan["ranks"]
    assert rp["implementation"] == "megatron"
    for rank in (0, 1):
        held = json.loads((t.root / "logs" / f"state_bytes_rank{rank}.json").read_text())
        assert held["grads"] == pytest.approx(2 * rp["params"], rel=0.02)
