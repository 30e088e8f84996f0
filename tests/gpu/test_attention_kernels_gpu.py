"""GPU check of the T4 ladder's attention (issue 46, part 3), on whatever card is lent: torch's memory-efficient SDPA
kernel, the one an sm 7.5 T4 has, forced; with grouped K/V heads and enable_gqa=True it must refuse (torch 2.13.0
predates its GQA support, pytorch#191085), and with the heads repeated first, as the Hugging Face backends do on a T4
profile, it runs and equals the math kernel's answer. If the refusal ever stops, the repetition costs the planned
repeated K/V for nothing: HardwareProfile.fused_attention_gqa can then be set true for the T4."""
import pytest

pytestmark = pytest.mark.gpu


def test_memory_efficient_kernel_refuses_gqa_and_runs_repeated_heads():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 14, 1024, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        fused = F.scaled_dot_product_attention(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        math_ = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    print(f"memory-efficient kernel: GQA refused; repeated heads run, max |difference| from the math kernel "
          f"{(fused - math_).abs().max().item():.2e}")
    assert torch.allclose(fused, math_, atol=2e-3)
