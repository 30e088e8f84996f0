"""The narrow interface between the one training loop (launch/ranks/trainers/loop.py) and a backend.

A backend is one module (named by `launch.config.backends`) with three functions:

    init_distributed(resolved, cuda) -> None
        Start torch.distributed (gloo on CPU ranks, NCCL on GPUs) and the backend's own process groups.
    build(ctx: BuildContext) -> Trainer
        Build the model and apply parallelism one dimension at a time, in a fixed, commented order, from
        `ctx.resolved.grid`; when `ctx.resume_from` is set, build so that `Trainer.load` can restore it.
    export_hf_state(resolved, ckpt) -> dict[str, Tensor]
        A complete checkpoint as one Hugging Face state dict (full tensors, fp32), for `launch export`.

A backend with the "async_checkpoint" feature (launch/config/backends.py; run.checkpoint_async) has one more method
on its trainer, which the loop calls instead of `save`:

    trainer.save_async(checkpoints, tag, step) -> concurrent.futures.Future
        Copy this rank's part to host memory and write it under checkpoints/tag behind training; the future completes
        once it is written (on rank 0: once every rank's is, so rank 0 then writes the marker).

The loop owns everything else: per-rank logs, the watchdog, the resume decision, metrics records,
TensorBoard, the profiler, the progress line, the learning-rate schedule, the data-parallel mean of the
loss, checkpoint cadence and markers, failure reporting and teardown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from launch.config.resolve import Resolved
    from launch.ranks.trainers.common import RankEnv, Watchdog
    from launch.run.checkpoints import Checkpoint
    from launch.run.rundir import RunDir


@dataclass(frozen=True)
class BuildContext:
    run: "RunDir"
    resolved: "Resolved"
    env: "RankEnv"
    cuda: bool
    device: "torch.device"
    watchdog: "Watchdog"
    resume_from: "Checkpoint | None"
    universal: bool  # resume_from must be loaded through DeepSpeed's universal format


@dataclass(frozen=True)
class StepOutput:
    loss: "torch.Tensor"  # mean loss over this rank's micro-batches, the same on every rank of a model replica
    grad_norm: float | None  # pre-clipping L2 norm of the whole averaged gradient, None where unknown
    # fp16 with dynamic loss scaling (None otherwise): the scale this step's losses were multiplied by before the
    # backward, and whether the scaled gradients overflowed (the step skipped: parameters and optimizer state unchanged)
    loss_scale: float | None = None
    skipped: bool | None = None


class Trainer(Protocol):
    dp_rank: int  # this rank's data-parallel coordinate: which rows of the global batch it reads
    dp_world: int
    dp_group: Any  # the data-parallel process group (None: the whole world)
    param_numel_local: int  # parameter elements this rank stores (its TP/PP shard, ZeRO-3 partition)
    layer_calls: list[int]  # forward calls per decoder layer so far (recomputation runs a layer twice)
    decoder_layers: list[Any]  # this rank's decoder layer modules in forward order (calibrate times the forward in them)

    def set_lr(self, lr: float) -> None: ...

    def train_step(self, micro_batch: Callable[[int], "torch.Tensor"]) -> StepOutput:
        """One optimizer step over the step's micro-batches; `micro_batch(i)` gives this rank's i-th
        [micro_batch_size, seq_len] token rows (inputs; the labels are the same rows shifted by one)."""

    def evaluate(self, micro_batch: Callable[[int], "torch.Tensor"], count: int) -> "torch.Tensor":
        """The mean loss of `count` micro-batches, forward only (no gradient, no optimizer): the validation loss,
        the same on every rank of a model replica (the loop averages it over data-parallel ranks)."""

    def loss(self, rows: "torch.Tensor") -> "torch.Tensor":
        """The loss of one micro-batch of rows through this rank's parallel model alone: no gradient reduction,
        optimizer or engine hooks. `launch calibrate` times it and its backward in situ, where the model's own
        tensor-parallel collectives run as they do in training (pipeline stages excepted: pp = 1)."""

    def save(self, checkpoints: "Path", tag: str, step: int) -> None:
        """Every rank saves its part under checkpoints/tag; the loop writes the completion marker."""

    def load(self, ckpt: "Checkpoint") -> int:
        """Restore model and optimizer state; returns the number of steps already trained."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of weights, grads and optimizer state this rank holds between steps, in the planner's
        categories (launch/ranks/trainers/common.py `model_state_bytes`); the loop records it after the first step."""

