"""`python -m launch rehearse`: the torch backend's own step at Llama-2-7B's real per-layer shapes (4 of its layers,
sequence 512) on a fake process group, held to hand-computed FLOPs, collective counts and message sizes, and to
AdamW's state bytes; what cannot be rehearsed is refused in one line, exit 2, before any rank starts.

Full size (7b_fsdp2, 7b_tp2_fsdp2_sp) takes ~25 s a recipe on 2 cores: bench/results/rehearsal.txt holds those."""
import json
from pathlib import Path

import pytest

from launch.commands.cli import main
from launch.outputs import folder_problem
from launch.run.rehearsal import is_our_rehearsal
from tests.conftest import REPO, RECIPES

LLAMA_2_7B = REPO / "launch" / "config" / "catalogue" / "models" / "llama-2-7b.json"
LAYERS, SEQ = 4, 512
H, I, V, HEADS, HEAD_DIM = 4096, 11008, 32000, 32, 128  # Llama-2-7B's shapes, written out for the oracle
MATMUL = LAYERS * (4 * H * H + 3 * H * I) + V * H  # every Linear: q, k, v, o, gate, up, down per layer; lm_head
BLOCK = 4 * H * H + 3 * H * I + 2 * H  # one decoder layer's parameters (two RMSNorm weights)
ROOT = 2 * V * H + H  # FSDP2's root unit: embedding, lm_head (untied), final norm
TENSORS = 9 * LAYERS + 3  # parameter tensors: 7 Linear + 2 norms per layer; embedding, norm, lm_head


@pytest.fixture(scope="module")
def few_layers(tmp_path_factory) -> Path:
    """Llama-2-7B's config.json from the catalogue, with LAYERS layers."""
    config = {k: v for k, v in json.loads(LLAMA_2_7B.read_text()).items() if not k.startswith("_")}
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (H, I, V)
    config["num_hidden_layers"] = LAYERS
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(config))
    return path


def _rehearse(recipe: str, config: Path, out: Path) -> dict:
    assert main(["rehearse", str(RECIPES / recipe), f"model.config={config}", f"batch.seq_len={SEQ}",
                 f"out={out}"]) == 0
    record = json.loads((out / "rehearsal.json").read_text())
    assert record["status"] == "done" and len(record["ranks"]) == 1  # every rank alike without a pipeline
    return record["ranks"][0]


