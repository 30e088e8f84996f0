"""Make Megatron-Core 0.16.1 run on CPU ranks (gloo) of a CPU-only torch build.

Megatron-Core assumes CUDA in a handful of places that a CPU rank reaches. `apply()` redirects exactly
those, each one found by running the Megatron call without it and watching it fail
(tests/unit/test_cpu_compat.py runs every such call in a fresh interpreter to prove that each redirect
is still needed, and in-process to prove that it now works). For a run on GPUs (`apply(cuda=True)`: the run's
device decision, HardwareProfile.device_type, not whether this machine has CUDA) it installs only
the one patch that is not about CUDA (`torch_norm_sp`: the local spec's norm refuses sequence parallelism
wherever Apex and Transformer Engine are absent, GPUs included).

Where a redirect can be scoped it is: a stand-in for the `torch` name of a single Megatron module
(`_ModuleProxy`), or a replaced function under the one name that imported it, changes what that module
sees and nothing else. Megatron classes are patched in place (WrappedTorchNorm, LanguageModule, DistributedOptimizer),
because other modules bound them by name at import. Only `torch.cuda.current_device` is replaced
process-wide, because some forty Megatron modules call it to place buffers; Tensor.cuda is the
identity, and Tensor.type names CPU tensors as CUDA ones, only for as long as one Megatron method runs.
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

_MARK = "_layoutlab_cpu_compat"  # set on every replacement, so that a second apply() sees it is in place


class _ModuleProxy(types.ModuleType):
    """Stands in for a module (torch, torch.cuda) under one name inside one Megatron module: the given
    attributes are replaced, every other attribute is looked up on the real module at each access."""

    def __init__(self, real: types.ModuleType, **overrides: Any) -> None:
        super().__init__(real.__name__)
        object.__setattr__(self, "_real", real)
        for name, value in overrides.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _is_proxy(obj: object) -> bool:
    return isinstance(obj, _ModuleProxy)


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


# --------------------------------------------------------------------------- current device


def _install_current_device() -> None:
    """torch.cuda.current_device() -> cpu, process-wide.

    Megatron places buffers with device=torch.cuda.current_device(): RotaryEmbedding.get_emb moves
    inv_freq there on every forward (so even TP1 needs this), the TP/SP all-gather and reduce-scatter
    outputs, the global memory buffer of sequence parallelism, the p2p receive buffers of the pipeline
    schedules, Megatron DDP's grad buffers. On a CPU build it raises "Torch not compiled with CUDA".
    """
    torch.cuda.current_device = _marked(lambda: torch.device("cpu"))


def _current_device_installed() -> bool:
    return getattr(torch.cuda.current_device, _MARK, False)


# --------------------------------------------------------------------------- RNG tracker


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    if graph_safe:
        raise RuntimeError("graph-safe RNG states exist only with CUDA graphs; use_cudagraphable_rng needs a GPU")
    return torch.get_rng_state()  # already a copy


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    if graph_safe:
        raise RuntimeError("graph-safe RNG states exist only with CUDA graphs; use_cudagraphable_rng needs a GPU")
    torch.set_rng_state(new_state)


def _install_rng_tracker() -> None:
    """The "CUDA" RNG states of megatron.core.tensor_parallel.random -> the CPU default generator.

    CudaRNGStatesTracker.add (called by model_parallel_cuda_manual_seed) reads torch.cuda.get_rng_state(),
    which raises on a CPU build; fork() (around attention dropout in every forward, and around GPU weight
    init) reads _get_cuda_rng_state, which raises too; _set_cuda_rng_state goes through torch.cuda._lazy_call
    and is silently dropped, so restoring a state (fork's exit, activation recompute) would do nothing.
    CPU ops (dropout) draw from the CPU default generator, so that is the one the tracker must switch.
    A consequence: model_parallel_cuda_manual_seed(seed) also reseeds the CPU generator, as Megatron's
    own training start-up does with torch.manual_seed just before it.
    Scoped to that module: its functions and its `torch` name; torch.cuda.manual_seed elsewhere is untouched.
    """
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = _marked(_cpu_get_rng_state)
    mrandom._set_cuda_rng_state = _marked(_cpu_set_rng_state)
    cuda = _ModuleProxy(torch.cuda, get_rng_state=lambda device="cuda": torch.get_rng_state(),
                        manual_seed=torch.manual_seed)
    mrandom.torch = _ModuleProxy(torch, cuda=cuda)


def _rng_tracker_installed() -> bool:
    import megatron.core.tensor_parallel.random as mrandom

    return _is_proxy(mrandom.torch)


# --------------------------------------------------------------------------- pipeline schedules


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A tensor factory (torch.zeros, torch.tensor) whose device="cuda" builds on the CPU instead."""

    @functools.wraps(factory)
    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return make


_cpu_zeros = _on_cpu(torch.zeros)


def _install_schedules_device() -> None:
    """torch.zeros(..., device="cuda") in megatron.core.pipeline_parallel.schedules -> cpu.

    Every forward_backward_* function (no pipelining, 1F1B, interleaved) starts with
    `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`, which raises on a CPU build
    before the first micro-batch runs. Scoped to that module's `torch` name.
    """
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = _ModuleProxy(torch, zeros=_cpu_zeros)


def _schedules_device_installed() -> bool:
    import megatron.core.pipeline_parallel.schedules as schedules

    return _is_proxy(schedules.torch)


# --------------------------------------------------------------------------- p2p synchronize


def _install_p2p_synchronize() -> None:
    """torch.cuda.synchronize() in megatron.core.pipeline_parallel.p2p_communication -> no-op.

    With batch_p2p_comm and batch_p2p_sync (both default True) every pipeline send/receive ends with
    torch.cuda.synchronize(), a guard against a CUDA-stream race of batch_isend_irecv; it raises on a
    CPU build, and gloo's requests are complete once waited on, so there is nothing to synchronise.
    Scoped to that module's `torch` name; its torch.cuda.current_device still resolves to the real
    (redirected) one at each call.
    """
    import megatron.core.pipeline_parallel.p2p_communication as p2p

    p2p.torch = _ModuleProxy(torch, cuda=_ModuleProxy(torch.cuda, synchronize=lambda device=None: None))


def _p2p_synchronize_installed() -> bool:
    import megatron.core.pipeline_parallel.p2p_communication as p2p

    return _is_proxy(p2p.torch)


# --------------------------------------------------------------------------- default causal mask


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _install_causal_mask() -> None:
    """get_default_causal_mask in megatron.core.fusions.fused_softmax -> built on cpu.

    With the local spec's causal DotProductAttention, GPTModel.forward(..., attention_mask=None) makes the
    softmax build its own upper-triangular mask with torch.ones(sq, sq, device="cuda"), which raises on a
    CPU build. With it a trainer passes attention_mask=None on CPU exactly as on GPU. Scoped to the name
    fused_softmax imported; the same boolean mask (True = masked), only on cpu.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax

    fused_softmax.get_default_causal_mask = _marked(_cpu_default_causal_mask)


def _causal_mask_installed() -> bool:
    import megatron.core.fusions.fused_softmax as fused_softmax

    return getattr(fused_softmax.get_default_causal_mask, _MARK, False)


# --------------------------------------------------------------------------- norm under sequence parallel


def _install_torch_norm_sp() -> None:
    """WrappedTorchNorm accepts sequence_parallel and tags its parameters `sequence_parallel`.

    Without Apex or Transformer Engine the local spec (and TransformerBlock's final norm) use
    WrappedTorchNorm, which asserts `not config.sequence_parallel`. A torch RMSNorm/LayerNorm is per
    token, so it is correct on a sequence shard; what SP needs is that each rank's weight grad (from its
    shard only) is summed over TP. Megatron's finalize_model_grads does that for every parameter with
    `sequence_parallel=True` when config.sequence_parallel (as Apex's FusedLayerNorm tags them), so the
    norm parameters get that attribute. The class is patched itself because spec modules and
    transformer_block bound it by name at import.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    @functools.wraps(original)
    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        # The original only reads the flag to refuse it; the config object is shared, so restore it.
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = staticmethod(_marked(new))


def _torch_norm_sp_installed() -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return getattr(WrappedTorchNorm.__new__, _MARK, False)


# --------------------------------------------------------------------------- tied embeddings under PP


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    had_own = "cuda" in torch.Tensor.__dict__
    saved = torch.Tensor.__dict__.get("cuda")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        if had_own:
            torch.Tensor.cuda = saved
        else:
            del torch.Tensor.cuda


def _install_tied_embedding_copy() -> None:
    """Tensor.cuda() -> the tensor itself, only while LanguageModule.setup_embeddings_and_output_layer runs.

    With share_embeddings_and_output_weights and PP > 1 the last stage keeps its own copy of the word
    embedding as output_layer.weight; GPTModel's constructor zeroes it and all-reduces it over the
    embedding group (first and last stage) so that both start equal, after `weight.data = weight.data.cuda()`,
    which raises on a CPU build. No other line of that method touches CUDA.
    """
    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self) -> None:
        with _tensor_cuda_is_identity():
            original(self)

    LanguageModule.setup_embeddings_and_output_layer = _marked(setup)


def _tied_embedding_copy_installed() -> bool:
    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )

    return getattr(LanguageModule.setup_embeddings_and_output_layer, _MARK, False)


