"""DeepSpeed backend: ZeRO 0-3, CPU/NVMe offload and AutoTP on a Hugging Face causal LM.

One code path for CPU ranks (gloo, DS_ACCELERATOR=cpu) and GPUs (NCCL). Parallelism is applied in
a fixed order from the rank grid in resolved.json: (1) tensor parallelism — AutoTP shards the decoder
Linear layers over consecutive ranks; (2) data parallelism — ZeRO partitions optimizer state,
gradients and (stage 3) parameters over the remaining data-parallel group. Both happen inside
`deepspeed.initialize`; `build` checks the result against the grid.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from launch.config.backends import traits
from launch.config.resolve import Resolved
from launch.torchtools.hf import hf_config
from launch.config import adapters as config_adapters
from launch.ranks.trainers import adapters, common
from launch.ranks.trainers.protocol import BuildContext, StepOutput
from launch.run.checkpoints import Checkpoint, ResumeError, to_universal


def init_distributed(resolved: Resolved, cuda: bool) -> None:
    common.no_jit_comm_op()
    common.init_process_group(cuda, resolved.recipe.run.timeout_s)


class DeepSpeedTrainer:
    def __init__(self, ctx: BuildContext) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.utils import groups

        resolved, par = ctx.resolved, ctx.resolved.recipe.parallel
        self.resolved, self.cuda, self.universal = resolved, ctx.cuda, ctx.universal
        self.adapted = config_adapters.adapted(resolved.recipe.peft)
        ds_config = json.loads(json.dumps(resolved.ds_config))
        if ctx.universal:
            ds_config.setdefault("checkpoint", {})["load_universal"] = True
        # ZeRO-3 builds the model partitioned; below it every rank holds the whole model anyway (ZeRO 0-2 replicate
        # the parameters), so the plain build costs nothing extra, and AutoTP shards whole modules (measured: with a
        # partitioned build its ZeRO-3 partitions are not the planner's, which the partition test compares).
        partitioned = traits(resolved.recipe.backend).builds_partitioned(par.zero_stage, par.tp)
        # The model's module is imported first: its import is no part of the build's memory, and under zero.Init, which
        # replaces torch.Tensor.__new__, torch._dynamo's tensor polyfill imported for the first time fails ("Signature
        # mismatch between ...new_tensor and tensor_pynew").
        common.import_model_class(resolved)
        with common.model_build(ctx.run, ctx.env.rank):
            model = _partitioned_model(resolved, ds_config) if partitioned else common.build_model(resolved)
        adapters.apply(model, resolved)  # [peft] (ZeRO 0-2: the resolver refuses it with zero.Init's partitioning)
        if resolved.recipe.train.activation_checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()  # transformers builds models in eval mode, where it silently skips gradient checkpointing
        # Counting is a Python side effect inside each layer: compiled, it would break the graph.
        self.layer_calls = [] if resolved.recipe.train.compile else common.count_layer_calls(model)
        self.decoder_layers = list(model.model.layers)
        # The optimizer takes what trains: under [peft] the adapters alone, whose fp32 master copies, gradients and
        # states ZeRO 1-2 partition; the frozen base is the module's only, in the engine's dtype
        trained = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config)
        common.say_reduce_dtype(self.engine)
        if resolved.recipe.train.compile:
            self.engine.compile()  # DeepSpeed's own entry: torch.compile of the module, its ZeRO hooks kept eager
        if par.tp > 1:
            self.dp_rank, self.dp_world = groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
            self.dp_group = groups.get_data_parallel_group()
        else:
            self.dp_rank, self.dp_world, self.dp_group = dist.get_rank(), dist.get_world_size(), None
        self.param_numel_local = common.local_param_numel(self.engine.module)
        # DeepSpeed reports no gradient norm without ZeRO; compute it then (unsharded gradients).
        self._own_norm = par.zero_stage == 0 and par.tp == 1

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micro_batch: Callable) -> StepOutput:
        import torch

        engine, cuda, ga = self.engine, self.cuda, self.resolved.grad_accum
        losses = []
        own_norm = None
        for micro in range(ga):
            batch = micro_batch(micro)
            with common.region("forward", cuda):
                loss = engine(input_ids=batch, labels=batch).loss
            with common.region("backward", cuda):
                engine.backward(loss)
            if micro == ga - 1 and self._own_norm:
                own_norm = common.grad_norm(p.grad for p in engine.module.parameters())
            with common.region("optimizer", cuda):
                engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
            losses.append(loss.detach().float())
        gn = engine.get_global_grad_norm()
        return StepOutput(torch.stack(losses).mean(), own_norm if gn is None else float(gn))

    def evaluate(self, micro_batch: Callable, count: int):
        import torch

        with torch.no_grad(), common.evaluating([self.engine]):
            losses = [self.engine(input_ids=b, labels=b).loss.detach().float() for b in map(micro_batch, range(count))]
        return torch.stack(losses).mean()

    def loss(self, rows):
        # engine.module: the AutoTP-sharded model without the engine's forward (its ZeRO hooks stay out).
        return self.engine.module(input_ids=rows, labels=rows).loss

    def save(self, checkpoints: Path, tag: str, step: int) -> None:
        # [peft]: the adapters alone, as the torch backend saves them; the base is the recipe's, built at start-up
        self.engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"step": step}, save_latest=False,
                                    exclude_frozen_parameters=self.adapted)

    def load(self, ckpt: Checkpoint) -> int:
        tag = f"{ckpt.tag}_universal" if self.universal else ckpt.tag
        path, client = self.engine.load_checkpoint(str(ckpt.path), tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False, load_module_strict=not self.adapted)
        if path is None:
            raise ResumeError(f"{ckpt.dir}: DeepSpeed could not load this checkpoint")
        return int((client or {}).get("step", ckpt.step))

    def state_bytes(self) -> dict[str, int]:
        return common.model_state_bytes(self.engine)


def _partitioned_model(resolved: Resolved, ds_config: dict):
    """The model built under ZeRO-3's partitioning (DeepSpeed's zero.Init): each rank materialises only its partition
    and the module being initialised, not the whole fp32 model. Local weights load through transformers' own ZeRO-3
    path (rank 0 reads the files, each tensor is scattered as it is loaded). The seeded init must equal the plain
    build's bit for bit (the parity tests compare every layout with one rank): transformers' ZeRO-3 path skips
    torch's own parameter init and so draws other numbers, and a bare zero.Init leaves Hugging Face's init running on
    empty partitions; so, during construction, Hugging Face's init walk gathers one module at a time while it runs,
    on every rank, keeping every draw at its place in the random stream (measured on CPU ranks: identical weights,
    Llama and Qwen2, tied or not; identical ZeRO-3 losses). On GPUs zero.Init places the parameters on the device, so
    the init draws from the CUDA generator: the same distribution, not the CPU build's numbers (docs/backends.md)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, prevent_arange_dtype_change
    from transformers.modeling_utils import PreTrainedModel

    import deepspeed

    config = hf_config(resolved.model)
    attn = resolved.recipe.train.attention
    weights = resolved.recipe.model.weights
    if weights:
        keep = HfDeepSpeedConfig(ds_config)  # transformers reads ZeRO-3 from this object while it lives
        model = AutoModelForCausalLM.from_pretrained(Path(resolved.recipe_path).parent / weights, config=config,
                                                     local_files_only=True, use_safetensors=True,
                                                     trust_remote_code=False, dtype=torch.float32,
                                                     attn_implementation=attn)
        del keep  # later transformers calls in this process must not think ZeRO-3 is on
        return model
    torch.manual_seed(resolved.recipe.train.seed)
    original = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = _gathered_initialize_weights  # what every post_init calls
    try:
        # RoPE's int64 arange must not take a bf16/fp16 default dtype: entered before zero.Init, as transformers does
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    finally:
        PreTrainedModel.initialize_weights = original


