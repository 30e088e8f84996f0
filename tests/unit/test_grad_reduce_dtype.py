"""precision.grad_reduce_dtype: what each backend is told, what the plan counts, and what is refused before launch."""
import pytest

from launch.config.resolve import resolve_path
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from tests.unit.test_compute_model import REPO

BF16 = ["precision.dtype=bf16"]


def reductions(recipe: str, *overrides: str) -> dict[str, float]:
    """The data-parallel gradient reductions' bytes per step (all_reduce / reduce_scatter), from the plan."""
    plan = plan_resolved(resolve_path(REPO / "recipes" / recipe, list(overrides)))
    out: dict[str, float] = {}
    for c in plan.comm:
        if c.parallelism == "dp" and c.collective in ("all_reduce", "reduce_scatter") and not c.after_step:
            out[c.collective] = out.get(c.collective, 0.0) + c.calls_per_step * c.message_bytes
    return out


def test_deepspeed_is_told_the_dtype_it_reduces_in():
    cfg = lambda *o: resolve_path(REPO / "recipes/tiny_zero2", list(o)).ds_config  # noqa: E731
    assert cfg(*BF16)["communication_data_type"] == "fp32"  # DeepSpeed's own default would be bf16
    assert cfg(*BF16, "precision.grad_reduce_dtype=bf16")["communication_data_type"] == "bf16"
    assert "communication_data_type" not in cfg("precision.dtype=fp32")  # fp32 training reduces fp32 anyway


@pytest.mark.parametrize("recipe", ["tiny_zero2", "tiny_fsdp2", "tiny_ddp"])
def test_bf16_halves_the_bytes_reduced(recipe):
    fp32, bf16 = reductions(recipe, *BF16), reductions(recipe, *BF16, "precision.grad_reduce_dtype=bf16")
    assert fp32 and set(fp32) == set(bf16)
    for kind in fp32:
        assert bf16[kind] == pytest.approx(fp32[kind] / 2, rel=1e-9), kind


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bf16_reduction_of_other_gradients_is_refused_in_one_line(dtype):
    with pytest.raises(ConfigError) as e:
        resolve_path(REPO / "recipes/tiny_fsdp2", [f"precision.dtype={dtype}", "precision.grad_reduce_dtype=bf16"])
    assert "precision.grad_reduce_dtype" in str(e.value) and f'got "{dtype}"' in str(e.value)
    assert "\n" not in str(e.value)
