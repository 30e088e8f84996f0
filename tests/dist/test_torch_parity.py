"""The torch backend (DDP, FSDP2, DTensor TP/SP) reproduces the one-rank run of the same global batch, step by step
(fp32, gloo), and equals the DeepSpeed backend at ZeRO-3 on the same weights and batches.

The oracle is the DeepSpeed backend's one-rank ZeRO-0 run (conftest.one_rank_reference): another library's engine
over the same Hugging Face model, the whole batch in two micro-batches of 4. Tolerance 1e-5 on losses of about 6,
as for the Megatron layouts (test_megatron_parity.py): in fp32 a layout changes only the order of summation (a
row-parallel all-reduce adds partial products, FSDP2 reduce-scatters the same gradients, the vocabulary-parallel
loss sums its exponentials in two halves), about 1e-7 relative per operation, far below 1e-5 over 10 AdamW steps at
lr 3e-3; one wrongly sharded or unsynchronised weight moves the loss by 1e-3 or more within a few steps. The
gradient norm (pre-clipping, every step clips here: the norms are 1.3-3.3 against grad_clip 1.0) is compared to
1e-4 relative. torch.compile (inductor's CPU code) reorders floating-point sums inside each block; the same
tolerance holds for it.
"""
import re

import pytest

from tests.dist.conftest import DS_DP2, SHORT, TORCH, TORCH_LAYOUTS, two_ranks_first, worst

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5



@pytest.fixture(scope="module")
def runs(shared_run):
    return lambda name: shared_run(*SHORT, *TORCH_LAYOUTS[name], recipe=TORCH)


# torch.compile is a feature over ac_full's layout, and its first compile costs ~20 s: -m full (CI); so are the layouts
# of 4 ranks (conftest.two_ranks_first)
@pytest.mark.parametrize("name", two_ranks_first(TORCH_LAYOUTS, "compile_ac_full"))
def test_layout_matches_one_rank(runs, one_rank_reference, name):
    t = runs(name)
    ref = one_rank_reference
    assert [s.step for s in t.metrics().steps] == list(range(1, 11))
    assert worst(t.losses(), ref.losses()) <= TOL, (name, t.losses(), ref.losses())
    norms = [s.grad_norm for s in t.metrics().steps]
    assert norms == pytest.approx(ref.norms, rel=1e-4)
    meta = t.metrics().meta
    assert meta.backend == "torch"
    # every rank logs the same data-parallel mean
    ranks = meta.world_size
    for rank in range(1, ranks):
        assert worst(t.losses(rank), t.losses()) == 0.0


def test_fsdp2_equals_deepspeed_zero3(runs, shared_run):
    """The comparison users come for: FSDP2 full sharding and DeepSpeed ZeRO-3, same weights, batches and layout."""
    torch_run, ds_run = runs("fsdp2_z3"), shared_run(*DS_DP2[3])
    assert ds_run.metrics().meta.backend == "deepspeed" and ds_run.metrics().meta.zero_stage == 3
    assert torch_run.metrics().meta.zero_stage == 3 and torch_run.metrics().meta.dp == ds_run.metrics().meta.dp == 2
    assert worst(torch_run.losses(), ds_run.losses()) <= TOL


def _layer_calls(t, rank: int = 0) -> list[int]:
    import json

    return json.loads((t.root / "logs" / f"layer_calls_rank{rank}.json").read_text())["forward_calls_per_layer"]


FORWARDS = 10 * 2  # steps × micro-batches per rank (2 on each of the data-parallel pair, 2 at TP 2 alone)


def test_checkpointing_recomputes_the_blocks_it_names(runs):
    """Same losses (test_layout_matches_one_rank), more forward calls: full runs every block twice per micro-batch,
    and so does selective (torchtitan's op policy checkpoints every block, keeping some of its ops' outputs)."""
    assert _layer_calls(runs("fsdp2_z3")) == [FORWARDS] * 4
    assert _layer_calls(runs("ac_full")) == [2 * FORWARDS] * 4
    assert _layer_calls(runs("tp2_sp_selective")) == [2 * FORWARDS] * 4



@pytest.mark.full  # reads compile_ac_full's run (-m full)
def test_compile_compiled_every_block_without_breaks(runs):
    """Compiled with full checkpointing inside each block (torchtitan's order: AC, then compile); its losses are in
    test_layout_matches_one_rank."""
    t = runs("compile_ac_full")
    for rank in (0, 1):
        said = re.search(r"torch\.compile: (\d+) graphs, (\d+) graph breaks", (t.root / "logs" / f"rank{rank}.out").read_text())
        assert said, f"rank {rank} did not report its compiled graphs"
        graphs, breaks = map(int, said.groups())
        # identical blocks may share one graph (their parameters are its inputs); none may fall back to eager
        assert graphs >= 1 and breaks == 0


def test_fp16_with_the_sharded_scaler_follows_fp32(shared_run, one_rank_reference):
    """fp16 FSDP2 (the T4's precision) with torch's ShardedGradScaler: the same curve as fp32 within fp16's rounding.
    Tolerance 2e-2: fp16 keeps 11 significant bits (~5e-4 relative per rounding), and the parameters are gathered
    and the activations computed in fp16 while the master weights and the reduction stay fp32; a skipped or
    mis-scaled step moves the loss by far more (the learning rate is 3e-3 on losses falling ~0.03 a step)."""
    t = shared_run(*SHORT, *TORCH_LAYOUTS["fsdp2_z3"][:3], "precision.dtype=fp16", recipe=TORCH)
    assert t.metrics().meta.dtype == "fp16"
    assert worst(t.losses(), one_rank_reference.losses()) <= 2e-2, (t.losses(), one_rank_reference.losses())


@pytest.mark.full  # a model feature (tied embeddings) over the DDP layout README's suite trains
def test_tied_embeddings_stay_tied_under_ddp(shared_run):
    """A model whose output layer is its embedding (tiny-qwen2) trains the same under torch DDP as under DeepSpeed
    (ZeRO-0, the same 2 ranks and batches): DDP builds on the meta device and would otherwise come out with two
    matrices, trained apart."""
    qwen = ("model.name=tiny-qwen2", "hardware.gpus_per_node=2", "parallel.zero_stage=0", "batch.micro_batch_size=2")
    ddp, ds = shared_run(*SHORT, *qwen, recipe=TORCH), shared_run(*SHORT, *qwen)
    assert (ddp.metrics().meta.backend, ds.metrics().meta.backend) == ("torch", "deepspeed")
    assert ddp.metrics().meta.param_numel_local == ds.metrics().meta.param_numel_local  # the matrix counted once
    assert worst(ddp.losses(), ds.losses()) <= TOL
