"""The backends layoutlab trains with, and what each one implies for planning and resolution. No torch import.

One home per backend fact: the resolver asks which layouts a backend can build, the planner which
parameters its tensor parallelism splits, which memory accounting it follows and which collectives
it issues, the CLI whether it has a trainer, and `launch.train` which module runs it on the ranks.
A backend missing here is an error everywhere, never silently another backend's behaviour.

The rank-side half of a backend is a module under `launch/trainers/` implementing the protocol in
`launch/trainers/protocol.py`; only the rank entry point (`launch.train`) and `launch.export` import it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from launch.errors import ConfigError


@dataclass(frozen=True)
class TpCollectives:
    """Tensor-parallel collectives of one micro-batch (without sequence parallelism), by where they happen."""

    forward_per_layer: int  # all-reduces in one forward pass of a decoder layer
    backward_per_layer: int  # all-reduces in its backward
    head_all_reduces: int  # activation-sized, per micro-batch, around the embedding and the output layer
    loss_all_reduces: int  # one fp32 value per token, per micro-batch: a vocab-parallel cross entropy
    logits_all_gathers: int  # per micro-batch: AutoTP gathers the full-vocabulary logits


@dataclass(frozen=True)
class BackendTraits:
    name: str
    trainer: str  # module implementing launch/trainers/protocol.py
    accounting: str  # the planner's model-state accounting the fit check uses
    vocab_parallel: bool  # TP splits the embedding and the output layer over the vocabulary
    hf_modules: bool  # trains Hugging Face modules: unfused RMSNorm (fp32 saves), eager attention on CPU ranks
    autotp: bool  # DeepSpeed applies tensor parallelism itself (AutoTP) rather than the model's own layers
    tp: TpCollectives
    features: frozenset[str]  # of "pp", "sp", "vpp", "selective"
    pp_zero_stages: tuple[int, ...]  # ZeRO stages that combine with pipeline parallelism
    sp_zero_stages: tuple[int, ...]  # ZeRO stages that combine with sequence parallelism
    reshard_on_resume: bool  # a checkpoint resumes onto another tp/dp degree (DeepSpeed's universal format)
    requires: tuple[str, ...]  # packages the trainer imports, checked before launch without importing them
    # The DeepSpeed config fields this backend decides beyond the recipe's: (owned, recipe) -> owned, where
    # owned maps a dotted DeepSpeed key to (value, the recipe field it comes from).
    compose_ds_config: Callable[[dict[str, tuple[Any, str]], Any], dict[str, tuple[Any, str]]]

    def missing_packages(self) -> list[str]:
        import importlib.util

        return [name for name in self.requires if importlib.util.find_spec(name) is None]

    def rank_module(self) -> ModuleType:
        """The rank-side implementation: import only on a rank (launch.train) or to export."""
        return importlib.import_module(self.trainer)


def _deepspeed_owned(owned: dict[str, tuple[Any, str]], recipe) -> dict[str, tuple[Any, str]]:
    out = dict(owned)
    if recipe.parallel.tp > 1:
        out["tensor_parallel.autotp_size"] = (recipe.parallel.tp, "parallel.tp")
        # DeepSpeed 0.19.8 checks train_batch_size against micro × accumulation × *all* ranks before
        # AutoTP forms its groups (runtime/config.py _batch_assertion), which is wrong by a factor tp;
        # left out, it is derived from the two other batch fields and the data-parallel size is ours.
        del out["train_batch_size"]
    return out


def _megatron_owned(owned: dict[str, tuple[Any, str]], recipe) -> dict[str, tuple[Any, str]]:
    out = dict(owned)
    if recipe.parallel.pp > 1:
        # Megatron's pipeline schedule runs every micro-batch of the step; DeepSpeed sees one batch per step.
        micro, ga = owned["train_micro_batch_size_per_gpu"][0], owned["gradient_accumulation_steps"][0]
        out["train_micro_batch_size_per_gpu"] = (micro * ga, "batch.micro_batch_size × gradient accumulation")
        out["gradient_accumulation_steps"] = (1, "parallel.pp > 1: the pipeline schedule accumulates")
    if recipe.parallel.zero_stage == 0:
        # Without ZeRO, DeepSpeed's clipping counts a replicated parameter only on model-parallel rank 0,
        # which drops the norms of later pipeline stages; the backend clips over TP × PP itself.
        out["gradient_clipping"] = (0.0, "train.grad_clip (applied by the megatron backend)")
    return out


BACKENDS: dict[str, BackendTraits] = {
    "deepspeed": BackendTraits(
        name="deepspeed", trainer="launch.trainers.deepspeed_backend", accounting="deepspeed",
        # AutoTP (DeepSpeed 0.19.8 module_inject/layers.py): the row-parallel o_proj and down_proj all-reduce
        # their output in forward; the five column-parallel q, k, v, gate, up all-reduce their input gradient in
        # backward; lm_head is column-parallel (its input gradient all-reduced) and gathers the logits.
        vocab_parallel=False, hf_modules=True, autotp=True, tp=TpCollectives(2, 5, 1, 0, 1),
        features=frozenset(), pp_zero_stages=(), sp_zero_stages=(), reshard_on_resume=True,
        requires=("deepspeed", "transformers"), compose_ds_config=_deepspeed_owned),
    "megatron": BackendTraits(
        name="megatron", trainer="launch.trainers.megatron_backend",
        # Megatron-Core's layers, with DeepSpeed's ZeRO over the data-parallel group: its accounting is DeepSpeed's.
        accounting="deepspeed",
        # Megatron-Core TP: row-parallel linear_proj and linear_fc2 all-reduce in forward, column-parallel
        # linear_qkv and linear_fc1 their input gradient in backward; per micro-batch the vocab-parallel embedding
        # all-reduces its output, the output layer its input gradient, and the vocab-parallel cross entropy
        # reduces the max, the target logit and the sum of exponentials (3).
        vocab_parallel=True, hf_modules=False, autotp=False, tp=TpCollectives(2, 2, 2, 3, 0),
        features=frozenset({"pp", "sp", "vpp", "selective"}),
        # DeepSpeed partitions gradients (ZeRO-2) and parameters (ZeRO-3) in hooks inside its own backward,
        # which Megatron's pipeline schedules bypass; DeepSpeed's own pipeline engine has the same limit.
        pp_zero_stages=(0, 1),
        # Sequence-parallel norm gradients are summed over the TP group before DeepSpeed reduces them; under
        # ZeRO-2/3 DeepSpeed partitions them inside the backward, before that can happen.
        sp_zero_stages=(0, 1),
        # Megatron's fused QKV and [gate; up] shards do not reshard by DeepSpeed's universal format.
        reshard_on_resume=False, requires=("megatron.core", "deepspeed", "transformers"),
        compose_ds_config=_megatron_owned),
}


def traits(name: str, *, where: str = "resolved.json") -> BackendTraits:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(where, "backend", name, "is not a backend layoutlab knows",
                          f"set backend to one of {', '.join(sorted(BACKENDS))}") from None
