"""The backends layoutlab trains with, and what each one implies for planning and resolution. No torch import.

One home per backend fact: the resolver asks which layouts a backend can build, the planner which
parameters its tensor parallelism splits, which memory accounting it follows and which collectives
it issues, the CLI whether it has a trainer, and `launch.ranks.train` which module runs it on the ranks.
A backend missing here is an error everywhere, never silently another backend's behaviour.

The rank-side half of a backend is a module under `launch/ranks/trainers/` implementing the protocol in
`launch/ranks/trainers/protocol.py`; only the rank entry point (`launch.ranks.train`) and `launch.commands.export` import it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Literal, Mapping

from launch.errors import ConfigError


@dataclass(frozen=True)
class TpCollectives:
    """Tensor-parallel collectives of one micro-batch, by collective name, measured from profiler traces
    (tests/dist/test_megatron_collectives.py, and the AutoTP count in test_deepspeed_run.py)."""

    layer_forward: Mapping[str, int]  # per decoder layer, one forward pass (a full recompute runs it again)
    layer_backward: Mapping[str, int]  # per decoder layer, its backward
    embedding: Mapping[str, int]  # activation-sized, at the embedding (first pipeline stage)
    output: Mapping[str, int]  # activation-sized, at the output layer (last pipeline stage)
    loss_all_reduces: int = 0  # one fp32 value per token: a vocab-parallel cross entropy (last stage)
    logits_all_gathers: int = 0  # the full-vocabulary logits (AutoTP's lm_head)
    # per norm (two per decoder layer, the final norm on the last stage): its weight's gradient, summed over TP in
    # the backward (DTensor's SequenceParallel norms; Megatron sums them once per step: StepCollectives.sp_norm_grads)
    norm_grad_all_reduces: int = 0
    # per decoder layer, what its recompute runs again (None: all of layer_forward). torch.utils.checkpoint's
    # non-reentrant recompute stops once it has every tensor the backward needs: the block's last row-parallel output
    # collective (down_proj's) feeds none of them, so it is not rerun.
    recompute_forward: Mapping[str, int] | None = None


@dataclass(frozen=True)
class StepCollectives:
    """What the backend itself issues once per optimizer step, after the micro-batches, beyond DeepSpeed's data-parallel
    traffic (measured from profiler traces: tests/dist/test_megatron_collectives.py)."""

    sp_norm_grads: bool = False  # SP: the norm weights' gradients summed over TP, one coalesced all-reduce
    clip_zero_stages: tuple[int, ...] = ()  # where the backend clips itself: one fp64 all-reduce over TP × PP
    pp_loss_broadcast: bool = False  # PP: the last stage broadcasts the logged loss to the pipeline group


@dataclass(frozen=True)
class BackendTraits:
    name: str
    trainer: str  # module implementing launch/ranks/trainers/protocol.py
    accounting: str  # the planner's model-state accounting the fit check uses
    vocab_parallel: bool  # TP splits the embedding and the output layer over the vocabulary
    hf_modules: bool  # trains Hugging Face modules: unfused RMSNorm (fp32 saves)
    # Who holds the whole fp32 model on the host at start-up: "sharded" (nobody: every rank reads or seeds the weights
    # one tensor at a time and keeps its own shards) or "zero3" (DeepSpeed: every rank, except at ZeRO-3 without AutoTP,
    # where zero.Init builds each rank's partition; AutoTP shards whole modules, so it needs them built whole).
    host_build: Literal["sharded", "zero3"]
    autotp: bool  # DeepSpeed applies tensor parallelism itself (AutoTP) rather than the model's own layers
    offload: bool  # ZeRO's CPU/NVMe offload of optimizer state and parameters
    offload_optimizer_alone: bool  # the optimizer state offloads without the parameters (FSDP2 moves all together)
    zero_stages: tuple[int, ...]  # the parallel.zero_stage values it builds
    dtypes: tuple[str, ...]  # precision.dtype values the backend trains correctly
    tp: TpCollectives
    tp_sp: TpCollectives | None  # with sequence parallelism (None: the backend has none)
    step: StepCollectives
    # of "pp", "sp", "vpp", "selective", "hpz" (ZeRO++ hierarchical partitioning), "compile", "async_checkpoint"
    features: frozenset[str]
    # What train.activation_checkpointing="selective" recomputes: "core_attention" (Megatron: the attention
    # scores, dropped from the saved activations) or "op" (torchtitan's op policy: every block keeps its matmuls'
    # outputs but every second one, attention's and the reductions'; the rest is recomputed). The torch backend's
    # "every_other_block" is torchtitan's layer policy with n = SELECTIVE_EVERY (feature "every_other_block").
    selective: str
    pp_zero_stages: tuple[int, ...]  # ZeRO stages that combine with pipeline parallelism
    sp_zero_stages: tuple[int, ...]  # ZeRO stages that combine with sequence parallelism
    tp_zero_stages: tuple[int, ...]  # ZeRO stages that combine with tensor parallelism
    pp_tied_embeddings: bool  # pipeline parallelism for a model whose output layer shares the embedding
    reshard_on_resume: bool  # a checkpoint resumes onto another tp/dp degree (DeepSpeed's universal format, or DCP)
    checkpoint_format: str  # "deepspeed" (the engine's files) or "dcp" (torch.distributed.checkpoint)
    requires: tuple[str, ...]  # packages the trainer imports, checked before launch without importing them
    # The DeepSpeed config fields this backend decides beyond the recipe's: (owned, recipe) -> owned, where
    # owned maps a dotted DeepSpeed key to (value, the recipe field it comes from). None: no DeepSpeed at all.
    compose_ds_config: Callable[[dict[str, tuple[Any, str]], Any], dict[str, tuple[Any, str]]] | None
    # Environment its ranks need on GPUs for this recipe's layout (a value the user's environment sets is kept).
    gpu_env: Callable[[Any], Mapping[str, str]] = lambda recipe: {}
    # Why a feature it lacks is not built (feature -> reason), said in the refusal.
    why_not: Mapping[str, str] = field(default_factory=dict)
    # ZeRO stages at which it reduces the data-parallel gradients only after the whole backward (nothing to hide behind)
    reduces_after_backward: tuple[int, ...] = ()
    # ZeRO stages built with the framework's own distributed optimizer instead of a DeepSpeed engine (megatron: 1,
    # Megatron-Core's DistributedOptimizer); the plan accounts them by the framework's accounting ("megatron")
    distributed_optimizer_stages: tuple[int, ...] = ()
    # [peft] methods it trains, by method: the ZeRO stages at which it does (a method absent, or a stage missing:
    # refused, with why_not[method])
    peft_zero_stages: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # The backend's own refusals, after the resolver's shared checks: (where, recipe, model, grad_accum) raises
    # ConfigError, where(dotted) naming the file that set a field.
    check: Callable[[Callable[[str], str], Any, Any, int], None] | None = None

    def builds_partitioned(self, zero_stage: int, tp: int) -> bool:
        """Each rank builds only its part, one module or tensor whole at a time, never the whole model: a sharded
        start-up, or DeepSpeed's zero.Init at ZeRO-3."""
        return self.host_build == "sharded" or (self.host_build == "zero3" and zero_stage == 3 and tp == 1)

    def distributed_optimizer(self, zero_stage: int) -> bool:
        """Trains at this ZeRO stage through the framework's own distributed optimizer (megatron at ZeRO-1)."""
        return zero_stage in self.distributed_optimizer_stages

    def uses_deepspeed(self, zero_stage: int) -> bool:
        """Trains through a DeepSpeed engine at this ZeRO stage (the deepspeed backend; megatron except at its
        distributed optimizer's stage), whose config the resolver composes."""
        return self.compose_ds_config is not None and not self.distributed_optimizer(zero_stage)

    def accounting_at(self, zero_stage: int) -> str:
        """The model-state accounting the fit check uses at this ZeRO stage."""
        return "megatron" if self.distributed_optimizer(zero_stage) else self.accounting

    def missing_packages(self) -> list[str]:
        import importlib.util

        return [name for name in self.requires if importlib.util.find_spec(name) is None]

    def rank_module(self) -> ModuleType:
        """The rank-side implementation: import only on a rank (launch.ranks.train) or to export."""
        return importlib.import_module(self.trainer)