@pytest.fixture(scope="module")
def fsdp2(few_layers, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp2") / "rehearsal"
    return out, _rehearse("7b_fsdp2", few_layers, out)


def test_fsdp2_flops_are_six_times_the_matmul_parameters_per_token(fsdp2):
    _, r = fsdp2
    tokens = 4 * SEQ  # global batch 16 over dp 4: 4 micro-batches of 1 × 512 tokens on each rank
    assert r["flops_counted"] == 6 * MATMUL * tokens
    # the CPU attention kernel's FLOPs, from the formula: 12 · heads · head_dim · s per token and layer
    assert r["flops_attention_formula"] == 12 * LAYERS * HEADS * HEAD_DIM * SEQ * tokens
    assert r["flops_planned"] == pytest.approx(r["flops_measured"], rel=1e-3)


def test_fsdp2_collectives_follow_its_units(fsdp2):
    """FSDP2 units: each block and the root. zero_stage 3 reshards every unit after its forward (root included: the
    trainer sets reshard_after_forward=True on it), so each is gathered before its forward and again before its
    backward, and its fp32 gradient reduce-scattered once, every micro-batch; then two all-reduces: the norm (each
    gradient tensor's partial norm, one fp32 each) and the loop's loss mean."""
    _, r = fsdp2
    ga, units = 4, LAYERS + 1
    assert r["collectives_measured"] == {"all_gather": 2 * units * ga, "reduce_scatter": units * ga, "all_reduce": 2}
    messages = {(c["kind"], c["message_bytes"]): c["calls"] for c in r["collective_messages_measured"]}
    assert messages[("all_gather", 2 * BLOCK)] == 2 * LAYERS * ga  # bf16 parameters
    assert messages[("all_gather", 2 * ROOT)] == 2 * ga
    assert messages[("reduce_scatter", 4 * BLOCK)] == LAYERS * ga  # fp32 gradients
    assert messages[("reduce_scatter", 4 * ROOT)] == ga
    assert messages[("all_reduce", 4 * TENSORS)] == 1 and messages[("all_reduce", 4)] == 1
    assert r["collectives_planned"] == r["collectives_measured"]


def test_fsdp2_memory_holds_a_quarter_of_the_fp32_model_and_adams_state(fsdp2):
    out, r = fsdp2
    kinds = r["peak_by_kind_measured"]
    shard = 4 * (LAYERS * BLOCK + ROOT) // 4  # fp32 parameters over 4 ranks (no padding: 4 divides every dim 0)
    assert kinds["Sharded Param"] == shard
    assert kinds["OptState"] == 2 * shard + 4 * TENSORS  # exp_avg and exp_avg_sq, and a 4-byte step per tensor
    assert r["peak_bytes_measured"] == sum(kinds.values())
    assert r["peak_at"].startswith("micro-batch")
    for field in ("peak_bytes_measured", "peak_bytes_planned", "flops_measured", "flops_planned",
                  "collectives_measured", "collectives_planned"):
        assert field in r
    assert is_our_rehearsal(out) and folder_problem(out, ours=is_our_rehearsal, writer="w") is None
    assert {p.name for p in out.iterdir()} >= {"resolved.json", "plan.json", "measured_rank0.json", "rehearsal.json"}


def test_fsdp2_plan_is_the_trackers_peak_phase_by_phase(fsdp2):
    """The plan's torch accounting is the peak over the step's phases, each within 5% of torch's FSDPMemTracker at
    real per-layer shapes (4 layers, where the root unit, the embedding and output layer, weighs as much as a third
    of the blocks: another balance than at full size, bench/results/rehearsal.txt). The optimizer step holds the
    model states alone: fp32 parameters, gradients, m and v sharded over 4 ranks, and AdamW's 4-byte step per
    tensor."""
    _, r = fsdp2
    assert all(p["bytes_measured"] and p["bytes_planned"] for p in r["phases"]), r["phases"]  # each phase both ways
    for p in r["phases"]:
        assert 0.95 <= p["ratio"] <= 1.05, p
    assert 0.95 <= r["peak_ratio"] <= 1.05
    step, shard = r["phases"][2]["by_kind_measured"], (LAYERS * BLOCK + ROOT) // 4
    assert (step["Sharded Param"], step["Sharded Grad"], step["OptState"]) == (4 * shard, 4 * shard,
                                                                             8 * shard + 4 * TENSORS)
    assert r["peak_bytes_measured"] == max(p["bytes_measured"] for p in r["phases"])


def _nf4_bytes(n: int) -> tuple[int, int]:
    """(codes, statistics) bytes of an n-weight NF4 tensor with double-quantized scales, as bitsandbytes stores it:
    half a byte a weight; a byte of absmax per 64 weights, an fp32 scale per 256 of those, the 16- and 256-entry
    fp32 code tables and the fp32 offset."""
    blocks = -(-n // 64)
    return n // 2, blocks + 4 * -(-blocks // 256) + 4 * 16 + 4 * 256 + 4


def test_nf4_bytes_are_bitsandbytes_own():
    import torch
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(torch.randn(96, 1000), blocksize=64, compress_statistics=True, quant_type="nf4")
    tables = (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
    assert (packed.nbytes, sum(t.nbytes for t in tables)) == _nf4_bytes(96 * 1000)


def test_qlora_holds_nf4_blocks_and_fp32_adapters_by_kind(few_layers, tmp_path):
    """QLoRA (7b_qlora_1gpu_ac: rank 64 on every linear, bf16, full checkpointing) rehearsed, bitsandbytes' matmuls on
    their fake kernels. At the optimizer step the tracker holds: parameters = the block linears' NF4 codes + the rest
    of the base in bf16 + the adapters in fp32; buffers = each block linear's NF4 statistics + the rotary frequencies
    (two fp32 tables of head_dim / 2); gradients and AdamW's state for the adapters alone. The plan is within 5% of
    the peak and of the FLOPs counted (bitsandbytes' fused 4-bit matmul counted as its GEMM)."""
    r = _rehearse("7b_qlora_1gpu_ac", few_layers, tmp_path / "qlora")
    rank, linears = 64, [(H, H)] * 4 + [(I, H)] * 2 + [(H, I)]  # (out, in): q, k, v, o, gate, up, down
    nf4 = [_nf4_bytes(o * i) for o, i in linears]
    adapters = LAYERS * sum(rank * (o + i) for o, i in linears)
    step = r["phases"][2]["by_kind_measured"]
    assert step["Parameter"] == (LAYERS * sum(codes for codes, _ in nf4) + 2 * (2 * V * H + (2 * LAYERS + 1) * H)
                                 + 4 * adapters)
    assert step["Buffer"] == LAYERS * sum(stats for _, stats in nf4) + 2 * 4 * HEAD_DIM // 2
    assert (step["Gradient"], step["Optstate"]) == (4 * adapters, 8 * adapters + 4 * 2 * 7 * LAYERS)
    assert 0.95 <= r["peak_ratio"] <= 1.05 and 0.95 <= r["flops_ratio"] <= 1.05, r


@pytest.mark.full  # DDP trains in the default suite (test_torch_parity); its rehearsal here, with the longer suite
def test_ddp_rehearses_whole_states_and_one_all_reduce_per_bucket(few_layers, tmp_path):
    """DDP (7b_ddp: dp 4, 4 micro-batches, the last one synchronised) holds every state whole; its buckets, built with
    the caps DDP rebuilds them with (1 MiB, then 25 MiB), close at each fp32 Linear (each over 25 MiB; the norms
    join the next one): the embedding, 7 per layer, and the last layer's norms with the final norm and lm_head. Each
    is all-reduced once, then the loop's loss mean; the plan, in the gradients' arrival order, counts as many."""
    r = _rehearse("7b_ddp", few_layers, tmp_path / "ddp")
    buckets = 1 + 7 * LAYERS + 1
    assert r["collectives_measured"] == r["collectives_planned"] == {"all_reduce": buckets + 1}
    step, params = r["phases"][2]["by_kind_measured"], LAYERS * BLOCK + ROOT
    assert (step["Parameter"], step["Gradient"], step["Optstate"]) == (4 * params, 4 * params, 8 * params + 4 * TENSORS)
    for p in r["phases"]:
        assert 0.95 <= p["ratio"] <= 1.05, p


def test_tp2_sp_over_fsdp2_counts_the_tp_plans_collectives(few_layers, tmp_path):
    """TP 2 + SP × FSDP2 over dp 2 (8 micro-batches a rank). Per micro-batch, torchtitan's plan with SP: each layer
    gathers the sequence before attention and before the MLP and reduce-scatters after each (the backward mirrors:
    4 all-gathers and 4 reduce-scatters); the embedding reduce-scatters into the sequence shards and the output layer
    gathers them (again mirrored in the backward); the vocabulary-parallel loss all-reduces 3 times, and each of the
    2·L + 1 sequence-parallel norms all-reduces its weight's gradient. FSDP2 over dp as above; the gradient norm is
    reduced over dp and over tp, and the loop's loss mean over dp."""
    r = _rehearse("7b_tp2_fsdp2_sp", few_layers, tmp_path / "tp2sp")
    ga, units, tp = 8, LAYERS + 1, 2
    assert r["flops_counted"] == 6 * MATMUL * ga * SEQ / tp
    sp = ga * (4 * LAYERS + 2)
    assert r["collectives_measured"] == {"all_gather": sp + 2 * units * ga, "reduce_scatter": sp + units * ga,
                                         "all_reduce": 3 * ga + (2 * LAYERS + 1) * ga + 3}
    assert r["collectives_planned"] == r["collectives_measured"]
    messages = {(c["kind"], c["message_bytes"]): c["calls"] for c in r["collective_messages_measured"]}
    activation = SEQ * H * 2  # the whole sequence's hidden states in bf16
    assert messages[("all_gather", activation)] == messages[("reduce_scatter", activation)] == sp


@pytest.mark.parametrize("recipe, args, says", [
    ("7b_zero3", [], 'backend="deepspeed" cannot be rehearsed'),
    ("7b_tp4", [], 'backend="megatron" cannot be rehearsed'),
])
def test_what_cannot_be_rehearsed_is_one_line(recipe, args, says, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["rehearse", str(RECIPES / recipe), *args, f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not out.exists()  # refused before anything is written or any rank starts


@pytest.mark.parametrize("foreign", ["file", "folder"])
def test_out_never_replaces_what_is_not_ours(foreign, tmp_path, capsys):
    target = tmp_path / "mine"
    if foreign == "file":
        target.write_text("my notes")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("my notes")
    assert main(["rehearse", str(RECIPES / "7b_fsdp2"), f"out={target}"]) == 2
    err = capsys.readouterr().err
    assert "out=" in err and err.count("\n") == 1, err
    assert (target.read_text() if foreign == "file" else (target / "notes.txt").read_text()) == "my notes"
    assert foreign == "file" or sorted(p.name for p in target.iterdir()) == ["notes.txt"]
