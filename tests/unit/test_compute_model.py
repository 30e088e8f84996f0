"""The step's compute from the model's shapes (launch/plan/compute.py), held to hand-computed numbers: the FLOPs it
times are the model's, each kind moves the way its physics says, and a profile without a figure is one line."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from launch.config.grid import RankGrid
from launch.config.hardware import HardwareProfile, load_profile
from launch.config.models import load_model
from launch.config.resolve import resolve_path
from launch.errors import ConfigError
from launch.plan.build import make_plan, plan_resolved
from launch.plan.compute import compute, gemm_s, _rates
from launch.plan.layout import Layout

REPO = Path(__file__).resolve().parents[2]
H100 = json.loads((REPO / "launch/config/catalogue/hardware/h100-sxm.json").read_text())


def layout(**kw) -> Layout:
    base = dict(backend="torch", model=load_model("llama-3.1-8b"), hardware=load_profile("h100-sxm"),
                grid=RankGrid(1, 1, 8, 8, 1), zero_stage=3, dtype="bf16", micro_batch_size=2, global_batch_size=16,
                seq_len=8192)
    return Layout(**{**base, **kw})


def test_a_large_gemm_runs_at_the_profiles_efficiency_less_its_shape_factor():
    eff = H100["efficiency"]
    peak = H100["peak_tflops"]["bf16"] * 1e12
    half = eff["gemm_half_dim"]
    expected = 2 * 8192 * 4096 * 14336 / (peak * eff["gemm"] * (8192 / (8192 + half)) * (4096 / (4096 + half))
                                          * (14336 / (14336 + half)))
    assert gemm_s(8192, 4096, 14336, _rates(layout()), 2) == pytest.approx(expected, rel=1e-12)
    # a GEMM too thin to be compute-bound takes the time its bytes take over the profile's bandwidth
    bw = H100["hbm_GBps"] * 1e9 * eff["memory"]
    assert gemm_s(8192, 1, 4096, _rates(layout()), 2) == pytest.approx((8192 * 4096 + 4096 + 8192) * 2 / bw, rel=1e-12)


def test_the_gemms_it_times_do_the_models_flops():
    """Llama 3.1 8B from its config: per layer q 4096², k and v 4096·1024 each, o 4096², gate, up, down 4096·14336;
    the output layer 4096 × 128256; forward and backward 6 FLOPs a parameter a token."""
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    tokens = 2 * 8192
    for tp in (1, 2, 8):
        lay = layout(grid=RankGrid(tp, 1, 8 // tp, 8, 1), global_batch_size=2 * (8 // tp))
        c = compute(lay)
        flops = c.gemm_peak_share * lay.hardware.peak_flops("bf16") * c.gemm_s
        assert flops == pytest.approx(6 * tokens * (32 * per_layer + 4096 * 128256) / tp, rel=1e-9)


def test_full_checkpointing_adds_a_forward_of_the_layers_but_not_of_the_output_layer_on_deepspeed():
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    none = compute(layout(backend="deepspeed"))
    full = compute(layout(backend="deepspeed", activation_checkpointing="full"))
    flops = lambda c: c.gemm_peak_share * c.gemm_s  # noqa: E731 (peak cancels)
    assert flops(full) / flops(none) == pytest.approx((8 * 32 * per_layer + 6 * 4096 * 128256)
                                                      / (6 * 32 * per_layer + 6 * 4096 * 128256), rel=1e-9)
    assert full.recompute_s > 0 and none.recompute_s == 0


def test_compile_shrinks_the_memory_bound_work_and_nothing_else():
    eager, compiled = compute(layout()), compute(layout(compile=True))
    assert compiled.gemm_s == eager.gemm_s and compiled.attention_s == eager.attention_s
    assert compiled.memory_s < eager.memory_s / 2  # eager RMSNorm's six fp32 kernels become one


def test_a_tp_split_leaves_thinner_gemms_further_from_peak():
    shares = [compute(layout(grid=RankGrid(tp, 1, 8 // tp, 8, 1), global_batch_size=2 * (8 // tp))).gemm_peak_share
              for tp in (1, 2, 4, 8)]
    assert shares == sorted(shares, reverse=True) and shares[0] - shares[-1] > 0.02


def test_the_te_kernel_is_faster_than_sdpa_and_eager_attention_slower_on_h100():
    sdpa, te, eager = (compute(layout(attention=a)).attention_s for a in ("sdpa", "te", "eager"))
    assert te < sdpa < eager


def test_the_7b_matrix_no_longer_shares_one_mfu():
    mfus = {name: plan_resolved(resolve_path(REPO / "recipes" / name)).step.mfu
            for name in ("7b_ddp", "7b_fsdp2", "7b_fsdp2_ac", "7b_tp2_fsdp2", "7b_tp2_fsdp2_sp", "7b_tp4", "7b_tp4_sp",
                         "7b_zero1", "7b_zero3", "7b_zero3_ac")}
    assert len({round(m, 3) for m in mfus.values()}) >= 8, mfus
    # recomputation costs time: each checkpointed cell below its plain twin
    assert mfus["7b_fsdp2_ac"] < mfus["7b_fsdp2"] and mfus["7b_zero3_ac"] < mfus["7b_zero3"]


def test_the_mfu_terms_add_up_to_the_step():
    plan = make_plan(layout(grid=RankGrid(2, 1, 4, 8, 1), global_batch_size=8, sp=True))
    terms = plan.step.terms()
    assert sum(terms.values()) == pytest.approx(1.0, rel=1e-9)
    assert terms["exposed communication"] > 0 and terms["GEMMs"] > terms["attention"]


@pytest.mark.parametrize("drop, field", [("gemm", "efficiency.gemm"), ("attention", "efficiency.attention")])
def test_a_profile_missing_a_figure_is_one_line_naming_it(drop, field):
    d = {**H100, "efficiency": {k: v for k, v in H100["efficiency"].items() if k != drop}, "name": "my-gpu"}
    with pytest.raises(ConfigError) as e:
        HardwareProfile.from_dict(d, "my-gpu.json")
    assert "my-gpu.json" in str(e.value) and field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), "0.7", True])
def test_an_impossible_efficiency_is_refused(value):
    d = {**H100, "efficiency": {**H100["efficiency"], "memory": value}}
    with pytest.raises(ConfigError, match="efficiency.memory"):
        HardwareProfile.from_dict(d, "h100.json")


def test_a_profile_written_before_the_compute_model_reads_with_the_shipped_figures():
    """resolved.json of older runs: achievable_mfu, no efficiency block."""
    old = {k: v for k, v in H100.items() if k != "efficiency"} | {"achievable_mfu": 0.4}
    read = HardwareProfile.from_dict(old)
    assert read.efficiency == load_profile("h100-sxm").efficiency
    assert replace(read, efficiency=None).to_dict()["efficiency"] is None


def test_a_kernel_the_profile_has_no_figures_for_is_refused_before_launch():
    """A T4 has no Transformer Engine figures (its profile lists sdpa only): the plan could not time te there."""
    over = ["backend=megatron", "train.attention=te", "parallel.zero_stage=1", "precision.dtype=fp32"]
    with pytest.raises(ConfigError, match=r'train.attention="te" has no efficiency figures in the t4 profile'):
        resolve_path(REPO / "recipes/0.5b_t4_ddp", over)
    assert resolve_path(REPO / "recipes/0.5b_t4_ddp", over[:1] + ["train.attention=eager"] + over[2:]).recipe \
        .train.attention == "eager"  # eager attention needs no kernel figures: its GEMMs and bytes are timed


def test_an_offloaded_optimizer_is_not_also_stepped_on_the_device():
    on_device = compute(layout(backend="deepspeed", zero_stage=2))
    offloaded = compute(layout(backend="deepspeed", zero_stage=2, offload_optimizer="cpu"))
    part = (8_030_261_248 // 8)  # Llama 3.1 8B's parameters over 8 data-parallel ranks, fused Adam's 30 B each
    bw = H100["hbm_GBps"] * 1e9 * H100["efficiency"]["memory"]
    assert on_device.optimizer_s - offloaded.optimizer_s == pytest.approx(part * 30 / bw, rel=1e-3)


def test_an_old_profile_no_shipped_one_names_is_one_line():
    old = {k: v for k, v in H100.items() if k != "efficiency"} | {"achievable_mfu": 0.4, "name": "my-cluster"}
    with pytest.raises(ConfigError, match="efficiency") as e:
        HardwareProfile.from_dict(old, "runs/x/resolved.json")
    assert "runs/x/resolved.json" in str(e.value) and "\n" not in str(e.value)


def test_full_recompute_flops_are_the_layers_forward_not_the_output_layers():
    """Llama 3.1 8B: 6,979,588,096 parameters outside the embedding and output layer (32 × (4096² · 2 + 4096 · 1024 · 2
    + 3 · 4096 · 14336) + the 65 norms' 4096 each); a forward is 2 FLOPs each per token, plus attention's 4·L·h·s."""
    plan = make_plan(layout(backend="deepspeed", activation_checkpointing="full"))
    tokens = 16 * 8192
    per_token = 2 * 6_979_588_096 + 4 * 32 * 4096 * 8192
    assert plan.step.hardware_flops_per_step - plan.step.model_flops_per_step == pytest.approx(tokens * per_token,
                                                                                               rel=1e-12)
