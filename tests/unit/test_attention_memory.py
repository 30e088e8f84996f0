"""The planner's attention block against what autograd keeps for backward, for both implementations and both model
families: one attention module's forward on a CPU rank, every tensor it saves counted once per storage (weights and
the shared rotary tables left out), against the attn_* terms of launch.plan.memory.activation_terms. Also fused
(SDPA) against unfused attention: the same losses and gradients."""
import socket

import pytest
import torch
import torch.distributed as dist

from launch.config.models import load_model
from launch.plan.memory import activation_terms

S, B = 256, 2
GQA = "tiny-llama"  # 4 query heads share 2 key/value heads


@pytest.fixture(scope="module")
def one_rank():
    from megatron.core import parallel_state

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def saved_bytes(run, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs forward, less those in `exclude`."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def predicted(spec, attention: str, *, hf: bool) -> float:
    terms = activation_terms("llama", S, B, spec.hidden_size, spec.num_heads, ffn=spec.intermediate_size,
                             kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, e=4, hf_norm=hf, attention=attention,
                             fused_qkv=not hf)
    return sum(t.bytes for t in terms if t.name.startswith("attn_"))


def storages(*tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", [GQA, "tiny-qwen2"])
def test_hugging_face_attention_block_keeps_what_the_plan_says(name, attention):
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    spec = load_model(name=name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32, attn_implementation=attention)
    model.train()
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True) * 1.0  # an activation, as a layer's input is
    pos = torch.arange(S)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    mask = None if attention == "sdpa" else torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    attn = model.model.layers[0].self_attn
    got = saved_bytes(lambda: attn(x, position_embeddings=(cos, sin), attention_mask=mask),
                      storages(*model.parameters(), cos, sin, *([] if mask is None else [mask])))
    assert got == pytest.approx(predicted(spec, attention, hf=True), rel=0.02), (got, predicted(spec, attention, hf=True))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_megatron_attention_block_keeps_what_the_plan_says(one_rank, attention):
    from launch.ranks.trainers.megatron_model import build_chunks, transformer_config

    spec = load_model(name=GQA)
    config = transformer_config(spec, cuda=False, tp=1, pp=1, vpp=1, sp=False, activation_checkpointing="none",
                                dtype="fp32")
    chunk = build_chunks(spec, config, seed=0, attention=attention)[0]
    x = torch.randn(S, B, spec.hidden_size, requires_grad=True) * 1.0
    rope = chunk.rotary_pos_emb(S)
    attn = chunk.decoder.layers[0].self_attention
    # Megatron computes the rotary cos/sin and, unfused, the causal mask in every layer: s·d and s² sized, left out
    # of the plan (at s=4096, d=128: 8 MiB and 16 MiB a layer beside GiBs)
    got = saved_bytes(lambda: attn(x, attention_mask=None, rotary_pos_emb=rope),
                      storages(*chunk.parameters(), rope))
    small = 4 * 4 * S * spec.head_dim + (S * S if attention == "eager" else 0)
    assert got - small == pytest.approx(predicted(spec, attention, hf=False), rel=0.02)


def test_fused_attention_gives_the_unfused_losses_and_gradients(one_rank):
    from launch.ranks.trainers.megatron_model import build_chunks, hf_reference_state, load_hf_state, transformer_config

    for name in (GQA, "tiny-qwen2"):
        spec = load_model(name=name)
        config = transformer_config(spec, cuda=False, tp=1, pp=1, vpp=1, sp=False, activation_checkpointing="none",
                                    dtype="fp32")
        g = torch.Generator().manual_seed(5)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf_reference_state(spec, 0).items()}
        ids = torch.randint(0, spec.vocab_size, (B, 65), generator=torch.Generator().manual_seed(1))
        out = {}
        for attention in ("eager", "sdpa"):
            chunk = build_chunks(spec, config, seed=0, attention=attention)[0]
            load_hf_state([chunk], state, spec)
            loss = chunk(ids[:, :-1], torch.arange(64).expand(B, 64), None, labels=ids[:, 1:]).mean()
            loss.backward()
            out[attention] = (loss.item(), {n: p.grad for n, p in chunk.named_parameters()})
        assert out["sdpa"][0] == pytest.approx(out["eager"][0], abs=1e-6)
        for (n, a), (m, b) in zip(out["eager"][1].items(), out["sdpa"][1].items(), strict=True):
            assert n == m and torch.allclose(a, b, atol=1e-6), n