# --------------------------------------------------------------------------- distributed optimizer


def _install_optimizer_device() -> None:
    """torch.tensor / torch.zeros(..., device="cuda") in megatron.core.optimizer.optimizer and .clip_grads -> cpu.

    MixedPrecisionOptimizer.__init__ (the distributed optimizer's base) allocates its found-inf flag, overflow
    buffer and unit loss scale on "cuda"; get_grad_norm_fp32 and clip_grad_by_total_norm_fp32 their overflow buffers
    and the empty rank's zero norm. Each raises on a CPU build before the first step. Scoped to those two modules'
    `torch` names.
    """
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    for module in (optimizer, clip_grads):
        module.torch = _ModuleProxy(torch, tensor=_on_cpu(torch.tensor), zeros=_on_cpu(torch.zeros))


def _optimizer_device_installed() -> bool:
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    return _is_proxy(optimizer.torch) and _is_proxy(clip_grads.torch)


def _cpu_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool, *args: Any):
    """megatron.core.utils.local_multi_tensor_l2_norm, its result left on the CPU."""
    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    return torch.norm(torch.stack(norms)).float().reshape(1), None


def _install_l2_norm_device() -> None:
    """The gradient norm's local kernel (clip_grads.l2_norm_impl) -> one that returns a CPU tensor.

    Without Apex or Transformer Engine, clip_grads uses megatron.core.utils.local_multi_tensor_l2_norm, which puts
    the norm on "cuda" (torch.tensor(..., device="cuda")): the distributed optimizer's clip raises on a CPU build.
    Replaced under the one name clip_grads bound it to, only while it is that local fallback (Apex's kernel is
    CUDA-only anyway)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _marked(_cpu_l2_norm)


def _l2_norm_device_installed() -> bool:
    import megatron.core.optimizer.clip_grads as clip_grads

    return getattr(clip_grads.l2_norm_impl, _MARK, False)


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """Tensor.type() names a CPU tensor as its CUDA twin ('torch.cuda.BFloat16Tensor' for 'torch.BFloat16Tensor')."""
    had_own = "type" in torch.Tensor.__dict__
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        if had_own:
            torch.Tensor.type = original
        else:
            del torch.Tensor.type


def _during_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return _marked(run)


def _install_cuda_type_names() -> None:
    """Tensor.type() gives CUDA names while DistributedOptimizer.__init__ and clip_grad_by_total_norm_fp32 run.

    Both sort parameters by comparing param.type() with 'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor' and
    'torch.cuda.FloatTensor': on a CPU rank every parameter matches none, so __init__ raises "Wrapped parameters must
    be one of torch.cuda.FloatTensor, ..." and the clip asserts. The class method is patched in place (get_megatron_
    optimizer builds it by class); the clip under the one name optimizer.py imported it as.
    """
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _during_cuda_type_names(DistributedOptimizer.__init__)
    optimizer.clip_grad_by_total_norm_fp32 = _during_cuda_type_names(optimizer.clip_grad_by_total_norm_fp32)


def _cuda_type_names_installed() -> bool:
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (getattr(DistributedOptimizer.__init__, _MARK, False)
            and getattr(optimizer.clip_grad_by_total_norm_fp32, _MARK, False))


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Redirect:
    name: str
    install: Callable[[], None]
    installed: Callable[[], bool]
    everywhere: bool = False  # needed with CUDA too (not a CUDA redirect)


REDIRECTS: tuple[Redirect, ...] = (
    Redirect("current_device", _install_current_device, _current_device_installed),
    Redirect("rng_tracker", _install_rng_tracker, _rng_tracker_installed),
    Redirect("schedules_device", _install_schedules_device, _schedules_device_installed),
    Redirect("p2p_synchronize", _install_p2p_synchronize, _p2p_synchronize_installed),
    Redirect("causal_mask", _install_causal_mask, _causal_mask_installed),
    Redirect("torch_norm_sp", _install_torch_norm_sp, _torch_norm_sp_installed, everywhere=True),
    Redirect("tied_embedding_copy", _install_tied_embedding_copy, _tied_embedding_copy_installed),
    Redirect("optimizer_device", _install_optimizer_device, _optimizer_device_installed),
    Redirect("l2_norm_device", _install_l2_norm_device, _l2_norm_device_installed),
    Redirect("cuda_type_names", _install_cuda_type_names, _cuda_type_names_installed),
)


def apply(*, cuda: bool) -> list[str]:
    """Install every redirect a run on CPU ranks needs (`cuda`: the run computes on GPUs, HardwareProfile.device_type;
    never whether this machine happens to have one) and that is not yet in place; return the names of those in
    effect (on GPUs only the `everywhere` ones).

    Call it before building a Megatron model or running a schedule; calling it again changes nothing.
    """
    wanted = [r for r in REDIRECTS if r.everywhere or not cuda]
    for redirect in wanted:
        if not redirect.installed():
            redirect.install()
    return [r.name for r in wanted]
