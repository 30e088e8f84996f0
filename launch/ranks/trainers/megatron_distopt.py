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

Checkpoints keep the file names of the DeepSpeed route so that export and the shape check read them alike: per
model-parallel rank, the model's chunks (`mp_rank_XX_model_states.pt`: "module", as DeepSpeed saves it) and the
optimizer's parameter state gathered on data-parallel rank 0 (`mp_rank_XX_distopt_states.pt`, Megatron's
save_parameter_state), beside its step and parameter groups (`mp_rank_XX_optim_groups.pt`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from launch.config.resolve import Resolved
from launch.config.schema import ADAM_EPS
from launch.ranks.trainers import common

def model_states_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def parameter_state_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_distopt_states.pt"


def optimizer_groups_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_optim_groups.pt"


@dataclass
class DistributedOptimizer:
    """A rank's model chunks under Megatron's DDP, and the distributed optimizer over them."""

    chunks: list  # DDP-wrapped, in virtual-stage order (what the schedule runs)
    optimizer: object  # megatron.core.optimizer.DistributedOptimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float | None:
        """The optimizer step on reduced gradients (the schedule's finalize_model_grads reduced them); returns the
        pre-clipping gradient norm (None without clipping: Megatron computes it only to clip)."""
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
        inner = self.optimizer.optimizer
        seen: set[int] = set()
        params = [p for chunk in self.chunks for p in chunk.module.parameters()]
        weights = common.storage_bytes([p.data for p in params], seen)
        grads = common.storage_bytes([getattr(p, "main_grad", None) for p in params], seen)
        masters = [p for g in inner.param_groups for p in g["params"]]
        optimizer = common.storage_bytes(masters + [v for st in inner.state.values() for v in st.values()
                                                    if torch.is_tensor(v)], seen)
        return {"weights": weights, "grads": grads, "optimizer": optimizer}

    def save(self, folder: Path, mp_rank: int, dp_rank: int) -> None:
        """Collective over the data-parallel group (the parameter state is gathered on its rank 0)."""
        self.sync_params()
        self.optimizer.save_parameter_state(str(folder / parameter_state_name(mp_rank)))
        if dp_rank == 0:
            torch.save(self.optimizer.state_dict(), folder / optimizer_groups_name(mp_rank))

    def load(self, folder: Path, mp_rank: int) -> None:
        """The optimizer's groups and step, then its parameter state (each rank takes its shard from the gathered
        file). The model's parameters are loaded before, into the 16-bit copies; the fp32 main parameters come from
        the parameter state, so reloading them from the 16-bit weights (reload_model_params) would round them."""
        groups = torch.load(folder / optimizer_groups_name(mp_rank), map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(groups)
        # Without Apex or Transformer Engine, load_state_dict gives every parameter's state one shared `step` tensor,
        # and torch's AdamW increments each parameter's step in place: the shared one then counts once per parameter
        # and every bias correction after a resume is wrong (measured: losses 4e-3 off within five steps).
        for state in self.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        # no_grad: in fp32 the main parameters are views of the model's (no 16-bit copy), and copying into a view of
        # a leaf that requires grad raises outside it
        with torch.no_grad():
            self.optimizer.load_parameter_state(str(folder / parameter_state_name(mp_rank)))


def wrap(resolved: Resolved, config, chunks: list) -> DistributedOptimizer:
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
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not bf16 or r.precision.grad_reduce_dtype == "fp32", overlap_grad_reduce=True,
        overlap_param_gather=True, use_distributed_optimizer=True)
    if bf16:
        # Every parameter in the training dtype, norms included (built fp32 by torch's RMSNorm), as Megatron-LM's
        # Float16Module casts the model and the DeepSpeed engine does on the other route. Left mixed, the
        # distributed optimizer trains, but saving its parameter state fails (measured: a size mismatch in
        # get_parameter_state_dp_zero, which assumes one dtype per group).
        for chunk in chunks:
            chunk.bfloat16()
    # Later chunks get one bucket each, as Megatron-LM wraps them: their gradients are ready only at the end.
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    one = len(wrapped) == 1
    config.no_sync_func = wrapped[0].no_sync if one else [c.no_sync for c in wrapped]
    config.grad_sync_func = wrapped[0].start_grad_sync if one else [c.start_grad_sync for c in wrapped]
    config.param_sync_func = wrapped[0].start_param_sync if one else [c.start_param_sync for c in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=0.0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=ADAM_EPS, clip_grad=t.grad_clip, bf16=bf16,
        params_dtype=common.torch_dtype(r.precision.dtype), use_distributed_optimizer=True, overlap_param_gather=True)
    # config_overrides={}: every parameter decays by train.weight_decay, as the other backends' AdamW does (Megatron's
    # default leaves biases and norms out, through a parameter scheduler this loop does not run).
    optimizer = get_megatron_optimizer(opt_config, wrapped, config_overrides={})
    return DistributedOptimizer(wrapped, optimizer)
