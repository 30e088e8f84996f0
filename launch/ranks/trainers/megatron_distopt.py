"""The megatron backend's ZeRO-1: Megatron-Core's own DistributedDataParallel and DistributedOptimizer, as NeMo and
Megatron-LM run them (not DeepSpeed's ZeRO-1, whose accounting and traffic differ).

What it is (Megatron-Core 0.16.1, megatron/core/distributed and megatron/core/optimizer/distrib_optimizer.py):
  * each model chunk is wrapped in Megatron's DDP, which moves every gradient into one contiguous buffer per dtype
    (`main_grad`), in fp32 or in the model's bf16 (`precision.grad_reduce_dtype`: DDPConfig.grad_reduce_in_fp32);
  * the gradient buffer is reduce-scattered over the data-parallel group, bucket by bucket as the backward finishes
    them (overlap_grad_reduce; the schedule's no_sync keeps the earlier micro-batches local);
  * each rank keeps fp32 main parameters and Adam's moments for its 1/dp of the buffer only and steps them;
  * the updated 16-bit parameters are all-gathered back, bucket by bucket ahead of the next forward's use
    (overlap_param_gather).
The schedule's finalize_model_grads ends every backward: the data-parallel reduction, then the sequence-parallel norm
gradients summed over TP.

Checkpoints keep the DeepSpeed route's file name for the model, so that export and the shape check read it alike: per
model-parallel rank the model's chunks (`mp_rank_XX_model_states.pt`: "module", as DeepSpeed saves it, written by
data-parallel rank 0), and per rank its own shard of the optimizer (`distopt_dp_rank_D_mp_rank_XX_states.pt`: the
torch optimizer's state dict and its fp32 main parameters). Nothing is gathered: Megatron's save_parameter_state would
collect every shard's fp32 parameters and moments on data-parallel rank 0 (26 GB a process for the 70B recipe).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from launch.config.resolve import Resolved
from launch.config.schema import ADAM_EPS
from launch.plan.layout import Layout
from launch.ranks.trainers import common

def model_states_name(mp_rank: int) -> str:
    """One model-parallel rank's module state below ZeRO-3, DeepSpeed's name for it (both data-parallel routes)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_shard_name(mp_rank: int, dp_rank: int) -> str:
    return f"distopt_dp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_states.pt"