def _gathered_initialize_weights(self) -> None:
    """PreTrainedModel.initialize_weights (transformers 5.24.0) for a model under construction in zero.Init: the same
    post-order walk, each module's own parameters and its direct children's gathered (modifier_rank=0) while its
    _init_weights runs; every rank runs it, so every rank's generator advances as in the plain build."""
    import torch
    from transformers import initialization as hf_init
    from transformers.modeling_utils import PreTrainedModel

    import deepspeed

    is_custom = self.is_custom_code()

    def walk(module, init):
        for child in module.children():
            walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        if getattr(module, "_is_hf_initialized", False):
            return  # an inner model's post_init did it already
        params = [*module.parameters(recurse=False), *(p for c in module.children() for p in c.parameters(recurse=False))]
        params = [p for p in {id(p): p for p in params}.values() if hasattr(p, "ds_id")]
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                init(module, is_custom)
        else:
            init(module, is_custom)

    with torch.no_grad(), hf_init.guard_torch_init_functions():
        walk(self, self._initialize_weights)


def build(ctx: BuildContext) -> DeepSpeedTrainer:
    return DeepSpeedTrainer(ctx)


def export_hf_state(resolved: Resolved, ckpt: Checkpoint) -> dict:
    """ZeRO shards and AutoTP slices consolidated through DeepSpeed's universal format, which stores every
    parameter whole in fp32 (`zero/<name>/fp32.pt`); a ZeRO-0 checkpoint without TP holds the whole module, and in
    16 bits its optimizer the fp32 copies the module's are rounded from."""
    import torch

    if config_adapters.adapted(resolved.recipe.peft):
        return _adapted_state(resolved, ckpt)
    if ckpt.info["zero_stage"] == 0 and ckpt.info["tp"] == 1:
        states = torch.load(ckpt.dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        module = states["module"]
        if resolved.recipe.precision.dtype == "fp32":
            return {k: v.float() for k, v in module.items()}
        # a tied output layer is one parameter under two names: the optimizer holds one copy, in the first's place
        first: dict[int, str] = {}
        for k, v in module.items():
            first.setdefault(v.untyped_storage().data_ptr(), k)
        fp32 = _zero0_fp32(states, ckpt, list(first.values()))
        return {k: fp32[first[v.untyped_storage().data_ptr()]] for k, v in module.items()}
    universal = to_universal(ckpt)
    return {d.name: _universal_param(d) for d in sorted((universal / "zero").iterdir()) if d.is_dir()}


def _universal_param(folder: Path):
    import torch

    saved = torch.load(folder / "fp32.pt", map_location="cpu", weights_only=True)
    # ZeRO-1/2 and AutoTP conversions store {"param": tensor}; ZeRO-3's a bare flat tensor.
    return (saved["param"] if isinstance(saved, dict) else saved).detach()


def _zero0_fp32(states: dict, ckpt: Checkpoint, names: list[str]) -> dict:
    """ZeRO-0 in 16 bits: the optimizer's fp32 copies of the module's trainable parameters `names`, which DeepSpeed's
    16-bit optimizers keep in one group in the module's order (bf16's as tensors, `fp32_groups`; fp16's fused one as
    one flat tensor, `fp32_groups_flat`), checked shape by shape against the module's 16-bit ones."""
    import math

    import torch

    module, optimizer = states["module"], states.get("optimizer") or {}
    shapes = [tuple(module[n].shape) for n in names]
    sizes = [math.prod(s) for s in shapes]
    copies = None
    if len(optimizer.get("fp32_groups") or ()) == 1:
        copies = list(optimizer["fp32_groups"][0])
    elif len(optimizer.get("fp32_groups_flat") or ()) == 1 and optimizer["fp32_groups_flat"][0].numel() == sum(sizes):
        copies = [t.view(s) for t, s in zip(torch.split(optimizer["fp32_groups_flat"][0], sizes), shapes, strict=True)]
    if copies is None or [tuple(t.shape) for t in copies] != shapes:
        raise ResumeError(f"{ckpt.dir}: the optimizer's fp32 copies do not match the {len(names)} trainable parameters "
                          "the module holds, in number or shape; export a complete checkpoint of this run")
    return {n: t.float().detach() for n, t in zip(names, copies, strict=True)}


def _adapted_state(resolved: Resolved, ckpt: Checkpoint) -> dict:
    """A fine-tune's checkpoint: its adapters under peft's names, as trained (in 16-bit runs the optimizer's fp32
    copies, from which the module's 16-bit ones are rounded, as the torch backend exports its fp32 adapters), and the
    base they trained on as the run held it."""
    import torch

    states = torch.load(ckpt.dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    module = {k: v for k, v in states["module"].items() if ".lora_" in k}  # the trainable ones alone are saved
    if resolved.recipe.precision.dtype == "fp32":
        out = {k: v.float() for k, v in module.items()}
    elif ckpt.info["zero_stage"] == 0:
        out = _zero0_fp32(states, ckpt, list(module))
    else:
        universal = to_universal(ckpt)
        out = {name: _universal_param(universal / "zero" / name) for name in module}
    out.update(adapters.base_as_trained(resolved))  # held in precision.dtype by adapters.apply, as on torch
    return out