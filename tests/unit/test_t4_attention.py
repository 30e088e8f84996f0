"""Attention the card can run (issue 46, part 3). torch 2.13.0's memory-efficient SDPA kernel refuses grouped-query
attention, and a T4 (sm 7.5) has no flash kernel: transformers' enable_gqa=True would send SDPA to the math kernel and
its s × s scores. On such a profile the Hugging Face backends repeat the K/V heads before SDPA, and the plan keeps the
repeated K and V. The oracle: transformers' own sdpa_attention_forward, its SDPA call recorded; the activation bytes
by hand."""
import torch

from launch.config.resolve import resolve_path
from launch.plan.layout import Layout
from launch.plan.memory import repeats_kv, sdpa_kernel, stage_activations
from launch.ranks.trainers import common
from tests.conftest import RECIPES


def _layout(recipe: str, *overrides: str) -> Layout:
    return Layout.from_resolved(resolve_path(RECIPES / recipe, list(overrides)))


def test_the_kernel_named_per_profile():
    t4 = _layout("0.5b_t4_ddp")  # Qwen2.5-0.5B: 14 query heads, 2 K/V heads; fp16 on a T4
    assert sdpa_kernel(t4) == "the memory-efficient kernel" and repeats_kv(t4)
    h100 = _layout("0.5b_t4_ddp", "hardware.profile=h100-sxm")
    assert sdpa_kernel(h100) == "the flash kernel" and not repeats_kv(h100)
    assert repeats_kv(_layout("0.5b_t4_ddp", "hardware.profile=h100-sxm", "precision.dtype=fp32"))  # no fp32 flash
    assert not repeats_kv(_layout("0.5b_t4_ddp", "train.attention=eager"))  # eager repeats on its own, planned so
    assert not repeats_kv(_layout("tiny_tp2_sp", "hardware.profile=t4", "precision.dtype=fp32"))  # Megatron's attention


def test_the_repeated_k_and_v_are_planned_by_hand():
    t4, h100 = _layout("0.5b_t4_ddp"), _layout("0.5b_t4_ddp", "hardware.profile=h100-sxm")
    m, b, s = t4.model, t4.micro_batch_size, t4.seq_len
    # K and V, fp16, kept for the backward: at every query head instead of the K/V heads, per layer
    extra = 2 * 2 * b * s * (m.num_heads - m.num_kv_heads) * m.head_dim * m.num_layers
    assert stage_activations(t4, 0) - stage_activations(h100, 0) == extra


def _sdpa_call(monkeypatch, recipe: str, *overrides: str) -> dict:
    """transformers' sdpa attention on a GQA module after the redirect for `recipe`: what it passes SDPA."""
    from transformers.integrations import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)  # restored after the test
    common.repeat_kv_for_fused_attention(resolve_path(RECIPES / recipe, list(overrides)))
    seen = {}

    def record(query, key, value, **kwargs):
        seen.update(key_heads=key.shape[1], value_heads=value.shape[1], enable_gqa=kwargs.get("enable_gqa", False))
        return torch.zeros_like(query)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 7, True
    q, kv = torch.randn(1, 14, 8, 4), torch.randn(1, 2, 8, 4)
    sdpa_attention.sdpa_attention_forward(module, q, kv, kv.clone(), None)
    return seen


def test_on_a_t4_transformers_repeats_the_heads_itself(monkeypatch):
    assert _sdpa_call(monkeypatch, "0.5b_t4_ddp") == {"key_heads": 14, "value_heads": 14, "enable_gqa": False}


def test_elsewhere_sdpa_takes_the_grouped_heads(monkeypatch):
    assert _sdpa_call(monkeypatch, "0.5b_t4_ddp", "hardware.profile=h100-sxm") == {
        "key_heads": 2, "value_heads": 2, "enable_gqa": True}
