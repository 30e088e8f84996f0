"""The planner against published numbers: the ZeRO paper, DeepSpeed's own estimators, Korthikanti et al."""
import json
import math

import pytest

from launch.config.grid import RankGrid
from launch.config.hardware import load_profile
from launch.config.models import load_model
from launch.config.resolve import resolve_path
from launch.plan.build import make_plan, plan_resolved
from launch.plan.collectives import communication
from launch.plan.layout import Layout, Plan
from launch.plan.memory import activation_terms, layer_activation_bytes, model_states, stage_params
from tests.conftest import RECIPES

H100 = load_profile("h100-sxm")
LLAMA7 = load_model("llama-2-7b")


def layout(dp=1, tp=1, pp=1, zero=0, backend="deepspeed", model=LLAMA7, gpn=8, **kw):
    nodes = max(1, tp * pp * dp // gpn)
    return Layout(backend=backend, model=model, hardware=H100, grid=RankGrid(tp, pp, dp, min(gpn, tp * pp * dp), nodes),
                  zero_stage=zero, dtype=kw.pop("dtype", "bf16"), micro_batch_size=kw.pop("micro", 1),
                  global_batch_size=kw.pop("gbs", dp * kw.pop("ga", 1)), seq_len=kw.pop("seq", 4096), **kw)


@pytest.mark.parametrize("n", [4, 64])
def test_zero_paper_table(n):
    psi = 7_500_000_000
    want = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for z, bytes_ in want.items():
        w, g, o, host = model_states(layout(dp=n, zero=z), psi, "zero_paper")
        assert w + g + o == pytest.approx(bytes_, rel=1e-9), z
        assert host == 0


def test_zero_paper_example_7_5b_on_64():
    psi = 7_500_000_000
    dp_total = sum(model_states(layout(dp=64, zero=0), psi, "zero_paper")[:3])
    z3_total = sum(model_states(layout(dp=64, zero=3), psi, "zero_paper")[:3])
    assert dp_total / 1e9 == pytest.approx(120.0)
    assert z3_total / 1e9 == pytest.approx(1.875) and round(z3_total / 1e9, 1) == 1.9


@pytest.mark.parametrize("zero, off_opt, off_par", [(2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"),
                                                    (3, "cpu", "none"), (3, "cpu", "cpu")])
def test_matches_deepspeed_estimators_7b_on_4_gpus(zero, off_opt, off_par):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
    )

    pc = LLAMA7.param_counts()
    lay = layout(dp=4, zero=zero, gpn=4, offload_optimizer=off_opt, offload_params=off_par)
    params, _ = stage_params(lay, 0)
    assert params == pc.total
    w, g, o, host = model_states(lay, params, "deepspeed")
    if zero == 2:
        _, gpu = estimate_zero2_model_states_mem_needs(pc.total, 4, 1, cpu_offload=off_opt != "none")
    else:
        gpu = estimate_zero3_model_states_mem_needs(pc.total, pc.largest_layer, 4, 1, cpu_offload=off_opt != "none",
                                                    cpu_offload_params=off_par != "none")[1]
    assert w + g + o == gpu
    assert (host > 0) == (off_opt != "none")


@pytest.mark.parametrize("zero, off_opt, off_par, gpn, nodes", [
    (1, "none", "none", 4, 1), (2, "none", "none", 4, 1), (2, "cpu", "none", 4, 1), (2, "cpu", "none", 2, 1),
    (2, "none", "none", 4, 2), (3, "none", "none", 4, 1), (3, "cpu", "none", 4, 1), (3, "cpu", "cpu", 4, 1),
    (3, "cpu", "none", 4, 2), (3, "cpu", "cpu", 4, 2), (3, "none", "none", 8, 2)])
def test_host_memory_matches_deepspeed_estimators_cpu_column(zero, off_opt, off_par, gpn, nodes):
    """The CPU column of DeepSpeed's own estimators (ZeRO-3 with zero_init: the deepspeed backend builds under zero.Init),
    ±2%."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
    )

    pc = LLAMA7.param_counts()
    lay = layout(dp=gpn * nodes, zero=zero, gpn=gpn, offload_optimizer=off_opt, offload_params=off_par)
    plan = make_plan(lay)
    if zero < 3:
        cpu, _ = estimate_zero2_model_states_mem_needs(pc.total, gpn, nodes, cpu_offload=off_opt != "none")
    else:
        cpu = estimate_zero3_model_states_mem_needs(pc.total, pc.largest_layer, gpn, nodes, cpu_offload=off_opt != "none",
                                                    cpu_offload_params=off_par != "none", zero_init=True)[0]
    assert plan.host_bytes_per_node == pytest.approx(cpu, rel=0.02)


def _korthikanti(s, b, h, a, t=1, sp=False, activation_checkpointing="none"):
    terms = activation_terms("gpt", s, b, h, a)
    return layer_activation_bytes(terms, t=t, sp=sp, activation_checkpointing=activation_checkpointing)


@pytest.mark.parametrize("s, b, h, a, t", [(2048, 1, 12288, 96, 8), (4096, 2, 4096, 32, 2), (1024, 4, 2048, 16, 4)])
def test_korthikanti_formulas(s, b, h, a, t):
    sbh = s * b * h
    assert _korthikanti(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert _korthikanti(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _korthikanti(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert _korthikanti(s, b, h, a, t, sp=True, activation_checkpointing="selective") == pytest.approx(34 * sbh / t)
    assert _korthikanti(s, b, h, a, activation_checkpointing="full") == pytest.approx(2 * sbh)


def test_llama_layer_has_no_quadratic_term_and_sp_shards_everything():
    m = LLAMA7
    terms = activation_terms("llama", 4096, 1, m.hidden_size, m.num_heads, ffn=m.intermediate_size,
                             kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    full = layer_activation_bytes(terms)
    assert not any(t.scores for t in terms)
    assert layer_activation_bytes(terms, t=4, sp=True) == pytest.approx(full / 4)
    assert full / 4 < layer_activation_bytes(terms, t=4) < full
    # doubling the sequence doubles a fused-attention layer's activations exactly
    twice = layer_activation_bytes(activation_terms("llama", 8192, 1, m.hidden_size, m.num_heads, ffn=m.intermediate_size,
                                                    kv_heads=m.num_kv_heads, head_dim=m.head_dim))
    assert twice == pytest.approx(2 * full, rel=1e-6)


def test_megatron_tp_shards_sum_to_the_model():
    for model in (LLAMA7, load_model("qwen2.5-0.5b")):
        pc = model.param_counts()
        for t in (1, 2):
            lay = layout(tp=t, backend="megatron", model=model)
            params, layers = stage_params(lay, 0)
            replicated = layers * pc.norms_per_layer + pc.final_norm
            assert params * t - replicated * (t - 1) == pc.total


def test_pipeline_stages_split_layers_and_embeddings():
    lay = layout(pp=4, backend="megatron", ga=8, gbs=8)
    first, layers = stage_params(lay, 0)
    last, _ = stage_params(lay, 3)
    mid, _ = stage_params(lay, 1)
    emb = LLAMA7.vocab_size * LLAMA7.hidden_size
    assert layers == 8 and first - mid == emb and last - mid == emb + LLAMA7.hidden_size
    plan = make_plan(lay)
    # 1F1B: stage 0 holds p micro-batches in flight, the last stage one
    flights = {rp.pp_stage: rp.micro_batches_in_flight for rp in plan.ranks}
    assert flights[0] == 4 and flights[3] == 1
    # 1F1B's bubble is the other stages' first micro-batch: twice the micro-batches leave it as it is, and with the
    # output layer on the last stage (the slowest, which sets the pace) it is under (p-1)/m of the compute.
    doubled = make_plan(layout(pp=4, backend="megatron", ga=16, gbs=16)).step
    assert doubled.bubble_s == pytest.approx(plan.step.bubble_s, rel=1e-9)
    assert doubled.compute_s > 1.9 * plan.step.compute_s
    assert 0.8 * plan.step.compute_s * 3 / 8 < plan.step.bubble_s < plan.step.compute_s * 3 / 8


def test_zero3_moves_one_and_a_half_times_the_bytes_of_dp():
    """The ZeRO paper's accounting, 16-bit gradients reduced in 16 bits (precision.grad_reduce_dtype=bf16)."""
    def dp_bytes(z, reduce="bf16"):
        return sum(c.bytes_per_rank for c in communication(layout(dp=8, zero=z, grad_reduce_dtype=reduce))
                   if c.parallelism == "dp")

    # fp32 reductions (the default) move twice the bytes (ZeRO-0 moves gradients alone, and a few bytes of the loss)
    assert dp_bytes(0, "fp32") == pytest.approx(2 * dp_bytes(0), rel=1e-6)

    assert dp_bytes(1) == pytest.approx(dp_bytes(0), rel=1e-6)
    assert dp_bytes(2) == pytest.approx(dp_bytes(0), rel=1e-6)
    # ZeRO-3 gathers the parameters twice (forward, backward: 7B exceeds stage3_max_reuse_distance) except the
    # persistent ones (the norms, <= 1e5 elements), gathered once after the step: 2 × 4096 × 32 + 4096 elements.
    persistent = (2 * 4096 * 32 + 4096) * 2 * 7 / 8
    assert dp_bytes(3) == pytest.approx(1.5 * dp_bytes(0) - persistent, abs=64)


def test_tp_comm_counts_and_link():
    lay = layout(tp=2, dp=4, backend="megatron", gpn=4, gbs=4)
    tp = [c for c in communication(lay) if c.parallelism == "tp"]
    # 2 forward + 2 backward per layer × 32 layers, + the embedding's output and the output layer's input
    # gradient; then the vocab-parallel cross entropy's 3 per-token reductions; after the step the backend's own
    # gradient norm over TP (it clips at ZeRO-0), one fp64 value
    assert len(tp) == 3 and tp[0].calls_per_step == 4 * 32 + 2 and tp[0].link == "intra_node"
    assert tp[1].calls_per_step == 3 and tp[1].message_bytes == 4 * lay.seq_len * lay.micro_batch_size
    assert (tp[2].calls_per_step, tp[2].message_bytes, tp[2].after_step) == (1, 8, True)
    assert tp[0].message_bytes == 4096 * 4096 * 2
    dp = [c for c in communication(lay) if c.parallelism == "dp"]
    assert dp and all(c.link == "inter_node" for c in dp)  # 8 ranks on 4-GPU nodes: the DP group spans both


def test_fit_check_and_plan_json_round_trip():
    dp = plan_resolved(resolve_path(RECIPES / "7b_zero3_ac", ["parallel.zero_stage=0"]))
    assert not dp.fits
    flagship = plan_resolved(resolve_path(RECIPES / "7b_tp2_zero3"))
    assert flagship.fits
    back = Plan.from_json(flagship.to_json())
    assert back == flagship
    d = json.loads(flagship.to_json())
    assert d["fits"] is True and d["ranks"][0]["memory"]["megatron"]["total"] > 0


def test_mfu_definition():
    p = make_plan(layout(dp=8, zero=3, gbs=8))
    s = p.step
    tokens = 8 * 4096
    assert s.mfu == pytest.approx(s.model_flops_per_step / s.total_s / 8 / 989e12)
    assert s.tokens_per_s_per_device == pytest.approx(tokens / s.total_s / 8)
    per_token = 6 * LLAMA7.param_counts().flops_params + 12 * 32 * 32 * 128 * 4096
    assert s.model_flops_per_step == pytest.approx(per_token * tokens)
    assert math.isclose(s.mfu, 0.40, rel_tol=0.2)  # compute-bound layout: close to the assumed efficiency


@pytest.mark.parametrize("dtype, bytes_per_param", [("bf16", (6, 12)), ("fp16", (4, 16)), ("fp32", (8, 8))])
def test_megatron_distributed_optimizer_table(dtype, bytes_per_param):
    fixed, sharded = bytes_per_param  # Megatron-Core's docs: bytes/param = fixed + sharded / d
    lay = layout(dp=8, zero=1, backend="megatron", dtype=dtype)
    w, g, o, _ = model_states(lay, 1_000_000, "megatron")
    assert w + g == fixed * 1_000_000 and o == sharded * 1_000_000 / 8


def test_autotp_all_reduce_count_and_post_step_gather_is_exposed():
    lay = layout(tp=2, dp=1, gbs=1)
    tp = [c for c in communication(lay) if c.collective == "all_reduce" and c.parallelism == "tp"]
    # per layer: 2 forward (o_proj, down_proj) + 5 backward (q, k, v, gate, up), plus lm_head's input grad
    assert tp[0].calls_per_step == 7 * 32 + 1
    z1 = make_plan(layout(dp=4, zero=1, gpn=1, gbs=64))  # 4 nodes of 1 GPU: gathers cross the network
    gather = [c for c in z1.comm if c.after_step]
    assert gather and z1.step.dp_exposed_s >= sum(c.time_s for c in gather)


def test_host_memory_is_fit_checked():
    plan = plan_resolved(resolve_path(RECIPES / "0.5b_t4_zero2_ac", [
        "model.name=llama-2-7b", "parallel.zero_stage=3", "parallel.offload_optimizer=cpu",
        "parallel.offload_params=cpu", "batch.seq_len=512"]))
    assert all(r.fits for r in plan.ranks) and not plan.host_fits and not plan.fits
    assert plan.host_bytes_per_node > 2 * 50 * 2**30  # two ranks' fp32 optimizer state + params of 7B


def test_tp_calls_by_pipeline_stage():
    """Megatron, 2 layers on the stage, 2 micro-batches; hand-counted from launch/config/backends.py's per-layer calls."""
    from launch.plan.collectives import tp_calls

    def calls(sp, first, last):
        return {c.collective: c.layers + c.head + c.loss + c.logits
                for c in tp_calls("megatron", sp=sp, layers=2, micro_batches=2, activation_checkpointing="none",
                                  first_stage=first, last_stage=last)}

    # TP: 4 per layer; the embedding's all-reduce on the first stage; on the last the output layer's + 3 (loss)
    assert calls(False, True, False) == {"all_reduce": (4 * 2 + 1) * 2}
    assert calls(False, False, True) == {"all_reduce": (4 * 2 + 1 + 3) * 2}
    assert calls(False, False, False) == {"all_reduce": 4 * 2 * 2}
    # SP: 6 gathers and 4 reduce-scatters per layer; embedding 1 + 1, output layer 2 + 1, loss 3 all-reduces
    assert calls(True, True, False) == {"all_gather": (6 * 2 + 1) * 2, "reduce_scatter": (4 * 2 + 1) * 2}
    assert calls(True, False, True) == {"all_gather": (6 * 2 + 2) * 2, "reduce_scatter": (4 * 2 + 1) * 2,
                                        "all_reduce": 3 * 2}


def test_host_memory_counts_the_whole_model_built_on_every_rank_under_tp():
    """TP 2 × dp 2 on one 4-GPU node, no offload: each of the 4 processes builds the whole fp32 7B model on the
    host first (trainers/common.build_model), so 1.5 × 4 ranks × 4 B × every parameter."""
    plan = make_plan(layout(tp=2, dp=2, zero=1, gpn=4))
    assert plan.host_bytes_per_node == int(1.5 * 4 * 4 * LLAMA7.param_counts().total)


@pytest.mark.parametrize("value", [0, "auto", -5, None, float("nan")])
def test_bucket_sizes_deepspeed_would_replace_fall_back_to_its_default(value):
    lay = layout(dp=8, zero=2, ds_zero={"reduce_bucket_size": value})
    (rs,) = [c for c in communication(lay) if c.collective == "reduce_scatter"]
    assert rs.calls_per_step == 14  # 6.74e9 parameters over 5e8-element buckets


def test_the_megatron_backend_s_own_step_collectives():
    """After the micro-batches the Megatron backend sums the SP norm gradients over TP (one call: 2 norms per layer
    + the final norm, of hidden_size fp32 weights each), clips over TP x PP at ZeRO-0 (one fp64) and broadcasts the
    loss from the last pipeline stage; the DeepSpeed backend adds none of these."""
    def step(recipe, *overrides, stage=0):
        lay = Layout.from_resolved(resolve_path(RECIPES / recipe, list(overrides)))
        return [(c.parallelism, c.collective, c.group_size, c.message_bytes)  # ZeRO's after-step gathers aside
                for c in communication(lay, stage=stage) if c.after_step and c.collective != "all_gather"]

    hidden = 64  # tiny-llama, 4 layers
    assert step("tiny_tp2_sp") == [("sp", "all_reduce", 2, (2 * 4 + 1) * hidden * 4), ("tp", "all_reduce", 2, 8)]
    assert step("tiny_tp2_sp", "parallel.sp=false", "parallel.pp=2", "hardware.gpus_per_node=4") == [
        ("tp", "all_reduce", 4, 8), ("pp", "broadcast", 2, 4)]
    # ZeRO-1, Megatron's distributed optimizer: the logged loss over dp, then the clip's norm over every rank
    # (grad_stats_parallel_group), one fp32 each
    assert step("tiny_tp2_sp", "parallel.sp=false", "parallel.zero_stage=1", "hardware.gpus_per_node=4") == [
        ("dp", "all_reduce", 2, 4), ("dp", "all_reduce", 4, 4)]
    assert not step("tiny_zero2", "parallel.tp=2")  # AutoTP, ZeRO-2 over dp 1: nothing of the backend's own


def test_pipeline_sends_count_each_chunk_boundary():
    """Per micro-batch, one send or receive forward and one backward at each boundary of each of a stage's model
    chunks: the end stages of pp=4 have one boundary, the middle ones two; with pp=2 x vpp=2 the chunks are the
    virtual stages 0, 2 (stage 0) and 1, 3 (stage 1), three boundaries each."""
    def sends(lay):
        return [sum(c.calls_per_step for c in communication(lay, stage=s) if c.collective == "send_recv")
                for s in range(lay.grid.pp)]

    assert sends(layout(pp=4, backend="megatron", gpn=4, gbs=8)) == [2 * 8, 4 * 8, 4 * 8, 2 * 8]
    assert sends(layout(pp=2, vpp=2, backend="megatron", gpn=2, gbs=8)) == [6 * 8, 6 * 8]


def test_after_the_step_the_loss_mean_and_deepspeed_s_gradient_norm_cross_the_data_parallel_group():
    """The loop's loss mean, and DeepSpeed's gradient norm (clip_grad_norm_ all-reduces it over the data-parallel
    group; measured at ZeRO-0 on 2 gloo ranks: 3 all-reduces per step, the gradient bucket and these two), except
    where the backend clips itself: the megatron backend at ZeRO-0 (DeepSpeed's clipping off there), and at ZeRO-1
    Megatron's distributed optimizer, whose norm spans every rank (a call of its own; here every rank is dp)."""
    def after(z, backend="deepspeed"):
        return [c.calls_per_step for c in communication(layout(dp=2, zero=z, gpn=2, backend=backend))
                if c.collective == "all_reduce" and c.after_step]

    assert after(0) == [2] and after(1) == [2] and after(3) == [2]
    assert after(0, "megatron") == [1] and after(1, "megatron") == [1, 1]


TINY_PARAMS = 213_568  # tiny-llama: 2 × 512 × 64 (embedding, lm_head) + 64 (final norm) + 4 blocks of 36,992
TINY_ROOT, TINY_BLOCK = 2 * 512 * 64 + 64, 36_992


@pytest.mark.parametrize("dtype, zero, want", [
    # DDP: fp32 parameters, fp32 gradients (bucket views), Adam m and v: 4 + 4 + 8 B; under autocast the 16-bit
    # weight copies saved for the backward add 2 B.
    ("fp32", 0, (4 * TINY_PARAMS, 4 * TINY_PARAMS, 8 * TINY_PARAMS)),
    ("bf16", 0, (6 * TINY_PARAMS, 4 * TINY_PARAMS, 8 * TINY_PARAMS)),
    # FSDP2 stage 3 over 2 ranks, bf16: 16 B sharded, plus the root and two blocks gathered (2 B each), and the
    # root's and one block's unsharded gradients (2 B each).
    ("bf16", 3, (4 * TINY_PARAMS // 2 + 2 * (TINY_ROOT + 2 * TINY_BLOCK), 4 * TINY_PARAMS // 2 + 2 * (TINY_ROOT + TINY_BLOCK),
                 8 * TINY_PARAMS // 2)),
    # stage 2 keeps every unit gathered from forward to backward
    ("bf16", 2, (4 * TINY_PARAMS // 2 + 2 * TINY_PARAMS, 4 * TINY_PARAMS // 2 + 2 * (TINY_ROOT + TINY_BLOCK),
                 8 * TINY_PARAMS // 2)),
])
def test_torch_accounting_by_hand(dtype, zero, want):
    r = resolve_path(RECIPES / "tiny_fsdp2", [f"precision.dtype={dtype}", f"parallel.zero_stage={zero}"])
    lay = Layout.from_resolved(r)
    params, _ = stage_params(lay, 0)
    assert params == TINY_PARAMS
    w, g, o, host = model_states(lay, params, "torch")
    assert (w, g, o, host) == (*want, 0)


def test_who_builds_the_whole_model_on_the_host():
    """The host check counts one fp32 model per rank where every rank builds it (deepspeed below ZeRO-3), and one
    largest module per rank under zero.Init (deepspeed at ZeRO-3), one largest tensor in torch's sharded start-up, and
    the larger of it and a layer in Megatron's (split over TP 2 in training, but built whole, a layer at a time)."""
    largest = load_model("tiny-llama").param_counts().largest_layer
    plans = {name: plan_resolved(resolve_path(RECIPES / recipe, overrides)).host_bytes_per_node
             for name, recipe, overrides in (("torch", "tiny_fsdp2", []), ("megatron", "tiny_tp2_sp", []),
                                             ("ds2", "tiny_zero2", []), ("ds3", "tiny_zero2", ["parallel.zero_stage=3"]))}
    layer = load_model("tiny-llama").param_counts().per_layer  # Megatron cuts a layer's shards once it is all there
    assert plans == {"torch": int(1.5 * 2 * 4 * largest), "megatron": int(1.5 * 2 * 4 * max(largest, layer)),
                     "ds2": int(1.5 * 2 * 4 * TINY_PARAMS), "ds3": int(1.5 * 2 * 4 * largest)}


def test_zero3_sizes_come_from_the_model_and_a_small_prefetch_bucket_exposes_the_gathers(tmp_path):
    """The shipped ZeRO-3 bases say "auto": one decoder layer of the rank per reduce and prefetch bucket, persistence
    below ten hidden sizes. A prefetch bucket a quarter of a layer leaves three quarters of every gather on the
    critical path (hand count: gathers × 3/4 at least)."""
    flagship = resolve_path(RECIPES / "7b_tp2_zero3")
    m = flagship.model
    layer = -(-m.param_counts().per_layer // 2)  # tp = 2
    zo = flagship.ds_config["zero_optimization"]
    assert (zo["reduce_bucket_size"], zo["stage3_prefetch_bucket_size"]) == (layer, layer)
    assert zo["stage3_param_persistence_threshold"] == max(10 * m.hidden_size, 100_000) == 100_000
    base = json.loads((RECIPES.parent / "ds_configs" / "zero3.json").read_text())
    base["zero_optimization"].update(reduce_bucket_size=layer, stage3_prefetch_bucket_size=layer // 4,
                                     stage3_param_persistence_threshold=40960)
    (tmp_path / "small_prefetch.json").write_text(json.dumps(base))
    small = resolve_path(RECIPES / "7b_tp2_zero3", [f"deepspeed.config={tmp_path / 'small_prefetch.json'}"])
    auto_t, small_t = (plan_resolved(r).step for r in (flagship, small))
    gathers = sum(c.time_s for c in plan_resolved(small).comm
                  if c.parallelism == "dp" and c.collective == "all_gather" and not c.after_step)
    assert small_t.dp_exposed_s >= 0.75 * gathers * 0.999 > auto_t.dp_exposed_s


def test_the_plan_command_fills_the_zero3_sizes_as_a_run_does():
    """`python -m launch plan` plans ZeRO-3 with the sizes the run will use, not DeepSpeed's defaults behind "auto"."""
    from launch.commands.args import read
    from launch.commands.plan import OPTIONS, USAGE, layouts
    from launch.config.dsconfig import AUTO_FIELDS

    opts = read(["model=llama-2-7b", "world_size=8", "hardware=h100-sxm"], command="plan", usage=USAGE,
                options=OPTIONS).options
    z3 = [r.layout for r in layouts(opts) if r.layout.zero_stage == 3]
    run = resolve_path(RECIPES / "7b_tp2_zero3", ["backend=deepspeed", "parallel.sp=false",
                                                  "train.activation_checkpointing=full"]).ds_config["zero_optimization"]
    assert z3
    for lay in z3:
        assert all(isinstance(lay.ds_zero[k], int) for k in AUTO_FIELDS), lay.ds_zero
        if lay.grid.tp == 2:
            assert {k: lay.ds_zero[k] for k in AUTO_FIELDS} == {k: run[k] for k in AUTO_FIELDS}


def test_megatrons_schedule_reduces_after_the_backward_so_nothing_hides_it():
    """At ZeRO 0-1 the megatron backend runs every micro-batch, then reduces (engine.allreduce_gradients): its whole
    data-parallel time is on the critical path; the deepspeed backend's reduction hides behind its backward."""
    over = ["parallel.zero_stage=1", "hardware.profile=h100-sxm", "hardware.gpus_per_node=4", "batch.micro_batch_size=2"]
    mega = plan_resolved(resolve_path(RECIPES / "tiny_tp2_sp", [*over, "parallel.tp=1", "parallel.sp=false"])).step
    ds = plan_resolved(resolve_path(RECIPES / "tiny_zero2", over)).step
    assert mega.dp_comm_s > 0 and mega.dp_exposed_s == pytest.approx(mega.dp_comm_s)
    assert ds.dp_exposed_s < ds.dp_comm_s


def test_zero3_hooks_reproduce_their_measurement_and_hide_behind_a_long_compute():
    """DeepSpeed ZeRO-3's per-module hooks: the one measurement they rest on (Qwen2.5-0.5B on one H200, micro-batch 8 at
    sequence 1024: +237 ms per micro-step, 219 modules with parameters, each passed forward and backward) comes back
    exactly; the host time beyond the device's compute is exposed, and within it hidden (the flagship's 7B TP 2)."""
    small = plan_resolved(resolve_path(RECIPES / "tiny_zero2", [
        "parallel.zero_stage=3", "hardware.profile=h200", "hardware.gpus_per_node=1", "model.name=qwen2.5-0.5b",
        "precision.dtype=bf16", "batch.micro_batch_size=8", "batch.global_batch_size=16", "batch.seq_len=1024"])).step
    hooks = 2 * 0.237  # two micro-steps
    assert small.engine_s == pytest.approx(hooks - small.compute_s) and small.engine_s > 0
    assert f"per-module hooks {hooks * 1e3:.0f} ms" in small.assumptions
    flagship = plan_resolved(resolve_path(RECIPES / "7b_tp2_zero3", [])).step  # Megatron layers: 6 modules a layer
    ga, modules = 16 // (1 * 2), 32 * 6 + 3
    assert f"per-module hooks {ga * 2 * modules * 0.237 / 438 * 1e3:.0f} ms" in flagship.assumptions
    assert flagship.engine_s == 0 and "hidden" in flagship.assumptions
    on_cpu = plan_resolved(resolve_path(RECIPES / "tiny_zero2", ["parallel.zero_stage=3"])).step
    assert on_cpu.engine_s == 0 and "hooks" not in on_cpu.assumptions
