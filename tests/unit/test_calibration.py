"""The calibration file, its α–β fit, and the planner's calibrated step time against hand-computed numbers."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from launch.commands.cli import main
from launch.config.calibration import (
    AlphaBeta,
    Calibration,
    Compute,
    EngineCost,
    Fitted,
    GemmPoint,
    Pass,
    fit_alpha_beta,
)
from launch.plan.compute import fit_gemm, gemm_shape_factor
from launch.config.resolve import resolve_path
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from launch.run import envinfo

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALPHA, BETA = 1e-3, 0.5e9  # 1 ms per call, 0.5 GB/s


def test_fit_recovers_alpha_and_beta_from_exact_points():
    points = [(s, ALPHA + s / BETA) for s in (8, 512, 32768, 2**21, 2**22)]
    a, b = fit_alpha_beta(points)
    assert a == pytest.approx(ALPHA, rel=1e-9) and b == pytest.approx(BETA, rel=1e-9)


def test_fit_weighs_relative_error_so_small_messages_set_the_latency():
    # Two points 10 % off at the small end, exact at the large end: α comes out near 1 ms, not pulled to 0.
    points = [(8, 1.1e-3), (64, 0.9e-3), (2**22, ALPHA + 2**22 / BETA), (2**23, ALPHA + 2**23 / BETA)]
    a, b = fit_alpha_beta(points)
    assert 0.9e-3 < a < 1.1e-3 and b == pytest.approx(BETA, rel=0.05)


def test_fit_without_size_dependence_is_latency_only():
    # Larger messages measured faster (noise): no positive slope, so the fit keeps the latency and no bandwidth term.
    a, b = fit_alpha_beta([(8, 2.1e-3), (4096, 2.0e-3), (2**20, 1.9e-3)])
    assert math.isinf(b) and a == pytest.approx(2e-3, rel=0.05)


# The hand-computed sums below take tiny_zero2 at micro-batch 4: the whole global batch of 8 in one micro-step.
MB4 = ("batch.micro_batch_size=4",)


def _fitted(scale: float = 1.0, dtype: str = "fp32") -> Fitted:
    """The CPU profile's own nominal compute figures (0.05 TFLOP/s × 0.5 for GEMMs and sdpa, 10 GB/s × 0.5,
    half dimension 16), every rate × `scale`."""
    return Fitted(dtype=dtype, gemm_tflops=0.025 * scale, gemm_half_dim=16.0, memory_GBps=5.0 * scale,
                  attention_forward_tflops=0.025 * scale, attention_backward_tflops=0.025 * scale,
                  gemm_points=(GemmPoint(64, 64, 64, 1e-4),))


def _calibration(**changes) -> Calibration:
    # Of each forward: 0.2 ms before the first decoder layer, 4 ms × b / tp inside the layers, the rest (0.8 ms) after.
    passes = tuple(Pass(backend, tp, sp, b, ac, 0.004 * b / tp + 0.001, 0.006 * b / tp + 0.002, 0.0002, 0.004 * b / tp)
                   for backend, modes in (("deepspeed", ("none", "full")), ("megatron", ("none", "full", "selective")),
                                          ("torch", ("none", "full", "selective")))
                   for tp in (1, 2) for sp in ((False, True) if tp > 1 and backend != "deepspeed" else (False,))
                   for b in (1, 2, 4, 8) for ac in modes)
    fields = dict(
        created="2026-12-01T00:00:00+00:00", machine_kind=envinfo.machine_kind(),
        versions={k: v for k, v in envinfo.package_versions().items() if k in ("torch", "deepspeed")},
        base_profile="cpu", world_size=2, ranks_per_node=2,
        collectives=tuple(AlphaBeta(op, 2, "intra_node", ALPHA, BETA, ((8, ALPHA),), "test")
                          for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")),
        compute=Compute(model="tiny-llama", dtype="fp32", seq_len=64, threads_per_rank=1,
                        passes=passes, engine=tuple(EngineCost(b, z, 0.0005 + 0.001 * (z + 1), 0.002, 0.0003 * z)
                                                    for b in ("deepspeed", "megatron", "torch") for z in range(4)),
                        adam_alpha_s=1e-4, adam_s_per_param=1e-8, how="test", fitted=_fitted()))
    fields.update(changes)
    return Calibration(**fields)


def _write(tmp_path: Path, calib: Calibration | dict | str, name: str = "calib.json") -> Path:
    path = tmp_path / name
    path.write_text(calib if isinstance(calib, str) else json.dumps(
        calib.to_dict() if isinstance(calib, Calibration) else calib))
    return path


def test_calibrated_zero2_step_equals_the_hand_computed_sum(tmp_path):
    path = _write(tmp_path, _calibration())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}"]), envinfo.machine())
    # tiny_zero2: 2 ranks, ZeRO-2, fp32, micro-batch 4, global batch 8 -> one micro-step per step.
    params = 213_568  # tiny-llama: 2 × 512 × 64 + 4 × (2 × 64 × 64 + 2 × 64 × 32 + 3 × 64 × 128 + 2 × 64) + 64
    fwd, bwd = 0.004 * 4 + 0.001, 0.006 * 4 + 0.002
    compute = fwd + bwd + 0.0005 + 0.003 + 0.002 + 1e-4 + 1e-8 * (params // 2)
    msg = 4 * params  # fp32 gradients and parameters, one bucket each
    comm = 2 * (ALPHA + msg / BETA) + 2 * (ALPHA + 4 / BETA)  # reduce-scatter + all-gather; norm and loss all-reduces
    assert plan.step.timing == "calibrated"
    assert plan.step.compute_s == pytest.approx(compute, rel=1e-9)
    assert plan.step.total_s == pytest.approx(compute + comm, rel=1e-9)
    assert plan.step.dp_exposed_s == plan.step.dp_comm_s  # gloo: nothing overlaps
    assert any(n.startswith("time: calibrated") for n in plan.notes)


def test_calibrated_tp2_counts_every_autotp_call(tmp_path):
    path = _write(tmp_path, _calibration())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}", "parallel.tp=2",
                                                                 "parallel.zero_stage=1"]), envinfo.machine())
    tp = [c for c in plan.comm if c.parallelism == "tp"]
    # dp = 1, two micro-steps: per micro-step 7 all-reduces per layer × 4 layers + lm_head's input gradient, and one
    # all-gather of the 4 × 64 × 512 fp32 logits.
    act, logits = 64 * 4 * 64 * 4, 64 * 4 * 512 * 4
    want = 2 * (29 * (ALPHA + act / BETA) + ALPHA + logits / BETA)
    assert sum(c.time_s for c in tp) == pytest.approx(want, rel=1e-6)
    assert not [c for c in plan.comm if c.parallelism == "dp"]
    # The passes were timed in situ with those calls inside them: the step counts them once. Per micro-step the
    # tp=2 pass at micro-batch 4 and ZeRO-1's engine hooks; per step its step and Adam over the 123,456-parameter
    # AutoTP shard (embedding 512 × 64 whole, lm_head halved, per layer (2 × 64 × 64 + 2 × 64 × 32 + 3 × 64 × 128) / 2
    # + 2 × 64 norms, and the final norm).
    shard = 512 * 64 + 512 * 64 // 2 + 4 * ((2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) // 2 + 2 * 64) + 64
    passes = 2 * ((0.004 * 4 / 2 + 0.001) + (0.006 * 4 / 2 + 0.002))
    total = passes + 2 * (0.0005 + 0.002) + 0.002 + 1e-4 + 1e-8 * shard
    assert plan.step.total_s == pytest.approx(total, rel=1e-9)
    # These α–β figures (1 ms a call) exceed the measured passes that hold the calls: TP time is capped at them.
    assert want > passes and plan.step.tp_comm_s == pytest.approx(passes, rel=1e-9)
    assert plan.step.compute_s == pytest.approx(total - passes, rel=1e-9)


def test_calibrated_megatron_uses_its_own_passes_and_engine_cost(tmp_path):
    path = _write(tmp_path, _calibration())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}", "backend=megatron",
                                                                 "parallel.tp=2", "parallel.zero_stage=1",
                                                                 "train.activation_checkpointing=selective"]), envinfo.machine())
    assert plan.step.timing == "calibrated"
    # Two micro-steps of the tp=2 pass and megatron's ZeRO-1 engine cost per micro-step (0.0025 s), its step cost
    # and Adam over the Megatron shard: vocab-parallel embedding and output layer halved, the same decoder shard; and
    # the distributed optimizer's clip norm, one fp32 all-reduced over every rank (here the TP pair) after the step.
    shard = 2 * (512 * 64 // 2) + 4 * ((2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) // 2 + 2 * 64) + 64
    norm = ALPHA + 4 / BETA
    total = 2 * ((0.004 * 4 / 2 + 0.001) + (0.006 * 4 / 2 + 0.002) + 0.0025) + 0.002 + 1e-4 + 1e-8 * shard + norm
    assert plan.step.total_s == pytest.approx(total, rel=1e-9)


def test_calibrated_pipeline_stages_split_the_measured_pass_where_its_forward_went(tmp_path):
    path = _write(tmp_path, _calibration())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [f"hardware.profile={path}", "backend=megatron",
                                                                 "parallel.pp=2", "parallel.zero_stage=1",
                                                                 "batch.micro_batch_size=1"]), envinfo.machine())
    assert plan.step.timing == "calibrated"
    # 2 stages of 2 layers, 8 micro-batches. The micro-batch-1 pass: forward 5 ms = 0.2 embedding + 4 layers + 0.8
    # output layer and loss, backward 8 ms (1.6 × the forward, split alike). Stage 0: 2 + 0.2 ms forward, stage 1:
    # 2 + 0.8 ms; each × 2.6 with its backward.
    stage0, stage1 = (0.002 + 0.0002) * 2.6, (0.002 + 0.0008) * 2.6
    assert plan.step.bubble_s == pytest.approx(stage0, rel=1e-9)  # the faster stage's first micro-batch
    # Per micro-batch megatron's ZeRO-1 engine cost (0.0025 s); per step its step cost and Adam over the larger
    # stage: stage 1's two layers, final norm and output layer (stage 0 holds the embedding instead of those 64 + 0).
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    compute = 8 * 0.0025 + 0.002 + 1e-4 + 1e-8 * (2 * layer + 64 + 512 * 64)
    # Stage 0 sends the first micro-batch's activations alone, then 7 times sends activations and receives a
    # gradient at once, then receives the last gradient alone: 9 waits of one 64 × 64 fp32 call; the loss broadcast.
    pp = 9 * (ALPHA + 64 * 64 * 4 / BETA) + ALPHA + 4 / BETA
    assert plan.step.pp_comm_s == pytest.approx(pp, rel=1e-9)
    norm = ALPHA + 4 / BETA  # the distributed optimizer's clip norm, one fp32 over both stages after the step
    assert plan.step.total_s == pytest.approx(8 * stage1 + stage0 + compute + pp + norm, rel=1e-9)
    assert plan.step.compute_s == pytest.approx(8 * stage1 + compute, rel=1e-9)
    assert "the slowest, stage 1," in plan.step.assumptions  # the output layer's, not the embedding's
    vpp = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [f"hardware.profile={path}", "backend=megatron",
                                                                "parallel.pp=2", "parallel.vpp=2", "parallel.zero_stage=1",
                                                                "batch.micro_batch_size=1", "batch.global_batch_size=8"]), envinfo.machine())
    assert vpp.step.timing == "fitted"  # the compute model on the fitted figures
    assert "interleaved pipeline stages" in next(n for n in vpp.notes if n.startswith("time:"))
    # Interleaved schedules are not paired up: every call of the comm table is on the critical path.
    assert vpp.step.pp_comm_s == pytest.approx(sum(c.time_s for c in vpp.comm if c.parallelism == "pp"), rel=1e-12)


def test_a_stage_takes_its_share_of_the_measured_pass():
    # Forward 10 ms = 1 before the first layer + 6 inside the layers + 3 after the last; backward 20 ms.
    p = Pass("megatron", 1, False, 1, "none", 0.010, 0.020, 0.001, 0.006)
    assert p.stage_s(1.0, True, True) == pytest.approx(0.030)  # the whole model: the whole pass
    assert p.stage_s(0.5, True, False) == pytest.approx((0.003 + 0.001) * 3)  # half the layers, the embedding
    assert p.stage_s(0.5, False, True) == pytest.approx((0.003 + 0.003) * 3)  # half the layers, the output layer
    assert p.stage_s(0.25, False, False) == pytest.approx(0.0015 * 3)  # a middle stage: layers only
    # Full checkpointing: 6 ms of the backward are the layers' forward again; the other 14 ms split as the forward.
    full = Pass("megatron", 1, False, 1, "full", 0.010, 0.020, 0.001, 0.006)
    assert full.stage_s(0.5, True, False) == pytest.approx(0.004 + 0.003 + 0.014 * 0.4)
    assert full.stage_s(1.0, True, True) == pytest.approx(0.030)


@pytest.mark.parametrize("pp, stage, micro_batches, waits", [
    (2, 0, 8, 9),  # send alone, 7 × (send activations + receive a gradient), receive alone
    (2, 1, 8, 9),  # receive alone, 7 × (send a gradient + receive activations), send alone
    (3, 1, 4, 11),  # warm-up 1 × (receive, send), receive, 3 steady × 2 exchanges, cool-down 1 × (receive, send)
    (4, 0, 2, 4),  # fewer micro-batches than warm-up slots: every send and receive alone
    (1, 0, 8, 0),
])
def test_pipeline_exchanges_follow_megatron_1f1b_by_hand(pp, stage, micro_batches, waits):
    from launch.plan.collectives import pipeline_exchanges

    assert pipeline_exchanges(pp, stage, micro_batches) == waits


def test_rank_skew_counts_only_ranks_the_measured_pass_did_not_synchronise(tmp_path):
    import dataclasses
    from statistics import NormalDist

    calib = _calibration()
    noisy = dataclasses.replace(calib, compute=dataclasses.replace(
        calib.compute, passes=tuple(dataclasses.replace(p, sd_s=0.01) for p in calib.compute.passes)))
    quiet_path, noisy_path = _write(tmp_path, calib, "quiet.json"), _write(tmp_path, noisy, "noisy.json")

    def total(path, *over):
        return plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}", *over]), envinfo.machine()).step.total_s

    # Two data-parallel ranks, one micro-step: the slower of two normal draws is 0.5894 sd above the mean (Blom).
    c2 = NormalDist().inv_cdf((2 - 0.375) / (2 + 0.25))
    assert c2 == pytest.approx(0.5894, abs=1e-4)
    assert total(noisy_path) - total(quiet_path) == pytest.approx(c2 * 0.01, rel=1e-6)
    # TP 2 on the same two ranks: they met at every TP collective inside the measured pass; nothing is added.
    tp2 = ("parallel.tp=2", "parallel.zero_stage=1")
    assert total(noisy_path, *tp2) == pytest.approx(total(quiet_path, *tp2), rel=1e-12)


def test_full_checkpointing_adds_the_measured_recompute_cost_per_micro_step(tmp_path):
    path = _write(tmp_path, _calibration())
    over = [f"hardware.profile={path}", "parallel.zero_stage=3"]
    plain = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, *over]), envinfo.machine())
    full = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, *over, "train.activation_checkpointing=full"]), envinfo.machine())
    # One micro-step per step: the full pass at micro-batch 4 is the same figure here, so the plans differ only by
    # the engine's recompute cost at ZeRO-3 (0.0009 s).
    assert full.step.total_s - plain.step.total_s == pytest.approx(0.0003 * 3, rel=1e-6)


@pytest.mark.parametrize("change, says", [
    ({"machine_kind": "8 × NVIDIA H100 80GB HBM3"}, "measured on '8 × NVIDIA H100 80GB HBM3'"),
    ({"versions": {"torch": "2.0.0", "deepspeed": "0.19.8"}}, "measured with torch 2.0.0"),
    ({"compute": None}, "no compute figures"),
])
def test_a_calibration_that_does_not_apply_falls_back_to_nominal_and_says_why(tmp_path, change, says):
    path = _write(tmp_path, _calibration(**change))
    nominal = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4]), envinfo.machine())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}"]), envinfo.machine())
    (note,) = [n for n in plan.notes if n.startswith("time:")]
    assert says in note and "nominal" in note and "\n" not in note
    assert plan.step.timing == "nominal" and plan.step.total_s == nominal.step.total_s


def test_missing_pass_for_the_micro_batch_falls_back(tmp_path):
    path = _write(tmp_path, _calibration())
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}", "batch.micro_batch_size=1",
                                                                 "batch.global_batch_size=32"]), envinfo.machine())
    assert plan.step.timing == "calibrated"
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}", "batch.micro_batch_size=16",
                                                                 "batch.global_batch_size=32"]), envinfo.machine())
    assert plan.step.timing == "fitted"
    assert "no deepspeed pass at tp=1, micro_batch_size=16" in next(n for n in plan.notes if n.startswith("time:"))


@pytest.mark.parametrize("content, says", [
    ("{not json", "cannot be read as JSON"),
    ('{"kind": "something else"}', "is not a calibration file"),
    ('{"kind": "layoutlab-calibration", "version": 99}', "is calibration version 99"),
    ('{"kind": "layoutlab-calibration", "version": 1}', "is calibration version 1; this code reads 4"),
    ('{"kind": "layoutlab-calibration", "version": 3}', "is calibration version 3; this code reads 4"),
    ('{"kind": "layoutlab-calibration", "version": 4, "created": "x"}', "is damaged"),
])
def test_a_bad_calibration_file_is_one_line_exit_2(tmp_path, capsys, content, says):
    path = _write(tmp_path, content)
    rc = main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert says in err and "hardware.profile" in err and str(path) in err


@pytest.mark.parametrize("field", ["world_size", "ranks_per_node"])
@pytest.mark.parametrize("value", ["1e400", "18446744073709551617", "2.5", '"2"', "true"])
def test_a_count_that_is_no_whole_number_within_64_bits_is_one_line(tmp_path, capsys, field, value):
    """JSON reads 1e400 as infinity, whose int() raised OverflowError through the reader (a traceback); 2**64 + 1, 2.5,
    "2" and true were taken by int() as counts."""
    text = json.dumps(_calibration().to_dict()).replace(f'"{field}": 2', f'"{field}": {value}', 1)
    assert value in text
    path = _write(tmp_path, text)
    assert main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a whole number within 64 bits" in err and str(path) in err, err


def test_an_impossible_fit_is_refused(tmp_path, capsys):
    d = _calibration().to_dict()
    d["collectives"][0]["alpha_s"] = float("nan")
    path = _write(tmp_path, json.dumps(d))
    assert main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"]) == 2
    assert "impossible fit for all_reduce on 2 ranks" in capsys.readouterr().err


def test_missing_calibration_file_is_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={tmp_path / 'nope.json'}"])
    assert "does not exist" in str(e.value)


def test_a_call_inside_the_measured_range_is_timed_on_the_measured_curve():
    # gloo's curve is not one line: 1 ms at 8 B, 3 ms at 128 KiB, 4 ms at 4 MiB (placements averaged).
    pts = ((8, 0.9e-3), (8, 1.1e-3), (131072, 3e-3), (4194304, 4e-3))
    fit = AlphaBeta("all_reduce", 2, "intra_node", 1e-3, 1e9, pts, "test")
    assert fit.seconds(8) == pytest.approx(1e-3)
    assert fit.seconds(65540) == pytest.approx(1e-3 + 2e-3 * (65540 - 8) / (131072 - 8))
    assert fit.seconds(2 * 4194304) == pytest.approx(1e-3 + 2 * 4194304 / 1e9)  # beyond: the fitted line


@pytest.mark.parametrize("where, value", [("engine", float("inf")), ("engine", -1.0), ("adam", float("nan"))])
def test_impossible_compute_figures_are_refused(tmp_path, capsys, where, value):
    d = _calibration().to_dict()
    if where == "engine":
        d["compute"]["engine"][3]["step_s"] = value
    else:
        d["compute"]["adam_s_per_param"] = value
    path = _write(tmp_path, json.dumps(d))
    assert main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "has an impossible" in err and len(err.strip().splitlines()) == 1


def test_calibrate_refuses_to_replace_a_file_and_a_calibration_as_its_base(tmp_path, capsys):
    keep = tmp_path / "mine.json"
    keep.write_text("precious")
    assert main(["calibrate", str(RECIPES / "tiny_zero2"), f"out={keep}"]) == 2
    assert "never replaces a file" in capsys.readouterr().err and keep.read_text() == "precious"
    path = _write(tmp_path, _calibration())
    assert main(["calibrate", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}"]) == 2
    assert "is already a calibration" in capsys.readouterr().err


@pytest.mark.parametrize("arg, says", [
    ("backends=nope", 'backends="nope" names no backend (nope); name some of: deepspeed, megatron'),
    ("backends=", "names no backend (empty)"),
    ("iters=2", 'iters="2" is not a whole number from 3 to 10000'),
    ("iters=1e9", 'iters="1e9" is not a whole number'),
])
def test_calibrate_arguments_are_checked_before_anything_runs(tmp_path, capsys, monkeypatch, arg, says):
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    assert main(["calibrate", str(RECIPES / "tiny_zero2"), arg]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # nothing created


@pytest.mark.parametrize("mutate, says", [
    (lambda d: d["collectives"][0].update(alpha_s="1ms"), "is damaged"),
    (lambda d: d["collectives"][0].update(points=[[8, float("nan")]]), "impossible measured points"),
    (lambda d: d["collectives"][0].update(points=[[-8, 1e-3]]), "impossible measured points"),
    (lambda d: d["collectives"][0].update(alpha_s=0.0, beta_Bps=float("inf")), "impossible fit"),
    (lambda d: d["collectives"][0].update(beta_Bps=1e308), "impossible fit"),  # past any link's 100 TB/s
    (lambda d: d["compute"]["passes"][0].update(forward_s="fast"), "is damaged"),
    (lambda d: d["compute"]["passes"][0].update(layers_forward_s=1.0), "impossible pass time"),  # > the forward
    (lambda d: d["compute"]["passes"][0].update(embedding_forward_s=-1e-3), "impossible pass time"),
    (lambda d: d["compute"].update(data_s=[1, 2]), "is damaged"),
    (lambda d: d.update(version=True), "is calibration version True"),
    (lambda d: d.update(base_profile="../../etc/x"), "base_profile"),
    (lambda d: d.update(correction=0.0), "impossible correction"),
    (lambda d: d["compute"]["fitted"].update(gemm_tflops=float("nan")), "impossible fitted gemm_tflops"),
    (lambda d: d["compute"]["fitted"].update(memory_GBps=-5), "impossible fitted memory_GBps"),
    (lambda d: d["compute"]["fitted"].update(gemm_half_dim=float("inf")), "impossible fitted gemm_half_dim"),
    (lambda d: d["compute"]["fitted"].pop("attention_forward_tflops"), "is damaged"),
    (lambda d: d["compute"]["fitted"].update(gemm_points=[{"m": 0, "n": 8, "k": 8, "seconds": 1e-6}]), "impossible timed GEMMs"),
    (lambda d: d["compute"]["fitted"].update(gemm_points=[]), "impossible timed GEMMs"),
    (lambda d: d["compute"].pop("fitted"), "has no fitted compute figures"),
])
def test_hostile_calibration_fields_are_one_line(tmp_path, capsys, mutate, says):
    d = _calibration().to_dict()
    mutate(d)
    path = _write(tmp_path, json.dumps(d))
    assert main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_a_calibration_for_another_rank_count_per_node_does_not_apply(tmp_path):
    path = _write(tmp_path, _calibration(ranks_per_node=4))
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}"]), envinfo.machine())
    assert plan.step.timing == "nominal"
    assert "measured with 4 ranks per node" in next(n for n in plan.notes if n.startswith("time:"))


def test_the_verdict_measures_how_far_the_two_sweeps_disagree_and_counts_the_noise():
    from launch.commands.calibrate import Sweep, verdict

    first = [Sweep("all_reduce", 2, "intra_node", ((8, 100e-6), (1024, 200e-6)), "first"),
             Sweep("all_gather", 2, "intra_node", ((8, 50e-6),), "first")]
    last = [Sweep("all_reduce", 2, "intra_node", ((8, 100e-6), (1024, 300e-6)), "last"),
            Sweep("all_gather", 2, "intra_node", ((8, 60e-6), (64, 1.0)), "last")]  # 64 B only once: not compared
    v = verdict(first, last, noise_terms=1, engine_terms=12)
    # by hand: 0 (equal), |200-300|/250 = 0.4, |50-60|/55 = 0.1818...: median 0.1818, worst 0.4
    assert v.spread_median == pytest.approx(10 / 55) and v.spread_worst == pytest.approx(0.4)
    assert v.worst == "all_reduce 2 ranks 1024 B" and not v.steady  # 18% > 15%
    (line,) = v.lines()
    assert line.startswith("verdict: noisy") and "median 18%" in line and "1 of 12 engine-cost terms" in line
    steady = verdict(first[:1], [Sweep("all_reduce", 2, "intra_node", ((8, 100e-6), (1024, 210e-6)), "last")], 3, 12)
    assert steady.steady and steady.lines()[0].startswith("verdict: steady")
    assert not verdict(first[:1], first[:1], 4, 12).steady  # a third of the engine terms were noise


@pytest.mark.parametrize("rate, half_dim", [(1e11, 16.0), (7e14, 2 ** (69 / 8))])
def test_the_gemm_fit_recovers_the_curve_it_was_drawn_from(rate, half_dim):
    # Timings drawn from a CPU core's curve and from an H100-like one (half dimension ~400), squares and thin shapes,
    # 5% apart up and down: the fit lands on the drawn half dimension and rate.
    shapes = [(s, s, s) for s in (32, 64, 128, 256, 512, 1024, 4096)] + [(2048, 64, 512), (16, 1024, 1024), (4096, 128, 4096)]
    points = [GemmPoint(m, n, k, 2.0 * m * n * k / (rate * gemm_shape_factor(m, n, k, half_dim)) * (1.05, 0.95)[i % 2])
              for i, (m, n, k) in enumerate(shapes)]
    fitted_rate, fitted_half = fit_gemm(points)
    assert fitted_half == pytest.approx(half_dim, rel=0.1) and fitted_rate == pytest.approx(rate, rel=0.05)


def test_a_layout_the_passes_miss_is_timed_on_the_figures_fitted_on_this_machine(tmp_path):
    """Compute-model time is FLOPs over a rate or bytes over a bandwidth: figures equal to the nominal profile's give
    the nominal compute exactly, every rate doubled gives half of it. Collectives come from the calibration's α–β
    curves (1 ms + bytes / 0.5 GB/s)."""
    recipe = RECIPES / "tiny_zero2"
    miss = [*MB4, "batch.seq_len=32"]  # the passes were measured at seq_len 64
    nominal = plan_resolved(resolve_path(recipe, miss), envinfo.machine())
    for scale in (1.0, 2.0):
        path = _write(tmp_path, _calibration(compute=dataclasses.replace(_calibration().compute, fitted=_fitted(scale))),
                      f"calib{scale}.json")
        plan = plan_resolved(resolve_path(recipe, [*miss, f"hardware.profile={path}"]), envinfo.machine())
        assert plan.step.timing == "fitted" and "seq_len=64" in next(n for n in plan.notes if n.startswith("time:"))
        assert plan.step.compute_s == pytest.approx(nominal.step.compute_s / scale, rel=1e-9)
        rs = next(c for c in plan.comm if c.collective == "reduce_scatter")
        assert rs.time_s == pytest.approx(rs.calls_per_step * (ALPHA + rs.message_bytes / BETA), rel=1e-6)
        assert "fitted on this machine by calibrate" in plan.step.assumptions


def test_a_rate_above_the_data_sheet_is_a_share_above_one_and_the_peak_stays_the_data_sheets(tmp_path):
    # The CPU profile says 0.05 TFLOP/s and 10 GB/s; a core with AMX measured 0.2 TFLOP/s and 12 GB/s. MFU's
    # denominator stays the data sheet's peak, for calibrated and nominal runs alike.
    fitted = dataclasses.replace(_fitted(), gemm_tflops=0.2, memory_GBps=12.0, attention_forward_tflops=0.04,
                                 attention_backward_tflops=0.03)
    path = _write(tmp_path, _calibration(compute=dataclasses.replace(_calibration().compute, fitted=fitted)))
    r = resolve_path(RECIPES / "tiny_zero2", [f"hardware.profile={path}"])
    hw = r.hardware
    assert hw.peak_tflops["fp32"] == 0.05 and hw.hbm_GBps == 10.0
    assert hw.efficiency.gemm == pytest.approx(4.0) and hw.efficiency.memory == pytest.approx(1.2)
    assert (hw.efficiency.attention["sdpa"].forward, hw.efficiency.attention["sdpa"].backward) == pytest.approx((0.8, 0.6))
    # resolved.json keeps the shares above one (a run's record is read back for its report)
    assert type(r).from_json(r.to_json()).hardware.efficiency.gemm == pytest.approx(4.0)


@pytest.mark.parametrize("change, says", [
    ({"gemm_tflops": 6.0}, "compute.fitted=\"gemm 6\" is more than 100x the cpu data sheet"),
    ({"memory_GBps": 1e4}, "compute.fitted=\"memory 10000\" is more than 100x"),
    ({"dtype": "int8"}, "fitted its compute figures at 'int8', its passes at 'fp32'"),
])
def test_a_fitted_figure_no_probe_can_measure_is_one_line(tmp_path, capsys, change, says):
    fitted = dataclasses.replace(_fitted(), **change)
    path = _write(tmp_path, _calibration(compute=dataclasses.replace(_calibration().compute, fitted=fitted)))
    assert main(["run", str(RECIPES / "tiny_zero2"), f"hardware.profile={path}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_a_calibration_without_a_collective_keeps_its_passes_and_times_that_call_nominally(tmp_path):
    path = _write(tmp_path, _calibration(collectives=tuple(c for c in _calibration().collectives
                                                          if c.op != "reduce_scatter")))
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4, f"hardware.profile={path}"]), envinfo.machine())
    assert plan.step.timing == "calibrated"
    assert "no reduce_scatter on 2 ranks intra-node" in next(n for n in plan.notes if n.startswith("time:"))
    nominal = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*MB4]), envinfo.machine())
    (rs,), (nominal_rs,) = ([c for c in p.comm if c.collective == "reduce_scatter"] for p in (plan, nominal))
    assert rs.time_s == nominal_rs.time_s  # the nominal figures for the one call the calibration lacks


@pytest.mark.parametrize("change, dtype, says", [
    ({"machine_kind": "8 × NVIDIA H100 80GB HBM3"}, "fp32", "measured on '8 × NVIDIA H100 80GB HBM3'"),
    ({"compute": dataclasses.replace(_calibration().compute, fitted=_fitted(2.0))}, "bf16",
     "its compute was measured for tiny-llama fp32"),
])
def test_figures_fitted_on_another_machine_or_dtype_leave_the_nominal_ones(tmp_path, change, dtype, says):
    miss = [*MB4, "batch.seq_len=32", f"precision.dtype={dtype}"]
    nominal = plan_resolved(resolve_path(RECIPES / "tiny_zero2", miss), envinfo.machine())
    path = _write(tmp_path, _calibration(**change))
    plan = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [*miss, f"hardware.profile={path}"]), envinfo.machine())
    assert plan.step.timing == "nominal" and says in next(n for n in plan.notes if n.startswith("time:"))
    assert plan.step.compute_s == nominal.step.compute_s and plan.step.mfu == nominal.step.mfu


def test_a_failed_measurement_says_why(tmp_path):
    """A launch of measuring ranks that fails names what it measured, its exit code and the end of its log (the ranks'
    traceback), not only that it failed: CI's only view of a failure deep in a calibration."""
    import sys

    from launch.commands.calibrate import MeasurementFailed, _launch
    from launch.run.launcher import LaunchCommand

    script = "import sys\nfor i in range(40): print(f'line {i}')\nsys.exit(3)"
    log = tmp_path / "calibrate.log"
    with pytest.raises(MeasurementFailed) as e:
        _launch(LaunchCommand((sys.executable, "-c", script), {}), log, "the torch measurements at tp=2")
    lines = str(e.value).splitlines()
    assert lines[0] == f"the torch measurements at tp=2 failed (exit 3); the end of {log}:"
    assert lines[1:] == [f"  | line {i}" for i in range(15, 40)]


