"""Megatron-Core sharding on 2 gloo ranks against unsharded oracles.

One torchrun launch of tests/dist/megatron_shard_rank.py measures every case (imports dominate the time
on 2 cores); the tests below judge its numbers:
- a ColumnParallelLinear -> RowParallelLinear MLP at TP2 equals torch.nn.Linear with the full weights;
- at TP2, TP2+SP, PP2 and PP2 with two virtual stages (and at TP2 with a single KV head, Megatron's path
  for fewer query groups than TP ranks), GPTModel chunks loaded from HF weights give the HF model's
  per-token loss, Megatron DDP + finalize_model_grads give its gradients, and the HF state gathered back
  from every rank's local state is exactly the one loaded;
- tied embeddings under PP need cpu_compat's tied_embedding_copy redirect, and Megatron's start-up sync
  then makes the last stage's copy equal to the embedding.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# -m full (CI): Megatron's GPT chunks against Hugging Face for the other models (Qwen2's tied embeddings and biases,
# one KV head); test_megatron_parity holds every layout to the one-rank run in README's suite.
pytestmark = [pytest.mark.dist, pytest.mark.full]

RANK_SCRIPT = REPO / "tests" / "dist" / "megatron_shard_rank.py"
LAYOUTS = ("tp2", "tp2_sp", "pp2", "pp2_vpp2")
MODELS = ("tiny-llama", "tiny-qwen2")
CASES = [(m, layout) for layout in LAYOUTS for m in MODELS] + [("tiny-llama-kv1", "tp2"), ("tiny-llama-kv1", "tp2_sp")]


@pytest.fixture(scope="module")
def measured() -> dict:
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(RANK_SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, p.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_tied_embeddings_under_pp_fail_without_the_redirect(measured):
    assert measured["tied_pp2_without_compat"] == {
        "error": "AssertionError: Torch not compiled with CUDA enabled",
        "where": "language_module.py: weight.data = weight.data.cuda()",
    }
    assert "tied_embedding_copy" in measured["redirects"]


def test_mlp_tp2_equals_unsharded_linear(measured):
    diffs = measured["mlp_tp2"]
    assert set(diffs) == {"output", "input_grad", "column_weight_grad", "column_bias_grad", "row_weight_grad",
                          "row_bias_grad"}
    assert all(d <= 1e-6 for d in diffs.values()), diffs  # relative to max(1, the reference's largest value)


def test_every_case_was_measured(measured):
    assert sorted(k for k in measured if "/" in k) == sorted(f"{m}/{layout}" for m, layout in CASES)


@pytest.mark.parametrize(("model", "layout"), CASES)
def test_gpt_chunks_match_hf(measured, model, layout):
    case = measured[f"{model}/{layout}"]
    assert "grad_gather_error" not in case, case["grad_gather_error"]
    losses = case["loss_max_abs_diff_per_rank"]
    if layout.startswith("pp2"):
        assert losses[0] is None  # the first stage returns hidden states, not a loss
        losses = losses[1:]
    assert losses and all(d is not None and d <= 1e-5 for d in losses), case
    assert case["round_trip_keys_equal"] and case["round_trip_mismatches"] == [], case
    assert case["grad_keys_equal"] and case["grad_worst"] <= 1.0, case  # allclose(rtol=1e-4, atol=1e-6)
    chunks, layers = {"pp2": (1, [2]), "pp2_vpp2": (2, [1, 1])}.get(layout, (1, [4]))
    assert (case["chunks"], case["layers"]) == (chunks, layers)
    if model == "tiny-qwen2" and layout.startswith("pp2"):
        assert case["tied_copy_equal_at_init"] is True
