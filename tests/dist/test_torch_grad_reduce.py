"""precision.grad_reduce_dtype trained on 2 CPU ranks in bf16: each backend reduces in the dtype asked, read from what
the run left (FSDP2's reduce-scatters' input type in the traces; the DeepSpeed engine's own communication_data_type),
and the losses stay those of the fp32 reduction within bf16's rounding."""
import json

import pytest

from tests.dist.conftest import SHORT, TORCH, TORCH_LAYOUTS

pytestmark = [pytest.mark.dist, pytest.mark.slow]
BF16 = ("precision.dtype=bf16", "run.profile=torch")
# bf16 keeps 8 bits of mantissa: one rounding of the reduced gradients moves a loss of ~6 by well under 1e-2 in 10 steps;
# a reduction in the wrong place (not averaged, one rank's gradients) moves it by more than 0.1 within two.
TOL = 1e-2


def worst(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def reduce_scatter_types(run) -> set[str]:
    events = json.loads((run.root / "traces" / "rank0.json").read_text())["traceEvents"]
    return {e["args"]["Input type"][0] for e in events if e.get("name") == "c10d::_reduce_scatter_base_"}


def test_fsdp2_reduces_in_the_dtype_asked(shared_run):
    layout = (*SHORT, *TORCH_LAYOUTS["fsdp2_z3"], *BF16)
    fp32, bf16 = shared_run(*layout, recipe=TORCH), shared_run(*layout, "precision.grad_reduce_dtype=bf16", recipe=TORCH)
    assert reduce_scatter_types(fp32) == {"float"} and reduce_scatter_types(bf16) == {"c10::BFloat16"}
    assert worst(fp32.losses(), bf16.losses()) <= TOL


@pytest.mark.full
def test_ddp_reduces_through_the_bf16_hook(shared_run):
    layout = (*SHORT, *TORCH_LAYOUTS["ddp"], *BF16)
    fp32, bf16 = shared_run(*layout, recipe=TORCH), shared_run(*layout, "precision.grad_reduce_dtype=bf16", recipe=TORCH)
    assert 0 < worst(fp32.losses(), bf16.losses()) <= TOL  # the hook acts (rounding), and averages as DDP would


@pytest.mark.full
def test_deepspeed_engine_reduces_in_the_dtype_asked(shared_run):
    """bf16 asked, against DeepSpeed's engine's own answer (the fp32 default's composition: test_grad_reduce_dtype.py)."""
    run = shared_run(*SHORT, *BF16, "precision.grad_reduce_dtype=bf16", recipe="recipes/tiny_zero2")
    said = (run.root / "logs" / "rank0.out").read_text()
    assert "deepspeed: data-parallel gradients reduced in torch.bfloat16" in said, said[-2000:]
