"""launch.ranks.trainers.megatron_model at TP = PP = 1, against Hugging Face transformers as the oracle:
parameter counts (every catalogue model, built on the meta device), per-token loss and gradients after
loading HF weights, the HF <-> Megatron round trip, and the strictness of both conversions.

Single process: a 1-rank gloo group and Megatron's parallel_state, set up once for the module.
The multi-rank layouts are in tests/dist/test_megatron_sharding.py.
"""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.config.models import catalogue_names, load_model

SEQ, BATCH = 16, 2
TINY = ("tiny-llama", "tiny-qwen2")  # untied + GQA; tied + q/k/v bias


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank():
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(spec, activation_checkpointing="none"):
    from launch.ranks.trainers.megatron_model import transformer_config

    return transformer_config(spec, cuda=False, tp=1, pp=1, vpp=1, sp=False, activation_checkpointing=activation_checkpointing,
                              dtype="fp32")


def _perturbed_reference(spec, seed=0) -> dict[str, torch.Tensor]:
    """HF's init has unit norms and zero biases, under which a swapped norm or a dropped bias would pass
    unnoticed: every tensor gets noise, the same on every call."""
    from launch.ranks.trainers.megatron_model import hf_reference_state

    g = torch.Generator().manual_seed(1000 + seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf_reference_state(spec, seed).items()}


def _hf_model(spec, state):
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32, attn_implementation="eager")
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if spec.tie_word_embeddings else [])
    return model


def _batch(spec):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _hf_per_token_loss(model, tokens, labels):
    logits = model(input_ids=tokens).logits
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return flat.view(labels.shape)


def _built(spec, state, activation_checkpointing="none", attention="eager"):
    from launch.ranks.trainers.megatron_model import build_chunks, load_hf_state

    chunks = build_chunks(spec, _config(spec, activation_checkpointing), seed=0, attention=attention)
    load_hf_state(chunks, state, spec)
    return chunks


def _positions():
    return torch.arange(SEQ).expand(BATCH, SEQ)


