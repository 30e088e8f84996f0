"""The plan of a [peft] fine-tune by hand: Llama-2-7B's adapters (rank 16 on its seven block linears), the bytes its
model states take under DDP, FSDP2 and DeepSpeed ZeRO-2, NF4's bytes per parameter from bitsandbytes' layout, the
FLOPs a frozen GEMM's backward does, what data parallelism reduces and what a checkpoint holds; and the adapters'
count against peft's own on the tiny model."""
import math

import pytest

from launch.config.resolve import resolve_path
from launch.plan.adapters import NF4_BYTES_PER_PARAM, frozen_bytes, rank_split
from launch.plan.build import plan_resolved
from launch.plan.collectives import communication
from launch.plan.compute import _head, _layer, _rates, _trained
from launch.plan.layout import Layout
from launch.plan.memory import model_states, stage_params
from tests.conftest import RECIPES

# Llama-2-7B (its Hugging Face config): hidden 4096, MLP 11008, 32 layers, full multi-head attention, vocab 32000
H, F, L, V = 4096, 11008, 32, 32000
BASE = 6_738_415_616
LINEAR_PER_LAYER = 4 * H * H + 3 * H * F  # q, k, v, o; gate, up, down
R = 16
# rank × (in + out) per adapted linear: q, k, v, o are H × H, gate and up H -> F, down F -> H
ADAPTERS_PER_LAYER = 4 * R * (H + H) + 2 * R * (H + F) + R * (F + H)
ADAPTERS = L * ADAPTERS_PER_LAYER


def _layout(recipe: str, *overrides: str) -> Layout:
    return Layout.from_resolved(resolve_path(RECIPES / recipe, list(overrides)))


def test_adapter_count_by_hand():
    assert ADAPTERS == 39_976_960
    lay = _layout("7b_ddp", "peft.method=lora")
    split = rank_split(lay, stage_params(lay, 0)[0])
    assert (split.trainable, split.frozen, split.frozen_linear) == (ADAPTERS, BASE, L * LINEAR_PER_LAYER)


def test_nf4_bytes_per_parameter_from_bitsandbytes_layout():
    # 4-bit codes, one 8-bit absmax per 64 weights (double quantization), one fp32 scale per 256 absmax
    assert NF4_BYTES_PER_PARAM == 0.5 + 1 / 64 + 4 / (64 * 256) == 0.515869140625
    lay = _layout("7b_ddp", "peft.method=qlora", "precision.dtype=bf16")
    linear = L * LINEAR_PER_LAYER
    assert frozen_bytes(lay, rank_split(lay, BASE)) == math.ceil(0.515869140625 * linear) + 2 * (BASE - linear)


def test_ddp_lora_states_by_hand():
    lay = _layout("7b_ddp", "peft.method=lora")  # bf16, 4 ranks
    w, g, o, host = model_states(lay, BASE, "torch")
    # the frozen base in bf16, the adapters fp32 with their bf16 autocast copies; fp32 gradients, Adam's m and v
    assert (w, g, o, host) == (2 * BASE + (4 + 2) * ADAPTERS, 4 * ADAPTERS, 8 * ADAPTERS, 0)
    assert (w + g + o) / 2**30 == pytest.approx(13.2, abs=0.05)  # fits an 80 GB card with room for activations


def test_ddp_qlora_states_by_hand():
    lay = _layout("7b_ddp", "peft.method=qlora", "precision.dtype=bf16")
    w, g, o, _ = model_states(lay, BASE, "torch")
    linear = L * LINEAR_PER_LAYER
    frozen = math.ceil(0.515869140625 * linear) + 2 * (BASE - linear)
    dequantized = 2 * H * F  # one gate/up/down weight at a time in bf16
    assert (w, g, o) == (frozen + 6 * ADAPTERS + dequantized, 4 * ADAPTERS, 8 * ADAPTERS)
    assert 4 < (w + g + o) / 2**30 < 5


