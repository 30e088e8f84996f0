"""launch.ranks.trainers.cpu_compat: each redirect makes one Megatron-Core call work on a CPU-only torch build,
and each is still needed (the same call fails in a fresh interpreter without the redirects).

Single process: a 1-rank gloo group and Megatron's parallel_state, set up once for the module. The
redirect for tied embeddings under PP needs two pipeline ranks; tests/dist/test_megatron_sharding.py has it.
"""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the redirects exist for CPU-only builds")

SEQ, BATCH, VOCAB, HIDDEN = 8, 2, 64, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_one_rank() -> None:
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def _teardown_one_rank() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def redirected() -> list[str]:
    from launch.ranks.trainers import cpu_compat

    _init_one_rank()
    names = cpu_compat.apply(cuda=False)
    yield names
    _teardown_one_rank()


def _config(**overrides: Any):
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                                  hidden_dropout=0.0, attention_dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _gpt(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


# --------------------------------------------------------------------------- the Megatron calls, one per redirect
# Each returns what the in-process test checks; without the redirects each raises.


def _call_rotary_embedding() -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )

    return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(SEQ)


def _call_seed() -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)


def _call_fork(draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        return draw()


def _call_fork_unseeded() -> torch.Tensor:
    # Without the redirects the tracker cannot be seeded, so give it a state by hand to reach fork() itself.
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.get_rng_state()})
    return _call_fork(lambda: torch.rand(3))


def _call_schedule(model, batches: list[dict[str, torch.Tensor]], forward_only: bool) -> list[torch.Tensor]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def step(data, chunk):
        b = next(data)
        per_token = chunk(b["tokens"], positions, mask, labels=b["labels"])

        def loss_func(output):
            loss = output.mean()
            # The schedule divides `loss` in place by the number of micro-batches: report a copy.
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func

    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches), model=[model],
                                      num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH,
                                      forward_only=forward_only)
    return [o["loss"] for o in out]


def _call_p2p():
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    # gloo cannot send to its own rank, so the one-rank call carries nothing; it still ends in the
    # synchronize that every batched send/receive ends with.
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), _config(pipeline_dtype=torch.float32))
    return comm._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=False,
                             tensor_shape=None, wait_on_reqs=True)


def _call_causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                                    softmax_in_fp32=True, scale=None)
    return softmax(scores, None)


def _call_sp_norm(sequence_parallel: bool = True):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, normalization="RMSNorm")
    return WrappedTorchNorm(config=config, hidden_size=HIDDEN, eps=1e-6)


def _tiny_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (n, BATCH, SEQ + 1), generator=g)
    return [{"tokens": d[:, :-1], "labels": d[:, 1:]} for d in data]