@pytest.mark.parametrize("name", catalogue_names())
def test_parameter_count_matches_transformers(one_rank, name):
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config
    from launch.ranks.trainers.megatron_model import build_chunks

    spec = load_model(name=name)
    # The meta device keeps the 7-8B models to shapes only.
    with torch.device("meta"):
        chunks = build_chunks(spec, _config(spec), seed=0, attention="sdpa")
        hf = AutoModelForCausalLM.from_config(hf_config(spec))
    assert len(chunks) == 1
    assert {p.device.type for p in chunks[0].parameters()} == {"meta"}
    assert sum(p.numel() for p in chunks[0].parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", TINY)
def test_loss_and_logits_match_transformers(one_rank, name):
    spec = load_model(name=name)
    state = _perturbed_reference(spec)
    chunk = _built(spec, state)[0]
    hf = _hf_model(spec, state)
    tokens, labels = _batch(spec)
    chunk.eval()
    with torch.no_grad():
        want = _hf_per_token_loss(hf, tokens, labels)
        got = chunk(tokens, _positions(), None, labels=labels)
        logits = chunk(tokens, _positions(), None)
        hf_logits = hf(input_ids=tokens).logits
    assert got.shape == (BATCH, SEQ) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("activation_checkpointing", ["none", "full", "selective"])
def test_gradients_match_transformers(one_rank, activation_checkpointing):
    from launch.ranks.trainers.megatron_model import gather_hf_state, place_of

    spec = load_model(name="tiny-qwen2")
    state = _perturbed_reference(spec)
    chunk = _built(spec, state, activation_checkpointing)[0]
    hf = _hf_model(spec, state)
    tokens, labels = _batch(spec)
    chunk.train()
    chunk(tokens, _positions(), None, labels=labels).mean().backward()
    _hf_per_token_loss(hf, tokens, labels).mean().backward()

    # Megatron's grads, laid out as HF's: the same conversion as the weights' (tied: one embedding grad).
    grads = gather_hf_state({place_of(chunk): {k: p.grad for k, p in chunk.named_parameters()}}, spec,
                            tp=1, pp=1, vpp=1)
    hf_params = dict(hf.named_parameters())
    assert list(grads) == list(hf_params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", TINY)
def test_round_trip_is_exact(one_rank, name):
    from launch.ranks.trainers.megatron_model import gather_hf_state, place_of

    spec = load_model(name=name)
    state = _perturbed_reference(spec)
    chunk = _built(spec, state)[0]
    back = gather_hf_state({place_of(chunk): chunk.state_dict()}, spec, tp=1, pp=1, vpp=1)
    assert list(back) == list(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_a_transformer_engine_state_exports_by_its_own_norm_names(one_rank):
    """Transformer Engine's spec keeps each RMSNorm weight inside the fused linear after it
    (TELayerNormColumnParallelLinear.layer_norm_weight, megatron/core/extensions/transformer_engine.py): a checkpoint
    of a TE run, the local chunk's state with the two norms renamed so by hand, exports to the same HF state."""
    from launch.ranks.trainers.megatron_model import gather_hf_state, place_of

    spec = load_model(name="tiny-llama")
    state = _perturbed_reference(spec)
    chunk = _built(spec, state)[0]
    local = chunk.state_dict()
    renamed = {k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"): v for k, v in local.items()}
    assert sum(k.endswith("layer_norm_weight") for k in renamed) == 2 * spec.num_layers
    # Transformer Engine 2 keeps an empty uint8 `_extra_state` tensor in every TE module's state (its FP8 metadata)
    renamed |= {k.rsplit(".", 1)[0] + "._extra_state": torch.empty(0, dtype=torch.uint8)
                for k in list(renamed) if k.endswith("linear_qkv.weight")}
    back = gather_hf_state({place_of(chunk): renamed}, spec, tp=1, pp=1, vpp=1)
    assert list(back) == list(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    mixed = {**renamed, "decoder.layers.0.input_layernorm.weight": local["decoder.layers.0.input_layernorm.weight"]}
    with pytest.raises(ValueError, match="which the mapping does not know"):
        gather_hf_state({place_of(chunk): mixed}, spec, tp=1, pp=1, vpp=1)


def test_reference_state_is_hf_state_dict_without_the_tied_alias(one_rank):
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config
    from launch.ranks.trainers.megatron_model import hf_reference_state

    spec = load_model(name="tiny-qwen2")
    ref = hf_reference_state(spec, seed=4)
    torch.manual_seed(4)
    full = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32).state_dict()
    assert set(full) - set(ref) == {"lm_head.weight"}
    assert full["lm_head.weight"].data_ptr() == full["model.embed_tokens.weight"].data_ptr()
    for key, value in ref.items():
        assert torch.equal(value, full[key]), key


def test_load_accepts_hf_state_dict_with_tied_alias(one_rank):
    from launch.ranks.trainers.megatron_model import build_chunks, load_hf_state

    spec = load_model(name="tiny-qwen2")
    state = _perturbed_reference(spec)
    chunks = build_chunks(spec, _config(spec), seed=0, attention="sdpa")
    load_hf_state(chunks, {**state, "lm_head.weight": state["model.embed_tokens.weight"]}, spec)
    assert torch.equal(chunks[0].embedding.word_embeddings.weight, state["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf_state(chunks, {**state, "lm_head.weight": torch.zeros_like(state["model.embed_tokens.weight"])}, spec)


def test_load_is_strict_about_hf_keys_and_shapes(one_rank):
    from launch.ranks.trainers.megatron_model import build_chunks, load_hf_state

    spec = load_model(name="tiny-llama")
    state = _perturbed_reference(spec)
    chunks = build_chunks(spec, _config(spec), seed=0, attention="sdpa")
    before = {k: v.clone() for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}

    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="lacks 'model.layers.2.mlp.up_proj.weight'"):
        load_hf_state(chunks, missing, spec)
    with pytest.raises(ValueError, match="'model.layers.9.self_attn.q_proj.weight'"):
        load_hf_state(chunks, {**state, "model.layers.9.self_attn.q_proj.weight": torch.zeros(64, 64)}, spec)
    bad = dict(state)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(64, 64\)"):
        load_hf_state(chunks, bad, spec)
    # Nothing was half loaded.
    after = {k: v for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_chunk_of_another_model_is_refused(one_rank):
    from launch.ranks.trainers.megatron_model import build_chunks, hf_state_to_chunk

    llama, qwen = load_model(name="tiny-llama"), load_model(name="tiny-qwen2")
    chunk = build_chunks(qwen, _config(qwen), seed=0, attention="sdpa")[0]
    # Same shapes except Qwen2's q/k/v biases and its tied head: the chunk's bias keys have no HF source.
    with pytest.raises(ValueError, match="'decoder.layers.0.self_attention.linear_qkv.bias' has no HF source"):
        hf_state_to_chunk(_perturbed_reference(llama), llama, chunk)


def test_gather_is_strict(one_rank):
    from launch.ranks.trainers.megatron_model import Place, gather_hf_state, place_of

    spec = load_model(name="tiny-llama")
    chunk = _built(spec, _perturbed_reference(spec))[0]
    local = chunk.state_dict()
    with pytest.raises(ValueError, match="local state of Place"):
        gather_hf_state({}, spec, tp=1, pp=1, vpp=1)
    with pytest.raises(ValueError, match="no Place"):
        gather_hf_state({place_of(chunk): local, Place(0, 0, 1): local}, spec, tp=1, pp=1, vpp=1)
    without = {k: v for k, v in local.items() if k != "decoder.layers.3.mlp.linear_fc2.weight"}
    with pytest.raises(ValueError, match="lacks 'decoder.layers.3.mlp.linear_fc2.weight'"):
        gather_hf_state({place_of(chunk): without}, spec, tp=1, pp=1, vpp=1)
    with pytest.raises(ValueError, match="'decoder.layers.4.mlp.linear_fc2.weight', which the mapping does not know"):
        gather_hf_state({place_of(chunk): {**local, "decoder.layers.4.mlp.linear_fc2.weight": torch.zeros(1)}},
                        spec, tp=1, pp=1, vpp=1)


def test_transformer_config_maps_the_hf_config():
    from launch.ranks.trainers.megatron_model import transformer_config

    spec = load_model(name="tiny-qwen2")
    c = transformer_config(spec, cuda=False, tp=2, pp=2, vpp=2, sp=True, activation_checkpointing="full", dtype="bf16")
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
            c.kv_channels) == (4, 64, 128, 4, 2, 16)
    assert (c.normalization, c.layernorm_epsilon, c.gated_linear_unit, c.activation_func) == (
        "RMSNorm", 1e-5, True, F.silu)
    assert (c.add_bias_linear, c.add_qkv_bias, c.hidden_dropout, c.attention_dropout) == (False, True, 0.0, 0.0)
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size,
            c.sequence_parallel) == (2, 2, 2, True)
    assert c.microbatch_group_size_per_vp_stage == 2  # Megatron's default, the pipeline size
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    assert (c.params_dtype, c.pipeline_dtype, c.bf16, c.fp16) == (torch.bfloat16, torch.bfloat16, True, False)
    assert c.init_method_std == 0.02 and c.gradient_accumulation_fusion is False
    assert c.use_cpu_initialization is (not torch.cuda.is_available())

    sel = transformer_config(spec, cuda=False, tp=1, pp=1, vpp=1, sp=False, activation_checkpointing="selective", dtype="fp32")
    assert (sel.recompute_granularity, sel.recompute_modules, sel.virtual_pipeline_model_parallel_size) == (
        "selective", ["core_attn"], None)
    llama = transformer_config(load_model(name="tiny-llama"), cuda=False, tp=1, pp=1, vpp=1, sp=False,
                               activation_checkpointing="none", dtype="fp32")
    assert (llama.add_qkv_bias, llama.recompute_granularity, llama.params_dtype) == (False, None, torch.float32)


@pytest.mark.parametrize(("layout", "message"), [
    ({"tp": 3}, "vocab_size=512 is not divisible by tp=3"),
    ({"pp": 3}, "num_layers=4 is not divisible by pp\\*vpp=3"),
    ({"pp": 2, "vpp": 4}, "num_layers=4 is not divisible by pp\\*vpp=8"),
    ({"sp": True}, "sp=True needs tp > 1"),
    ({"vpp": 2}, "vpp=2 needs pp > 1"),
])
def test_transformer_config_refuses_layouts_megatron_cannot_build(layout, message):
    from launch.ranks.trainers.megatron_model import transformer_config

    args = {"tp": 1, "pp": 1, "vpp": 1, "sp": False, **layout}
    with pytest.raises(ValueError, match=message):
        transformer_config(load_model(name="tiny-llama"), cuda=False, activation_checkpointing="none", dtype="fp32", **args)


@pytest.mark.parametrize("name", catalogue_names())
def test_rope_frequencies_match_transformers(one_rank, name):
    """rope_theta (or its default) and Llama 3.1's llama3 scaling reach Megatron's RotaryEmbedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from launch.torchtools.hf import hf_config
    from launch.ranks.trainers.megatron_model import build_chunks

    spec = load_model(name=name)
    rotary = {"LlamaForCausalLM": LlamaRotaryEmbedding, "Qwen2ForCausalLM": Qwen2RotaryEmbedding}[spec.architecture]
    want = rotary(config=hf_config(spec)).inv_freq
    with torch.device("meta"):
        chunk = build_chunks(spec, _config(spec), seed=0, attention="sdpa")[0]
    torch.testing.assert_close(chunk.rotary_pos_emb.inv_freq, want, rtol=1e-6, atol=0)


def test_build_chunks_refuses_a_parallel_state_that_disagrees(one_rank):
    from launch.ranks.trainers.megatron_model import build_chunks, transformer_config

    spec = load_model(name="tiny-llama")
    config = transformer_config(spec, cuda=False, tp=2, pp=1, vpp=1, sp=False, activation_checkpointing="none", dtype="fp32")
    with pytest.raises(ValueError, match=r"parallel_state has \(tp, pp, vpp\)=\(1, 1, None\).*\(2, 1, None\)"):
        build_chunks(spec, config, seed=0, attention="sdpa")


_IMPORT_PROBE = ("import sys, torch; real = torch.compile; {before}import megatron.core.jit as j; "
                 "from megatron.core.activations import quick_gelu; x = torch.linspace(-3, 3, 7); "
                 "print(j.jit_fuser is real, torch.compile is real, 'torch._inductor.compile_fx' in sys.modules, "
                 "hasattr(quick_gelu, '_torchdynamo_orig_callable'), "
                 "torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x)))")


def test_megatron_imports_with_its_fusions_eager_on_cpu_ranks():
    """megatron_backend.import_megatron_eager (what a CPU rank does first): Megatron's jit_fuser is not
    torch.compile, so its decorated functions are the plain ones (the same numbers) and inductor is never
    imported, while torch.compile is itself again for everyone else. Without it (a fresh interpreter importing
    Megatron as it comes) the same probe finds jit_fuser = torch.compile, a compiled wrapper and inductor loaded."""
    import subprocess
    import sys

    from tests.conftest import REPO

    def probe(before: str) -> list[str]:
        p = subprocess.run([sys.executable, "-c", _IMPORT_PROBE.format(before=before)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.split()

    eager = "from launch.ranks.trainers.megatron_backend import import_megatron_eager; import_megatron_eager(); "
    assert probe(eager) == ["False", "True", "False", "False", "True"]
    assert probe("")[:4] == ["True", "True", "True", "True"]
