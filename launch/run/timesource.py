"""One time source for every plan: where a command line names no hardware.profile and the recipe's is nominal,
the newest calibration `python -m launch calibrate` left under the runs folder for this machine, model and world
times the plan (`calibrate` then anything else is the documented order: planning on nominal figures after measuring
would throw the measurement away). run.sh, sweep.sh and recommend ask here; what they print says which it was."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from launch.config.calibration import Machine, newest_for
from launch.config.resolve import Resolved
from launch.run.rundir import runs_root


@dataclass(frozen=True)
class TimeSource:
    """The overrides to resolve with (hardware.profile=<calibration> appended when one applies) and what to tell the
    user about it."""

    overrides: tuple[str, ...]
    lines: tuple[str, ...]
    calibration: str | None = None  # the file that times the plan, when one was found


def time_source(base: Resolved, overrides: Sequence[str], machine: Machine) -> TimeSource:
    """`base`: the recipe resolved with `overrides` alone."""
    named = any(a.split("=", 1)[0].strip() == "hardware.profile" for a in overrides)  # the parser strips keys too
    if named or not base.hardware.nominal:
        return TimeSource(tuple(overrides), ())
    r = base.recipe
    newest = newest_for(runs_root(), machine_kind=machine.kind, versions=machine.versions,
                        base_profile=base.hardware.name, world_size=base.world_size,
                        ranks_per_node=r.hardware.gpus_per_node, model=base.model.name, dtype=r.precision.dtype,
                        seq_len=r.batch.seq_len)
    lines = [f"warning: passed over {len(newest.unreadable)} calibration file(s) that cannot be read, "
             f"e.g. {newest.unreadable[0]}"] if newest.unreadable else []
    if newest.path is None:
        return TimeSource(tuple(overrides), tuple(lines))
    lines.append(f"timed with {newest.path}: the newest calibration of this machine for this model and world "
                 f"(no hardware.profile given; hardware.profile={base.hardware.name} gives nominal figures)")
    return TimeSource((*overrides, f"hardware.profile={newest.path}"), tuple(lines), str(newest.path))
