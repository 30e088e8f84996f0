"""The learning-rate schedule, shared by every backend so that layouts compare like for like."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, schedule: str) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up to `lr`, then cosine/linear decay to `min_lr`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
