"""fp16's overflow path on the torch backend (the T4 has no bf16): a step whose scaled gradients overflow is skipped,
its parameters left as they were, the loss scale halved, and training goes on. DDP runs torch.amp.GradScaler, FSDP2
(stage 3) its ShardedGradScaler; both start at 2**precision.initial_loss_scale_power.

The runs train on a corpus of exactly one global batch (8 rows of 48 byte tokens), so that every step sees the same
rows (each epoch reshuffles them over ranks and micro-batches, which changes only the order of summation): a skipped
step leaves the next step's loss where it was (to float rounding, 1e-6 relative), a trained one lowers it (by 0.2-0.9
a step here at lr 3e-3).

The oracles are hand-computed: the scale starts at 2**P, halves after each skipped step and stays after a trained one
(torch's backoff 0.5; it grows only after 2000 clean steps); and the first steps must overflow: at the initial
weights the target logit's gradient of the scaled loss is scale / (grad_accum · tokens per micro-batch) · (1 - p),
with p ≈ 1/512 (logits near 0 over tiny-llama's 512-token vocabulary), and the backward casts it to fp16, which
rounds anything from 65520 up to inf. Further steps overflow beyond that bound (measured: up to a scale of 2**19 at
the initial weights; the output layer's weight gradient sums a repeated bigram's logit gradients), which the rule
above covers however many they are.
"""
import itertools
import math

import pytest

from tests.dist.conftest import train

pytestmark = [pytest.mark.dist, pytest.mark.slow]

POWER = 26
SEQ_LEN, MICRO, GLOBAL, RANKS = 48, 2, 8, 2
GRAD_ACCUM = GLOBAL // (MICRO * RANKS)
TOKENS = MICRO * (SEQ_LEN - 1)  # per micro-batch: each row predicts its next 47 tokens
FP16_TO_INF = 65520
# The powers whose first step overflows for certain: 2**26, 2**25, 2**24 (2**24 / 188 · 0.99 = 88,350).
CERTAIN = sum(2.0**k / (GRAD_ACCUM * TOKENS) * 0.99 >= FP16_TO_INF for k in range(POWER, -1, -1))
# 400 byte tokens (ASCII), with or without a separator 8 whole rows of 48: one global batch.
TEXT = ("The T4 has no bf16, so its recipes train in fp16 with dynamic loss scaling: a step whose scaled gradients "
        "overflow is skipped, its parameters left as they were, and the scale halved before the next step tries again. "
        * 2)[:400]


# fp16 FSDP2 trains in README's suite through test_torch_parity's fp16 run; its overflow path here is -m full (CI)
@pytest.mark.parametrize("recipe, zero", [("recipes/tiny_ddp", 0),
                                          pytest.param("recipes/tiny_fsdp2", 3, marks=pytest.mark.full)])
def test_an_overflowing_fp16_step_is_skipped_and_its_scale_halved(tmp_path, recipe, zero):
    assert CERTAIN == 3 and GLOBAL * SEQ_LEN <= len(TEXT) < (GLOBAL + 1) * SEQ_LEN - 1  # a separator or not
    corpus = tmp_path / "one_batch.txt"
    corpus.write_text(TEXT, encoding="ascii")
    t = train(tmp_path / "runs", "precision.dtype=fp16", f"precision.initial_loss_scale_power={POWER}",
              f"hardware.gpus_per_node={RANKS}", f"batch.seq_len={SEQ_LEN}", f"batch.micro_batch_size={MICRO}",
              f"batch.global_batch_size={GLOBAL}", "train.steps=12", "train.warmup_steps=1", "train.lr=3e-3",
              "train.lr_warmup_steps=0", "train.lr_schedule=constant", "train.checkpoint_every=0",
              "run.save_final=false", "data.source=text", f"data.path={corpus}", recipe=recipe)
    meta, steps = t.metrics().meta, t.metrics().steps
    assert (meta.backend, meta.zero_stage, meta.dtype) == ("torch", zero, "fp16")
    skipped = [s.skipped_step for s in steps]
    expected = [2.0**POWER]
    for was_skipped in skipped[:-1]:
        expected.append(expected[-1] / 2 if was_skipped else expected[-1])
    assert [s.loss_scale for s in steps] == expected, skipped
    assert skipped[:CERTAIN] == [True] * CERTAIN
    assert skipped.count(False) >= 3, f"training did not go on after the overflows: {skipped}"
    # the data-parallel ranks agree: the scaler's overflow check covers the reduced gradients
    assert [(s.loss_scale, s.skipped_step) for s in t.metrics(1).steps] == [(s.loss_scale, s.skipped_step) for s in steps]
    for s in steps:  # an overflowed step's gradient norm is inf or NaN; a trained step's is finite
        assert math.isfinite(s.grad_norm) is not s.skipped_step, (s.step, s.grad_norm, s.skipped_step)
    for before, after in itertools.pairwise(steps):
        if before.skipped_step:
            assert after.loss == pytest.approx(before.loss, rel=1e-6), (before.step, before.loss, after.loss)
        else:
            assert after.loss < before.loss - 0.05, (before.step, before.loss, after.loss)
