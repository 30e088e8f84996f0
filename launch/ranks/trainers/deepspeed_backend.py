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

from launch.config.resolve import Resolved
from launch.ranks.trainers import common
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
        ds_config = json.loads(json.dumps(resolved.ds_config))
        if ctx.universal:
            ds_config.setdefault("checkpoint", {})["load_universal"] = True
        model = common.build_model(resolved)
        if resolved.recipe.train.activation_checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()  # transformers builds models in eval mode, where it silently skips gradient checkpointing
        # Counting is a Python side effect inside each layer: compiled, it would break the graph.
        self.layer_calls = [] if resolved.recipe.train.compile else common.count_layer_calls(model)
        self.decoder_layers = list(model.model.layers)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
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
        self.engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"step": step}, save_latest=False)

    def load(self, ckpt: Checkpoint) -> int:
        tag = f"{ckpt.tag}_universal" if self.universal else ckpt.tag
        path, client = self.engine.load_checkpoint(str(ckpt.path), tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if path is None:
            raise ResumeError(f"{ckpt.dir}: DeepSpeed could not load this checkpoint")
        return int((client or {}).get("step", ckpt.step))

    def state_bytes(self) -> dict[str, int]:
        return common.model_state_bytes(self.engine)


def build(ctx: BuildContext) -> DeepSpeedTrainer:
    return DeepSpeedTrainer(ctx)


def export_hf_state(resolved: Resolved, ckpt: Checkpoint) -> dict:
    """ZeRO shards and AutoTP slices consolidated through DeepSpeed's universal format, which stores every
    parameter whole in fp32 (`zero/<name>/fp32.pt`); a ZeRO-0 checkpoint without TP holds the whole module."""
    import torch

    if ckpt.info["zero_stage"] == 0 and ckpt.info["tp"] == 1:
        states = torch.load(ckpt.dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        return {k: v.float() for k, v in states["module"].items()}
    universal = to_universal(ckpt)
    state = {}
    for d in sorted((universal / "zero").iterdir()):
        if d.is_dir():
            saved = torch.load(d / "fp32.pt", map_location="cpu", weights_only=True)
            # ZeRO-1/2 and AutoTP conversions store {"param": tensor}; ZeRO-3's a bare flat tensor.
            state[d.name] = (saved["param"] if isinstance(saved, dict) else saved).detach()
    return state