def _call_distributed_optimizer() -> dict[str, Any]:
    """One step of Megatron's DDP and distributed optimizer on a tiny GPT, clipping at 1.0. Returns the clip's norm,
    the norm of the reduced gradients (Megatron's main_grad) summed by hand before the step, and whether every
    parameter moved."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.manual_seed(0)
    config = _config()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), _gpt(config))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [model], config_overrides={})
    b = _tiny_batches(1)[0]
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    model.zero_grad_buffer()
    opt.zero_grad()
    model(b["tokens"], torch.arange(SEQ).expand(BATCH, SEQ), mask, labels=b["labels"]).mean().backward()
    model.finish_grad_sync()
    by_hand = math.sqrt(sum(float(p.main_grad.double().pow(2).sum()) for p in model.module.parameters()))
    before = [p.detach().clone() for p in model.module.parameters()]
    _, norm, _ = opt.step()
    moved = all(not torch.equal(p, b0) for p, b0 in zip(model.module.parameters(), before, strict=True))
    return {"norm": norm, "by_hand": by_hand, "moved": moved}


# The distributed optimizer's redirects, in the order a run reaches the call each one fixes.
DISTRIBUTED_OPTIMIZER = ("optimizer_device", "cuda_type_names", "l2_norm_device")


def distributed_optimizer_failures() -> dict[str, str]:
    """With every other redirect in place, the distributed optimizer's step without each of its redirects (each
    missing one installed before the next is left out): what it raised."""
    from launch.ranks.trainers import cpu_compat

    _init_one_rank()
    for r in cpu_compat.REDIRECTS:
        if r.name not in DISTRIBUTED_OPTIMIZER:
            r.install()
    _call_seed()
    out = {}
    for name in DISTRIBUTED_OPTIMIZER:
        try:
            _call_distributed_optimizer()
            out[name] = ""
        except Exception as exc:  # the point is to record whatever Megatron raised
            out[name] = f"{type(exc).__name__}: {exc}"
        next(r for r in cpu_compat.REDIRECTS if r.name == name).install()
    _teardown_one_rank()
    return out


def failures_without_redirects() -> dict[str, str]:
    """Run every call with no redirect in place; what each raised (empty when a call passed)."""
    _init_one_rank()
    calls: dict[str, Callable[[], Any]] = {
        "current_device": _call_rotary_embedding,
        "rng_tracker/seed": _call_seed,
        "rng_tracker/fork": _call_fork_unseeded,
        "schedules_device": lambda: _call_schedule(_gpt(_config()), _tiny_batches(1), forward_only=True),
        "p2p_synchronize": _call_p2p,
        "causal_mask": lambda: _call_causal_softmax(torch.zeros(1, 1, 4, 4)),
        "torch_norm_sp": _call_sp_norm,
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except Exception as exc:  # the point is to record whatever Megatron raised
            out[name] = f"{type(exc).__name__}: {exc}"
    _teardown_one_rank()
    return out


# --------------------------------------------------------------------------- tests


def _in_a_fresh_interpreter(function: str) -> dict[str, str]:
    """What `function` of this module returns, run in a new Python (where no redirect has been installed yet)."""
    code = (f"import json; from tests.unit.test_cpu_compat import {function}; "
            f"print('RESULT' + json.dumps({function}()))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])


def test_every_redirect_is_still_needed():
    failures = _in_a_fresh_interpreter("failures_without_redirects")
    no_cuda = "Torch not compiled with CUDA enabled"
    assert failures == {
        "current_device": f"AssertionError: {no_cuda}",
        "rng_tracker/seed": f"AssertionError: {no_cuda}",
        "rng_tracker/fork": f"AssertionError: {no_cuda}",
        "schedules_device": f"AssertionError: {no_cuda}",
        "p2p_synchronize": f"AssertionError: {no_cuda}",
        "causal_mask": f"AssertionError: {no_cuda}",
        "torch_norm_sp": "AssertionError: sequence parallel not supported by torch LayerNorm",
    }


def test_every_distributed_optimizer_redirect_is_still_needed():
    failures = _in_a_fresh_interpreter("distributed_optimizer_failures")
    assert list(failures) == list(DISTRIBUTED_OPTIMIZER)
    assert failures["optimizer_device"] == "AssertionError: Torch not compiled with CUDA enabled"
    assert failures["cuda_type_names"].startswith("TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor")
    assert failures["l2_norm_device"] == "AssertionError: Torch not compiled with CUDA enabled"


def test_distributed_optimizer_clips_by_the_reduced_gradients(redirected):
    _call_seed()
    got = _call_distributed_optimizer()
    assert got["norm"] == pytest.approx(got["by_hand"], rel=1e-6)
    assert got["norm"] > 1.0  # the clip took effect, so the norm is the one Megatron clipped by
    assert got["moved"]


def test_apply_names_every_redirect(redirected):
    from launch.ranks.trainers import cpu_compat

    assert redirected == [r.name for r in cpu_compat.REDIRECTS]
    assert all(r.installed() for r in cpu_compat.REDIRECTS)


def test_apply_is_idempotent(redirected):
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from launch.ranks.trainers import cpu_compat

    before = (torch.cuda.current_device, mrandom.torch, mrandom._set_cuda_rng_state, schedules.torch,
              WrappedTorchNorm.__new__)
    assert cpu_compat.apply(cuda=False) == redirected
    after = (torch.cuda.current_device, mrandom.torch, mrandom._set_cuda_rng_state, schedules.torch,
             WrappedTorchNorm.__new__)
    assert all(a is b for a, b in zip(before, after, strict=True))
    # A second wrap of the norm would hide the first one's restore of config.sequence_parallel.
    assert WrappedTorchNorm.__new__.__wrapped__ is not None
    assert not getattr(WrappedTorchNorm.__new__.__wrapped__, "_layoutlab_cpu_compat", False)


def test_the_run_decides_not_the_machine(redirected, monkeypatch):
    """The redirects follow the run's one device decision (HardwareProfile.device_type), whatever torch.cuda says:
    a run on GPUs gets only the SP norm patch (the norm refuses SP on GPUs too, without Apex/TE), a run on CPU ranks
    on a machine with CUDA every redirect, and the Megatron weights go where the run computes."""
    from launch.config.models import load_model
    from launch.ranks.trainers import cpu_compat
    from launch.ranks.trainers.megatron_model import transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply(cuda=True) == ["torch_norm_sp"]
    assert cpu_compat.apply(cuda=False) == redirected
    spec = load_model(name="tiny-llama")
    kw = dict(tp=1, pp=1, vpp=1, sp=False, activation_checkpointing="none", dtype="fp32")
    assert transformer_config(spec, cuda=False, **kw).use_cpu_initialization is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transformer_config(spec, cuda=True, **kw).use_cpu_initialization is False


def test_every_module_asks_the_profile_where_a_rank_computes():
    """One decision: the CPU profile's ranks compute on CPUs, every other profile's on GPUs."""
    from launch.config.hardware import load_profile, profile_names

    assert {name: load_profile(name).device_type for name in profile_names()} == {
        name: "cpu" if name == "cpu" else "cuda" for name in profile_names()}


def test_current_device_rotary_embedding(redirected):
    emb = _call_rotary_embedding()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.outer(torch.arange(SEQ, dtype=torch.float32), inv_freq)
    assert emb.device.type == "cpu"
    torch.testing.assert_close(emb[:, 0, 0, :], torch.cat([freqs, freqs], dim=-1), rtol=0, atol=0)


def test_rng_tracker_seed_and_fork(redirected):
    _call_seed()
    default = torch.Generator().manual_seed(123)  # the data-parallel (default) stream
    model_parallel = torch.Generator().manual_seed(123 + 2718)  # Megatron's offset + tp_rank 0
    a = torch.rand(3)
    inside1 = _call_fork(lambda: torch.rand(3))
    b = torch.rand(3)
    inside2 = _call_fork(lambda: torch.rand(3))  # the tracked stream continues where it stopped
    assert torch.equal(a, torch.rand(3, generator=default))
    assert torch.equal(b, torch.rand(3, generator=default))  # fork restored the default stream
    assert torch.equal(inside1, torch.rand(3, generator=model_parallel))
    assert torch.equal(inside2, torch.rand(3, generator=model_parallel))


def test_schedules_device_runs_forward_backward(redirected):
    _call_seed()
    torch.manual_seed(0)
    model = _gpt(_config())
    batches = _tiny_batches(2)
    losses = _call_schedule(model, batches, forward_only=False)
    schedule_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    direct = [model(b["tokens"], positions, mask, labels=b["labels"]).mean() for b in batches]
    (sum(direct) / len(direct)).backward()  # the schedule divides each micro-batch loss by their number

    for got, want in zip(losses, direct, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(schedule_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_p2p_synchronize(redirected):
    assert _call_p2p() == (None, None, [])


def test_causal_mask_built_on_cpu(redirected):
    scores = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    got = _call_causal_softmax(scores.clone())
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    want = torch.softmax(scores.masked_fill(causal, -math.inf), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_torch_norm_accepts_sequence_parallel_and_tags_params(redirected):
    norm = _call_sp_norm(sequence_parallel=True)
    assert isinstance(norm, torch.nn.RMSNorm)
    params = list(norm.parameters())
    assert params and all(p.sequence_parallel is True for p in params)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)

    plain = _call_sp_norm(sequence_parallel=False)
    assert all(p.sequence_parallel is False for p in plain.parameters())


def test_sp_norm_keeps_config_flag(redirected):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(tensor_model_parallel_size=2, sequence_parallel=True, normalization="RMSNorm")
    WrappedTorchNorm(config=config, hidden_size=HIDDEN, eps=1e-6)
    assert config.sequence_parallel is True


def test_tied_embedding_copy_leaves_tensor_cuda_alone(redirected):
    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )

    # The redirect lasts only as long as the Megatron method it wraps: .cuda() fails again afterwards.
    _gpt(_config())
    assert getattr(LanguageModule.setup_embeddings_and_output_layer, "_layoutlab_cpu_compat", False)
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
        torch.zeros(1).cuda()
