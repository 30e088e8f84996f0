"""Timers: the means of Megatron's and DeepSpeed's own timers over the measured steps, each named by category."""
from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Iterable

from analysis.analyzers._numbers import finite
from analysis.table import Table

# ------------------------------------------------------------------------- framework timers (logs)

TIMER_COLUMNS = {
    "name": "timer name as the framework prints it",
    "category": "compute, communication, optimizer, data, pipeline or other (by name)",
    "mean_ms": "mean over the measured steps (Megatron: its per-interval averages; DeepSpeed: per step), ms",
    "max_ms": "largest value in the measured steps, ms",
    "samples": "records averaged",
    "source": "log file",
}
_TIMER_CATEGORIES = (
    ("communication", re.compile(r"all[-_ ]?reduce|all[-_ ]?gather|reduce[-_ ]?scatter|allreduce|allgather|"
                                 r"all[-_]?to[-_]?all|broadcast|comm", re.I)),
    ("pipeline", re.compile(r"send|recv|pipe_", re.I)),
    ("optimizer", re.compile(r"optimizer|^step|step_microstep|grad[-_]norm|copy[-_]to[-_]main|unscale", re.I)),
    ("data", re.compile(r"batch[-_ ]?generator|batch_input|data|iterator", re.I)),
    ("compute", re.compile(r"forward|backward|fwd|bwd", re.I)),
)


def timer_category(name: str) -> str:
    for cat, rx in _TIMER_CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def framework_timers(log: Table, measured_steps: Iterable[int] | None = None) -> Table:
    """Mean of each Megatron or DeepSpeed timer over the measured steps (all timed steps when none given)."""
    kept = set(measured_steps) if measured_steps is not None else None
    step_col = "iteration" if "iteration" in log.columns else "step"
    values: dict[str, list[float]] = defaultdict(list)
    for r in log.rows():
        if r["kind"] != "timer" or r["name"] is None or finite(r["time_ms"]) is None:
            continue
        s = r[step_col]
        if s is None or (kept is not None and s not in kept):
            continue
        values[r["name"]].append(r["time_ms"])
    rows = [{"name": n, "category": timer_category(n), "mean_ms": statistics.fmean(v), "max_ms": max(v),
             "samples": len(v), "source": log.source} for n, v in values.items()]
    rows.sort(key=lambda r: -r["mean_ms"])
    return Table.from_rows("framework_timers", TIMER_COLUMNS, rows, source=log.source)