def test_fsdp2_lora_states_by_hand():
    lay = _layout("7b_fsdp2", "peft.method=lora")  # zero_stage 3 over 4 ranks, bf16
    w, g, o, _ = model_states(lay, BASE, "torch")
    root = 2 * V * H + H  # embedding, lm_head, final norm
    block = LINEAR_PER_LAYER + 2 * H + ADAPTERS_PER_LAYER  # a block's unit holds its adapters
    gathered = 2 * (root + 2 * block)  # the root and two blocks, in bf16
    assert w == 4 * (ADAPTERS // 4) + 2 * BASE // 4 + gathered
    assert g == 4 * (ADAPTERS // 4) + 2 * ADAPTERS_PER_LAYER  # the block's adapters' unsharded bf16 gradients
    assert o == 8 * (ADAPTERS // 4)


def test_deepspeed_zero2_lora_states_by_hand():
    lay = _layout("7b_zero2", "peft.method=lora")  # deepspeed, bf16, dp 4
    w, g, o, _ = model_states(lay, BASE, "deepspeed")
    # 16-bit base and adapters; the adapters' bf16 + fp32 gradient partition; fp32 master, m and v partitioned
    assert (w, g, o) == (2 * BASE + 2 * ADAPTERS, 6 * ADAPTERS // 4, 12 * ADAPTERS // 4)


def test_frozen_gemm_backward_is_one_forward():
    lay = _layout("7b_ddp", "peft.method=lora")
    rates = _rates(lay)
    tokens = lay.micro_batch_size * lay.seq_len
    # frozen linears: forward 2 FLOPs a weight a token, backward the input gradient alone (2); adapters 2 + 4
    assert _trained(_layer(lay, rates)).gemm_flops == tokens * (4 * LINEAR_PER_LAYER + 6 * ADAPTERS_PER_LAYER)
    assert _head(lay, rates).gemm_flops == 4 * tokens * V * H
    full = _layout("7b_ddp")
    assert _trained(_layer(full, rates)).gemm_flops == 6 * tokens * LINEAR_PER_LAYER


def test_data_parallel_reduces_the_adapters_alone():
    ddp = [c for c in communication(_layout("7b_ddp", "peft.method=lora")) if c.collective == "all_reduce"]
    grads = ddp[0]  # fp32 buckets of the adapters' gradients
    assert grads.calls_per_step * grads.message_bytes == pytest.approx(4 * ADAPTERS, abs=grads.calls_per_step)
    lay = _layout("7b_fsdp2", "peft.method=lora")
    calls = {c.collective: c for c in communication(lay) if c.calls_per_step > 1}
    ga = lay.grad_accum
    # every unit (the root and 32 blocks) gathered in bf16 with its adapters, twice a micro-batch at zero_stage 3
    assert calls["all_gather"].calls_per_step == 2 * ga * (L + 1)
    assert calls["all_gather"].message_bytes == int(2 * (BASE + ADAPTERS) / (L + 1))
    # a block's adapters' fp32 gradients reduce-scattered; the frozen root has none
    assert calls["reduce_scatter"].calls_per_step == ga * L
    assert calls["reduce_scatter"].message_bytes == 4 * ADAPTERS_PER_LAYER


def test_checkpoint_holds_the_adapters_and_their_state():
    save = plan_resolved(resolve_path(RECIPES / "7b_fsdp2", ["peft.method=lora"])).checkpoint
    assert (save.bytes_per_parameter, save.bytes_total) == (12, 12 * ADAPTERS)
    assert save.bytes_held_per_rank == 12 * ADAPTERS // 4


def test_without_peft_every_parameter_trains():
    lay = _layout("7b_ddp")
    split = rank_split(lay, BASE)
    assert (split.trainable, split.frozen, split.frozen_linear) == (BASE, 0, 0)
    assert model_states(lay, BASE, "torch")[:3] == ((4 + 2) * BASE, 4 * BASE, 8 * BASE)