def test_a_measurement_that_fails_once_is_made_again_and_noted(tmp_path):
    """With notes, a failed launch runs once more: its first log is kept beside (`.failed`), the notes name its last
    line, and the log holds the second launch's output; a launch that fails twice is the error, with the second log."""
    import sys

    from launch.commands.calibrate import MeasurementFailed, _launch
    from launch.run.launcher import LaunchCommand

    marker = tmp_path / "tried"
    flaky = (f"import pathlib, sys\nm = pathlib.Path({str(marker)!r})\n"
             "if m.exists(): print('measured')\nelse: m.touch(); print('Connection reset by peer'); sys.exit(1)")
    log, notes = tmp_path / "calibrate.log", []
    _launch(LaunchCommand((sys.executable, "-c", flaky), {}), log, "the torch measurements at tp=2", notes)
    kept = tmp_path / "calibrate.failed.log"
    assert (log.read_text(), kept.read_text()) == ("measured\n", "Connection reset by peer\n")
    assert notes == [f"the torch measurements at tp=2: the first launch failed (exit 1: Connection reset by peer; "
                     f"{kept}), the second measured"]
    always = "import sys\nprint('broken'); sys.exit(4)"
    with pytest.raises(MeasurementFailed) as e:
        _launch(LaunchCommand((sys.executable, "-c", always), {}), log, "the deepspeed measurements at tp=1", [])
    assert str(e.value).splitlines() == [f"the deepspeed measurements at tp=1 failed (exit 4); the end of {log}:",
                                         "  | broken"]
