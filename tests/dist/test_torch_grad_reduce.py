"""precision.grad_reduce_dtype trained on 2 CPU ranks in bf16: FSDP2 reduces in the dtype asked, read from the
reduce-scatters' input type in the traces, and the losses stay those of the fp32 reduction within bf16's rounding.
(DDP's hook and DeepSpeed's communication_data_type were trained by hand, not here: CI's 30 minutes.)"""
import json

import pytest

from tests.dist.conftest import SHORT, TORCH, TORCH_LAYOUTS, worst

pytestmark = [pytest.mark.dist, pytest.mark.slow]
BF16 = ("precision.dtype=bf16", "run.profile=torch")
# bf16 keeps 8 bits of mantissa: one rounding of the reduced gradients moves a loss of ~6 by well under 1e-2 in 10 steps;
# a reduction in the wrong place (not averaged, one rank's gradients) moves it by more than 0.1 within two.
TOL = 1e-2



def reduce_scatter_types(run) -> set[str]:
    events = json.loads((run.root / "traces" / "rank0.json").read_text())["traceEvents"]
    return {e["args"]["Input type"][0] for e in events if e.get("name") == "c10d::_reduce_scatter_base_"}


def test_fsdp2_reduces_in_the_dtype_asked(shared_run):
    layout = (*SHORT, *TORCH_LAYOUTS["fsdp2_z3"], *BF16)
    fp32, bf16 = shared_run(*layout, recipe=TORCH), shared_run(*layout, "precision.grad_reduce_dtype=bf16", recipe=TORCH)
    assert reduce_scatter_types(fp32) == {"float"} and reduce_scatter_types(bf16) == {"c10::BFloat16"}
    assert worst(fp32.losses(), bf16.losses()) <= TOL
