"""The recipe's `[commbench]` settings against its layout: which groups the sweep runs on (`groups_of`) and the
check resolve.py runs before any rank starts (`check`). The sweep's tables live in launch/comm/commbench_spec.py."""
from __future__ import annotations

import difflib
import math
from typing import Callable

from launch.comm.commbench_spec import (
    DTYPES,
    OPS,
    backend_of,
    shapes,
    sweep_sizes,
    unsupported,
)
from launch.config.grid import RankGrid
from launch.config.hardware import HardwareProfile
from launch.config.schema import CommbenchSection
from launch.errors import ConfigError


def groups_of(cb: CommbenchSection, grid: RankGrid) -> tuple[tuple[int, ...], ...]:
    """The groups the sweep runs on at once; other ranks wait."""
    if cb.ranks:
        return (tuple(cb.ranks),)
    if cb.group == "world":
        return (tuple(range(grid.world)),)
    if cb.group == "inter_node":
        return (tuple(node * grid.gpus_per_node for node in range(grid.nodes)),)
    return tuple(grid.all_groups(cb.group))


def check(where: Callable[[str], str], cb: CommbenchSection, max_bytes_set: int, grid: RankGrid,
          hw: HardwareProfile) -> None:
    """The sweep's settings against the layout and the backend (`cb.max_bytes` already holds the default;
    `max_bytes_set` is the recipe's own value, 0 when unset); `where(dotted)` names the file or override
    that set a field. Raises ConfigError."""
    for dotted, value, low in [("commbench.min_bytes", cb.min_bytes, 1), ("commbench.max_bytes", max_bytes_set, 0),
                               ("commbench.step_factor", cb.step_factor, 2), ("commbench.warmup_iters", cb.warmup_iters, 0),
                               ("commbench.iters", cb.iters, 1)]:
        if value < low:
            raise ConfigError(where(dotted), dotted, value, f"must be at least {low}", f"set {dotted}={low} or more")
    if cb.max_bytes > hw.memory_bytes:
        # the send and receive buffers live on the device: a larger message cannot be allocated (2^62 bytes passed)
        raise ConfigError(where("commbench.max_bytes"), "commbench.max_bytes", cb.max_bytes,
                          f"exceeds the {hw.name} profile's device memory ({hw.memory_bytes} bytes)",
                          "set commbench.max_bytes to a size the device holds, e.g. 1073741824 (1 GiB)")
    if not (math.isfinite(cb.interleave_us) and 0 <= cb.interleave_us <= 1e6):
        raise ConfigError(where("commbench.interleave_us"), "commbench.interleave_us", cb.interleave_us,
                          "must be between 0 and 1e6 µs", "set commbench.interleave_us=0 (back-to-back calls) or e.g. 500")
    if not cb.ops:
        raise ConfigError(where("commbench.ops"), "commbench.ops", [], "is empty, so there is nothing to measure",
                          f"list some of {', '.join(OPS)}")
    for op in cb.ops:
        if op not in OPS:
            close = difflib.get_close_matches(op, OPS, n=1, cutoff=0.6)
            raise ConfigError(where("commbench.ops"), "commbench.ops", list(cb.ops),
                              f"names {op!r}, which is not a collective the sweep runs",
                              (f"did you mean {close[0]!r}? " if close else "") + f"choose among {', '.join(OPS)}")
    if cb.min_bytes > cb.max_bytes:
        default = "" if max_bytes_set else f" (the {hw.name} profile's default, as commbench.max_bytes=0)"
        raise ConfigError(where("commbench.min_bytes"), "commbench.min_bytes", cb.min_bytes,
                          f"is above commbench.max_bytes={cb.max_bytes}{default}: the size range is empty",
                          f"set commbench.min_bytes <= {cb.max_bytes} or raise commbench.max_bytes")
    if cb.ranks and cb.group != "world":
        raise ConfigError(where("commbench.ranks"), "commbench.ranks", list(cb.ranks),
                          f'and commbench.group="{cb.group}" both choose the group', "set only one of them")
    if cb.ranks:
        outside = [x for x in cb.ranks if not 0 <= x < grid.world]
        if outside:
            raise ConfigError(where("commbench.ranks"), "commbench.ranks", list(cb.ranks),
                              f"names rank {outside[0]}, outside the world of {grid.world} ranks (0-{grid.world - 1})",
                              f"list ranks between 0 and {grid.world - 1}")
        if len(set(cb.ranks)) != len(cb.ranks):
            raise ConfigError(where("commbench.ranks"), "commbench.ranks", list(cb.ranks), "names a rank twice",
                              "list each rank once")
    groups = groups_of(cb, grid)
    n = len(groups[0])
    if n < 2:
        dotted = "commbench.ranks" if cb.ranks else "commbench.group"
        why = {"tp": f"parallel.tp={grid.tp}", "dp": f"parallel.dp={grid.dp}", "pp": f"parallel.pp={grid.pp}",
               "inter_node": f"hardware.nodes={grid.nodes}", "world": f"a world of {grid.world}"}[cb.group]
        raise ConfigError(where(dotted), dotted, list(cb.ranks) if cb.ranks else cb.group,
                          f"gives groups of 1 rank ({'as listed' if cb.ranks else why}): a collective needs 2 or more",
                          "choose a group with at least 2 ranks, e.g. commbench.group=\"world\" on 2+ ranks")
    dtype = DTYPES[cb.dtype]
    backend = backend_of(hw.device_type)
    sizes = sweep_sizes(cb.min_bytes, cb.max_bytes, cb.step_factor)
    for op in cb.ops:
        reason = unsupported(backend, op, cb.dtype)
        if reason:
            raise ConfigError(where("commbench.dtype"), "commbench.dtype", cb.dtype, reason,
                              f'set commbench.dtype="float32" (or bfloat16, float16, ...) or drop {op} from commbench.ops')
        if not shapes(op, sizes, dtype.size, n):
            raise ConfigError(where("commbench.max_bytes"), "commbench.max_bytes", cb.max_bytes,
                              f"leaves {op} on {n} ranks no message of at least one {cb.dtype} element per rank",
                              f"raise commbench.max_bytes to {n * dtype.size} or more")
