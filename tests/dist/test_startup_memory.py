"""Sharded start-up, measured: how much each rank's peak host memory grows while it builds its part of a 208 MB
model (logs/build_memory_rank{R}.json, ru_maxrss before and after the build) against the model's size from its
parameter count. DeepSpeed's ZeRO-3 build (zero.Init) and every rank of Megatron-Core and FSDP2 (their sharded start-up:
each rank makes the weights one tensor at a time and keeps its shards) grow by their half of the model and about one
layer; a build of the whole model on a rank (DeepSpeed ZeRO-2, where every rank holds the parameters) grows by at least
the model, so the measure sees a whole build when there is one."""
import json

import pytest

from launch.config.models import load_model
from tests.conftest import REPO
from tests.dist.conftest import train

# -m full (CI): start-up memory per rank: a feature measured on the parity tests' layouts.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
CONFIG = REPO / "tests" / "fixtures" / "models" / "tall-llama" / "config.json"
ONE_STEP = (f"model.config={CONFIG}", "train.steps=1", "train.warmup_steps=0", "train.lr_warmup_steps=0",
            "batch.seq_len=32", "batch.micro_batch_size=2", "batch.global_batch_size=4", "hardware.gpus_per_node=2",
            "run.save_final=false", "train.checkpoint_every=0")
LAYOUTS = {"deepspeed ZeRO-3": ("recipes/tiny_zero2", "parallel.zero_stage=3"),
           "deepspeed ZeRO-2": ("recipes/tiny_zero2", "parallel.zero_stage=2"),
           "megatron TP 2": ("recipes/tiny_tp2_sp", "parallel.zero_stage=0"),
           "torch FSDP2": ("recipes/tiny_fsdp2", "parallel.zero_stage=3")}
# (ranks that build only their part, ranks that build the whole model)
EXPECTED = {"deepspeed ZeRO-3": ((0, 1), ()), "deepspeed ZeRO-2": ((), (0, 1)), "megatron TP 2": ((0, 1), ()),
            "torch FSDP2": ((0, 1), ())}


@pytest.fixture(scope="module")
def growth(runs_root):
    out = {}
    for name, (recipe, layout) in LAYOUTS.items():
        t = train(runs_root / "startup" / name.replace(" ", "_"), *ONE_STEP, layout, recipe=recipe)
        out[name] = [json.loads((t.root / "logs" / f"build_memory_rank{r}.json").read_text())["peak_rss_growth_bytes"]
                     for r in (0, 1)]
    return out


def test_no_rank_but_the_sender_materialises_the_whole_model(growth):
    spec = load_model(config_path=str(CONFIG))
    model, layer = 4 * spec.param_counts().total, 4 * spec.param_counts().per_layer  # fp32 bytes
    assert model > 12 * layer  # tall enough that a layer is not the model
    part = model / 2 + 2 * layer + 16 * 2**20  # half the model over 2 ranks, a layer in flight, allocator slack
    for name, (sharded, whole) in EXPECTED.items():
        for r in sharded:
            assert growth[name][r] <= part, (name, r, growth[name][r], part, model)
        for r in whole:
            assert growth[name][r] >= 0.95 * model, (name, r, growth[name][r], model)