SELECTIVE_EVERY = 2  # torch backend, every_other_block: every second decoder block recomputes (torchtitan's default n)


def _deepspeed_check(w: Callable[[str], str], recipe, model, grad_accum: int) -> None:
    if recipe.train.compile and recipe.parallel.zero_stage == 3:
        # Measured on DeepSpeed 0.19.8 (tiny-llama, 2 gloo ranks): the ZeRO-3 hooks read each submodule's ds_id inside
        # the compiled region, so dynamo recompiles per submodule, hits its recompile limit and falls back to eager:
        # 719 ms a step against 26 ms for the compiled ZeRO-2 step.
        raise ConfigError(w("train.compile"), "train.compile", True,
                          'recompiles per submodule under ZeRO-3 on backend "deepspeed" (its hooks specialise the graph)',
                          'set train.compile=false, parallel.zero_stage <= 2, or backend = "torch" (FSDP2 compiles '
                          "each block)")


def _torch_check(w: Callable[[str], str], recipe, model, grad_accum: int) -> None:
    """What DDP, FSDP2 and the pipeline schedules cannot build here, each refused with the nearest layout that they
    can."""
    par = recipe.parallel
    if par.tp > 1 and model.vocab_size % par.tp:
        # the output layer's logits are split evenly over TP (DTensor shards of equal size)
        raise ConfigError(w("parallel.tp"), "parallel.tp", par.tp,
                          f"does not divide the vocabulary of {model.name} ({model.vocab_size}) on backend \"torch\"",
                          "choose tp dividing the vocabulary size")
    if par.pp > 1 and grad_accum < par.pp:
        # torch.distributed.pipelining's 1F1B schedules need a micro-batch in flight on every stage
        raise ConfigError(w("batch.global_batch_size"), "batch.global_batch_size", recipe.batch.global_batch_size,
                          f"gives {grad_accum} micro-batch(es) per step, fewer than parallel.pp={par.pp} pipeline "
                          "stages on backend \"torch\"",
                          f"set batch.global_batch_size to at least {par.pp} × micro_batch_size × dp, or a smaller "
                          "batch.micro_batch_size")
    if par.pp > 1 and recipe.precision.dtype == "fp16":
        # the schedule computes the loss inside its steps, where the gradient scaler never scales it
        raise ConfigError(w("precision.dtype"), "precision.dtype", "fp16",
                          'with a pipeline has no loss-scaling path on backend "torch"',
                          'set precision.dtype="bf16", or parallel.pp=1 (FSDP2 and TP scale fp16 losses)')
    if par.zero_stage not in BACKENDS["torch"].zero_stages:
        raise ConfigError(w("parallel.zero_stage"), "parallel.zero_stage", par.zero_stage,
                          'has no torch equivalent (FSDP2 shards gradients with the optimizer state) on backend "torch"',
                          "set parallel.zero_stage=2 (FSDP2, parameters kept gathered), 0 (DDP) or 3 (full sharding)")
    if par.offload_optimizer != par.offload_params and not BACKENDS["torch"].offload_optimizer_alone:
        # CPUOffloadPolicy moves parameters, gradients and the optimizer step to the host together.
        raise ConfigError(w("parallel.offload_optimizer"), "parallel.offload_optimizer", par.offload_optimizer,
                          f'differs from parallel.offload_params="{par.offload_params}"; FSDP2 offloads parameters, '
                          "gradients and the optimizer step together",
                          'set both to "cpu" with parallel.zero_stage=3, or both to "none"')
    if par.offload_params == "nvme":
        raise ConfigError(w("parallel.offload_params"), "parallel.offload_params", "nvme",
                          'is not offered by FSDP2 (backend "torch" offloads to host memory only)',
                          'set parallel.offload_params="cpu" and parallel.offload_optimizer="cpu", or backend = "deepspeed"')
    if recipe.deepspeed.config is not None:
        raise ConfigError(w("deepspeed.config"), "deepspeed.config", recipe.deepspeed.config,
                          'is not used by backend "torch" (no DeepSpeed engine)',
                          'remove deepspeed.config, or set backend = "deepspeed"')