@dataclass
class DistOpt:
    """A rank's model chunks under Megatron's DDP, and the distributed optimizer over them."""

    chunks: list  # DDP-wrapped, in virtual-stage order (what the schedule runs and finalize_model_grads reduces)
    optimizer: object  # what get_megatron_optimizer returns: a ChainedOptimizer of DistributedOptimizers

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _torch_optimizers(self) -> list:
        """The torch AdamW of each chained DistributedOptimizer: it steps this rank's shard of the main parameters."""
        return [chained.optimizer for chained in self.optimizer.chained_optimizers]

    def step(self) -> float | None:
        """The optimizer step on reduced gradients (the schedule's finalize_model_grads reduced them); returns the
        pre-clipping gradient norm over every rank (ChainedOptimizer computes it whether or not it clips)."""
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # only a dynamic loss scale skips a step, and this route trains bf16 or fp32
            raise RuntimeError("Megatron's optimizer skipped a step that no loss scaler asked to skip")
        return None if grad_norm is None else float(grad_norm)

    def sync_params(self) -> None:
        """Finish the all-gather of the updated parameters now (overlap_param_gather leaves it to the next forward),
        before the parameters are read outside a forward: a checkpoint."""
        for chunk in self.chunks:
            chunk.start_param_sync(force_sync=True)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state between steps, in the planner's categories ("megatron" accounting): the 16-bit (or
        fp32) parameters (views of DDP's parameter buffer under the distributed optimizer), DDP's gradient buffer,
        and the optimizer's fp32 main-parameter shards with Adam's moments."""
        seen: set[int] = set()
        params = [p for chunk in self.chunks for p in chunk.module.parameters()]
        weights = common.storage_bytes([p.data for p in params], seen)
        grads = common.storage_bytes([getattr(p, "main_grad", None) for p in params], seen)
        inner = self._torch_optimizers()
        masters = [p for t in inner for g in t.param_groups for p in g["params"]]
        optimizer = common.storage_bytes(masters + [v for t in inner for st in t.state.values() for v in st.values()
                                                    if torch.is_tensor(v)], seen)
        return {"weights": weights, "grads": grads, "optimizer": optimizer}

    def save(self, folder: Path, mp_rank: int, dp_rank: int) -> None:
        """This rank's optimizer shard: each torch optimizer's state dict (groups, step, Adam's moments) and the fp32
        main parameters it steps (in fp32 training, views of the parameters' own shard)."""
        shards = [{"optimizer": t.state_dict(),
                   "main_params": [p.detach().clone() for g in t.param_groups for p in g["params"]]}
                  for t in self._torch_optimizers()]
        torch.save(shards, folder / optimizer_shard_name(mp_rank, dp_rank))

    def load(self, folder: Path, mp_rank: int, dp_rank: int) -> None:
        """This rank's optimizer shard back. The model's parameters are loaded before, into the 16-bit copies; the
        fp32 main parameters come from the shard, so reloading them from the 16-bit weights (Megatron's
        reload_model_params) would round them."""
        shards = torch.load(folder / optimizer_shard_name(mp_rank, dp_rank), map_location="cpu", weights_only=True)
        for t, shard in zip(self._torch_optimizers(), shards, strict=True):
            t.load_state_dict(shard["optimizer"])
            main = [p for g in t.param_groups for p in g["params"]]
            with torch.no_grad():  # in fp32 the main parameters are views of leaves that require grad
                for p, saved in zip(main, shard["main_params"], strict=True):
                    p.copy_(saved)


def wrap(resolved: Resolved, config, chunks: list) -> DistOpt:
    """Megatron's DDP around each chunk, the distributed optimizer over all of them, and the schedule's hooks on the
    shared TransformerConfig (as Megatron-LM's setup_model_and_optimizer and train do)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    r = resolved.recipe
    t = r.train
    bf16 = r.precision.dtype == "bf16"
    # With several chunks (vpp) the schedule dispatches each chunk's parameter gather itself (param_sync_func), and
    # align_param_gather tells the chunks' forward hooks so, as Megatron-LM sets the two together.
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=Layout.from_resolved(resolved).grad_reduce_bytes == 4, overlap_grad_reduce=True,
        overlap_param_gather=True, align_param_gather=len(chunks) > 1, use_distributed_optimizer=True)
    if bf16:
        # Every parameter in the training dtype, norms included (built fp32 by torch's RMSNorm), as Megatron-LM's
        # Float16Module casts the model and the DeepSpeed engine does on the other route. Left mixed, it trains,
        # but Megatron's own parameter-state gather (get_parameter_state_dp_zero) failed on a size mismatch (measured):
        # the optimizer assumes one dtype per parameter group.
        for chunk in chunks:
            chunk.bfloat16()
    # Later chunks get one bucket each, as Megatron-LM wraps them: their gradients are ready only at the end.
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    one = len(wrapped) == 1
    config.no_sync_func = wrapped[0].no_sync if one else [c.no_sync for c in wrapped]
    config.grad_sync_func = wrapped[0].start_grad_sync if one else [c.start_grad_sync for c in wrapped]
    if not one:  # with align_param_gather (above), as Megatron-LM's train() wires them
        config.param_sync_func = [c.start_param_sync for c in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=0.0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=ADAM_EPS, clip_grad=t.grad_clip, bf16=bf16,
        params_dtype=common.torch_dtype(r.precision.dtype), use_distributed_optimizer=True, overlap_param_gather=True)
    # config_overrides={}: every parameter decays by train.weight_decay, as the other backends' AdamW does (Megatron's
    # default leaves biases and norms out, through a parameter scheduler this loop does not run).
    optimizer = get_megatron_optimizer(opt_config, wrapped, config_overrides={})
    return DistOpt(wrapped, optimizer)
