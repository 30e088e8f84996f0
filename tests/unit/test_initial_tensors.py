"""The sharded start-up's source of weights (launch.ranks.trainers.common.initial_tensors) against the whole build every
other backend starts from (common.build_model, transformers' own from_config after torch.manual_seed): the same
tensors bit for bit, one at a time, each once, for Llama, Qwen2 (biases, tied embeddings) and a tall Llama; and a
model.weights folder read tensor by tensor equal to transformers' from_pretrained."""
import pytest
import torch

from launch.config.resolve import resolve_path
from launch.ranks.trainers.common import build_model, initial_tensors
from tests.conftest import REPO, RECIPES

TALL = REPO / "tests" / "fixtures" / "models" / "tall-llama" / "config.json"


@pytest.mark.parametrize("model", ["model.name=tiny-llama", "model.name=tiny-qwen2", f"model.config={TALL}"])
def test_seeded_tensors_are_the_whole_builds_bit_for_bit(model):
    resolved = resolve_path(RECIPES / "tiny_fsdp2", [model, "train.seed=7"])
    whole = build_model(resolved).state_dict()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    names = []
    for name, tensor in initial_tensors(resolved):
        names.append(name)
        assert tensor.dtype == torch.float32 and torch.equal(tensor, whole[name]), name
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator left as it was
    # each parameter once (a tied lm_head is the embedding), in the model's order: megatron_model.load_hf_streamed's
    want = [p.name for p in resolved.model.parameters()]
    assert names == want


def test_stored_tensors_equal_from_pretrained(tmp_path):
    resolved = resolve_path(RECIPES / "tiny_fsdp2", ["model.name=tiny-qwen2"])
    model = build_model(resolved)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "w")  # bf16 on disk: read back as fp32
    with_weights = resolve_path(RECIPES / "tiny_fsdp2", ["model.name=tiny-qwen2", f'model.weights="{tmp_path / "w"}"'])
    whole = build_model(with_weights).state_dict()
    got = dict(initial_tensors(with_weights))
    assert list(got) == [p.name for p in with_weights.model.parameters()]  # the model's order, not the file's
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, whole[name]), name