def _megatron_check(w: Callable[[str], str], recipe, model, grad_accum: int) -> None:
    if BACKENDS["megatron"].distributed_optimizer(recipe.parallel.zero_stage) and recipe.deepspeed.config:
        raise ConfigError(w("deepspeed.config"), "deepspeed.config", recipe.deepspeed.config,
                          f"is not used at parallel.zero_stage={recipe.parallel.zero_stage} on backend \"megatron\" "
                          "(Megatron-Core's distributed optimizer, no DeepSpeed engine)",
                          "remove deepspeed.config, or set parallel.zero_stage to 0, 2 or 3 (DeepSpeed's ZeRO)")


def one_device_connection(recipe) -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 on the megatron backend, as Megatron-LM's argument checks decide it (arguments.py,
    NVIDIA/Megatron-LM d98e8a6): tensor parallelism needs it before Blackwell (one hardware queue, so each TP/SP
    collective is issued ahead of the GEMMs that wait for it and the backward's input-gradient all-reduce overlaps the
    weight-gradient GEMM), and sharded parameters forbid it ("FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value
    large than one": each gather prefetched on its own stream must not queue behind the compute issued before it).
    Here the parameters are sharded at ZeRO-3 (DeepSpeed's), where Megatron-LM, given TP and FSDP together, warns and
    leaves the variable unset; so does this. Every shipped GPU profile is before Blackwell."""
    par = recipe.parallel
    return par.tp > 1 and par.zero_stage < 3


def _megatron_gpu_env(recipe) -> Mapping[str, str]:
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if one_device_connection(recipe) else {}


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
    if recipe.parallel.zero_stage == 0:
        # Megatron's schedule runs every micro-batch of the step, then the engine reduces and steps once
        # (launch/ranks/trainers/megatron_backend.py): DeepSpeed sees one batch per step.
        micro, ga = owned["train_micro_batch_size_per_gpu"][0], owned["gradient_accumulation_steps"][0]
        why = "parallel.zero_stage (0: the megatron backend's schedule accumulates)"
        out["train_micro_batch_size_per_gpu"] = (micro * ga, why)
        out["gradient_accumulation_steps"] = (1, why)
        # Without ZeRO, DeepSpeed's clipping counts a replicated parameter only on model-parallel rank 0,
        # which drops the norms of later pipeline stages; the backend clips over TP × PP itself.
        out["gradient_clipping"] = (0.0, "parallel.zero_stage (0: the megatron backend clips train.grad_clip itself)")
    return out


BACKENDS: dict[str, BackendTraits] = {
    "deepspeed": BackendTraits(
        name="deepspeed", trainer="launch.ranks.trainers.deepspeed_backend", accounting="deepspeed",
        # AutoTP (DeepSpeed 0.19.8 module_inject/layers.py): the row-parallel o_proj and down_proj all-reduce
        # their output in forward; the five column-parallel q, k, v, gate, up all-reduce their input gradient in
        # backward; lm_head is column-parallel (its input gradient all-reduced) and gathers the logits.
        vocab_parallel=False, hf_modules=True, host_build="zero3", autotp=True, offload=True, offload_optimizer_alone=True,
        zero_stages=(0, 1, 2, 3), dtypes=("bf16", "fp16", "fp32"),
        tp=TpCollectives({"all_reduce": 2}, {"all_reduce": 5}, {}, {"all_reduce": 1}, logits_all_gathers=1), tp_sp=None,
        step=StepCollectives(),  # DeepSpeed clips and reduces; its gradient norm is the planner's data-parallel call
        # "compile": DeepSpeed's engine.compile() (torch.compile of the module, its hooks eager): ZeRO 0-2, AutoTP
        features=frozenset({"hpz", "compile"}), selective="",
        why_not={"async_checkpoint": "DeepSpeed 0.19.8's only asynchronous writer (checkpoint.writer.decoupled) runs its "
                                     "FastCheckpointEngine on DeepNVMe's async_io op, a JIT build needing libaio, not "
                                     "built or tested here",
                 "lora": "its ZeRO-3 gathers parameters through hooks zero.Init installs on the modules it builds, "
                         "and peft adds the adapters after it: not built or tested here",
                 "qlora": "QLoRA's 4-bit weights are bitsandbytes tensors (packed bytes, their scales beside) that "
                          "DeepSpeed's ZeRO does not partition"},
        # LoRA: the engine's optimizer takes the adapters alone; ZeRO 1 and 2 partition their states and gradients
        peft_zero_stages={"lora": (0, 1, 2)},
        pp_zero_stages=(), sp_zero_stages=(), tp_zero_stages=(0, 1, 2, 3),
        pp_tied_embeddings=False, reshard_on_resume=True, checkpoint_format="deepspeed",
        requires=("deepspeed", "transformers"), compose_ds_config=_deepspeed_owned, check=_deepspeed_check),
    "megatron": BackendTraits(
        name="megatron", trainer="launch.ranks.trainers.megatron_backend",
        # Megatron-Core's layers, with DeepSpeed's ZeRO over the data-parallel group (accounted as DeepSpeed's) but at
        # ZeRO-1: Megatron-Core's DDP and distributed optimizer, as NeMo and Megatron-LM train (distributed_optimizer_stages).
        accounting="deepspeed", distributed_optimizer_stages=(1,),
        # Megatron-Core TP: row-parallel linear_proj and linear_fc2 all-reduce in forward, column-parallel
        # linear_qkv and linear_fc1 their input gradient in backward; per micro-batch the vocab-parallel embedding
        # all-reduces its output, the output layer its input gradient, and the vocab-parallel cross entropy
        # reduces the max, the target logit and the sum of exponentials (3). With SP each all-reduce becomes
        # a reduce-scatter (row-parallel forward, column-parallel input gradient) or an all-gather (column-parallel
        # forward, row-parallel output gradient), and the column-parallel backward gathers its input again for
        # the weight gradient: per layer 2 + 4 all-gathers and 2 + 2 reduce-scatters.
        vocab_parallel=True, hf_modules=False, host_build="sharded", autotp=False,
        # Offload is untested with Megatron's layers; fp16 needs the loss scale applied inside Megatron's schedule
        # (its grad_scale_func), which is not wired to DeepSpeed's scaler yet.
        offload=False, offload_optimizer_alone=False, zero_stages=(0, 1, 2, 3), dtypes=("bf16", "fp32"),
        tp=TpCollectives({"all_reduce": 2}, {"all_reduce": 2}, {"all_reduce": 1}, {"all_reduce": 1}, loss_all_reduces=3),
        # SP: the embedding reduce-scatters its output (all-gather in backward); the output layer gathers its
        # input, gathers it again for the weight gradient and reduce-scatters the input gradient.
        tp_sp=TpCollectives({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 4, "reduce_scatter": 2},
                            {"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 2, "reduce_scatter": 1},
                            loss_all_reduces=3),
        # launch/ranks/trainers/megatron_backend.py _schedule_step: the SP norm-gradient sum, its own clipping at ZeRO-0
        # (DeepSpeed's drops later pipeline stages' norms there), the loss broadcast from the last stage.
        step=StepCollectives(sp_norm_grads=True, clip_zero_stages=(0,), pp_loss_broadcast=True),
        features=frozenset({"pp", "sp", "vpp", "selective"}), selective="core_attention",
        # DeepSpeed partitions gradients (ZeRO-2) and parameters (ZeRO-3) in hooks inside its own backward,
        # which Megatron's pipeline schedules bypass; DeepSpeed's own pipeline engine has the same limit.
        pp_zero_stages=(0, 1),
        # Sequence-parallel norm gradients are summed over the TP group after the backward (by the backend at ZeRO-0,
        # by finalize_model_grads at ZeRO-1); under ZeRO-2/3 DeepSpeed partitions them inside the backward, before that
        # can happen.
        sp_zero_stages=(0, 1), tp_zero_stages=(0, 1, 2, 3),
        # The last stage's copy of a tied embedding needs its gradient summed with the first stage's and kept
        # out of the gradient norm once; not built yet.
        pp_tied_embeddings=False,
        # Megatron's fused QKV and [gate; up] shards do not reshard by DeepSpeed's universal format.
        reshard_on_resume=False, checkpoint_format="deepspeed", requires=("megatron.core", "deepspeed", "transformers"),
        # One hardware queue per GPU with TP, none with ZeRO-3's sharded parameters (one_device_connection).
        gpu_env=_megatron_gpu_env,
        why_not={"compile": "Megatron-Core 0.16.1 does not torch.compile GPTModel (Megatron-LM trains it eager; its "
                            "speed comes from fused kernels, Transformer Engine's on GPUs)",
                 "async_checkpoint": "its checkpoints are per-rank torch.save files in DeepSpeed's layout; Megatron-Core's "
                                     "asynchronous save belongs to its dist_checkpointing format, which this backend "
                                     "does not write",
                 **dict.fromkeys(("lora", "qlora"),
                                 "Megatron-Core 0.16.1 has no adapter modules (Megatron-Bridge's LoRA is a separate "
                                 "package, for Megatron-Core 0.17+, which needs Python 3.12)")},
        # ZeRO-0: its schedule runs every micro-batch, then engine.allreduce_gradients (megatron_backend._step_engine);
        # ZeRO-1 reduce-scatters each bucket as the last micro-batch's backward finishes it (overlap_grad_reduce)
        reduces_after_backward=(0,),
        compose_ds_config=_megatron_owned, check=_megatron_check),
    "torch": BackendTraits(
        name="torch", trainer="launch.ranks.trainers.torch_backend", accounting="torch",
        # torchtitan's plan (launch/ranks/trainers/torch_backend.py _apply_tp): the embedding is row-parallel over the
        # vocabulary, every Linear column- or row-parallel, lm_head column-parallel with its logits left split and
        # the loss computed in loss_parallel. Counts per micro-batch measured from profiler traces
        # (tests/dist/test_torch_collectives.py).
        vocab_parallel=True, hf_modules=True, host_build="sharded", autotp=False, offload=True, offload_optimizer_alone=False,
        # 0 DDP, 2 FSDP2 keeping parameters gathered from forward to backward, 3 full sharding. FSDP2 has no stage
        # that shards the optimizer state alone (ZeRO-1).
        zero_stages=(0, 2, 3), dtypes=("bf16", "fp16", "fp32"),
        tp=TpCollectives({"all_reduce": 2}, {"all_reduce": 5}, {"all_reduce": 1}, {"all_reduce": 1}, loss_all_reduces=3,
                         recompute_forward={"all_reduce": 1}),
        # With SP the row-parallel outputs reduce-scatter and the column-parallel inputs all-gather, each mirrored in
        # the backward; the embedding reduce-scatters its output, lm_head gathers its input.
        tp_sp=TpCollectives({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2, "reduce_scatter": 2},
                            {"reduce_scatter": 1, "all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1},
                            loss_all_reduces=3, norm_grad_all_reduces=1,
                            recompute_forward={"all_gather": 2, "reduce_scatter": 1}),
        # The gradient norm is reduced per mesh (launch/plan/collectives.py _torch_norm_calls).
        # With pipelining the last stage broadcasts the logged loss to its pipeline group.
        step=StepCollectives(pp_loss_broadcast=True),
        # "hpz": parallel.zero_hpz_partition_size is FSDP2's hybrid sharding here (shard within the group, replicate
        # across groups), not ZeRO++'s secondary partition.
        features=frozenset({"pp", "vpp", "sp", "selective", "every_other_block", "compile", "hpz", "async_checkpoint"}),
        selective="op",
        # torch.distributed.pipelining drives FSDP2 chunks (its stages reduce at the last micro-batch); DDP under a
        # pipeline would need autocast around the schedule's forwards alone: not built. Tied embeddings with PP: the
        # two copies of the matrix would live on different stages (pp_tied_embeddings).
        pp_zero_stages=(2, 3), sp_zero_stages=(2, 3),
        tp_zero_stages=(2, 3),  # torch DDP takes no DTensor parameters: TP composes with FSDP2 only
        pp_tied_embeddings=False,
        # LoRA under DDP and FSDP2 (torchtune's: the frozen base and the adapters sharded in the same units); QLoRA under
        # DDP alone
        peft_zero_stages={"lora": (0, 2, 3), "qlora": (0,)},
        why_not={"qlora": "bitsandbytes' 4-bit weights are packed bytes with their scales beside (its quant_state), "
                          "which FSDP2 cannot shard (torchtune shards torchao's NF4Tensor instead)"},
        reshard_on_resume=True, checkpoint_format="dcp", requires=("transformers",),
        compose_ds_config=None, check=_torch_check),
}


def traits(name: str, *, where: str = "resolved.json") -> BackendTraits:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(where, "backend", name, "is not a backend layoutlab knows",
                          f"set backend to one of {', '.join(sorted(BACKENDS))}") from None
