"""Memory: the peak per rank (`memory_from_*`, MEMORY_COLUMNS), and `memory_vs_plan`, which puts the planner's
prediction (plan.json, or recomputed from resolved.json) and the device limit beside it."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from analysis.table import Table

# ------------------------------------------------------------------------------------------ memory

MEMORY_COLUMNS = {
    "rank": "rank (None when the log does not say which rank printed)",
    "max_allocated_bytes": "peak bytes allocated by tensors (torch max_memory_allocated)",
    "max_reserved_bytes": "peak bytes held by the caching allocator (torch max_memory_reserved)",
    "rss_max_bytes": "CPU ranks: peak resident set of the process, bytes",
    "measured_bytes": "the number compared: the larger of max_reserved and max_allocated (GPU), else rss (CPU)",
    "measured_what": "which of the three measured_bytes is",
    "predicted_bytes": "the planner's total for this rank (its backend's accounting); None without a plan",
    "predicted_what": "where the prediction comes from, or 'none' and why",
    "measured_over_predicted": "measured_bytes / predicted_bytes",
    "device_memory_bytes": "memory of one device (CPU profile: per rank) from the hardware profile or as given",
    "pct_of_device": "measured_bytes / device_memory_bytes x 100",
    "source": "file:line of the peak record",
}


def memory_from_metrics(metrics: Table) -> Table:
    """Peak per rank over all steps of our metrics (the trainer records the running peak)."""
    best: dict[Any, dict[str, Any]] = {}
    for r in metrics.rows():
        cur = best.setdefault(r["rank"], {"rank": r["rank"], "max_allocated_bytes": None, "max_reserved_bytes": None,
                                          "rss_max_bytes": None, "source": None, "_key": -1})
        for col, src in (("max_allocated_bytes", "mem_max_allocated_bytes"),
                         ("max_reserved_bytes", "mem_max_reserved_bytes"), ("rss_max_bytes", "rss_max_bytes")):
            v = r[src]
            if v is not None and (cur[col] is None or v > cur[col]):
                cur[col] = v
        key = r["mem_max_reserved_bytes"] or r["mem_max_allocated_bytes"] or r["rss_max_bytes"] or 0
        if key > cur["_key"]:
            cur["_key"], cur["source"] = key, f"{r['file']}:{r['line']}"
    return _memory_table(best.values(), metrics.source, metrics.warnings)


def memory_from_megatron(log: Table) -> Table:
    """Peak per rank from Megatron's `[Rank N] ... memory (MB)` reports."""
    best: dict[Any, dict[str, Any]] = {}
    for r in log.rows():
        if r["kind"] != "memory":
            continue
        _take_peak(best, r["rank"], r["max_allocated_bytes"], r["max_reserved_bytes"], f"{log.source}:{r['line']}")
    return _memory_table(best.values(), log.source, log.warnings)


def memory_from_deepspeed(log: Table) -> Table:
    """Peak per rank from DeepSpeed's ThroughputTimer / see_memory_usage lines (printed in GiB, 2 decimals)."""
    best: dict[Any, dict[str, Any]] = {}
    for r in log.rows():
        if r["kind"] not in ("memory", "throughput"):
            continue
        _take_peak(best, r["rank"], r["max_allocated_bytes"], r["max_reserved_bytes"], f"{log.source}:{r['line']}")
    return _memory_table(best.values(), log.source, log.warnings)


def _take_peak(best: dict, rank: Any, alloc: Any, reserved: Any, source: str) -> None:
    cur = best.setdefault(rank, {"rank": rank, "max_allocated_bytes": None, "max_reserved_bytes": None,
                                 "rss_max_bytes": None, "source": None, "_key": -1})
    if alloc is not None and (cur["max_allocated_bytes"] is None or alloc > cur["max_allocated_bytes"]):
        cur["max_allocated_bytes"] = alloc
    if reserved is not None and (cur["max_reserved_bytes"] is None or reserved > cur["max_reserved_bytes"]):
        cur["max_reserved_bytes"] = reserved
    key = reserved or alloc or 0
    if key > cur["_key"]:
        cur["_key"], cur["source"] = key, source


def _memory_table(rows: Iterable[dict[str, Any]], source: str, warnings: Iterable[str]) -> Table:
    out = []
    for r in sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0)):
        res, alloc = r["max_reserved_bytes"], r["max_allocated_bytes"]
        # Logs print the two peaks at different moments (DeepSpeed's see_memory_usage before training, its
        # throughput line during it), so the larger one is the peak that happened.
        if res is not None and (alloc is None or res >= alloc):
            measured, what = res, "max_reserved (GPU)"
        elif alloc is not None:
            measured, what = alloc, "max_allocated (GPU)"
        elif r["rss_max_bytes"] is not None:
            measured, what = r["rss_max_bytes"], "peak RSS (CPU process)"
        else:
            continue
        out.append({**r, "measured_bytes": measured, "measured_what": what, "predicted_bytes": None,
                    "predicted_what": None, "measured_over_predicted": None, "device_memory_bytes": None,
                    "pct_of_device": None})
    return Table.from_rows("memory", MEMORY_COLUMNS, out, source=source, warnings=warnings)


class MemoryVsPlanMeta(NamedTuple):
    """Table.meta of memory_vs_plan."""

    plan_source: str  # the file the plan came from ("" without a plan)
    device_source: str  # where device_memory_bytes came from (the caller, or the plan's hardware profile)


def memory_vs_plan(memory: Table, plan: Any | None, *, plan_source: str = "",
                   device_memory_bytes: int | None = None, device_source: str = "",
                   no_plan_reason: str = "none (foreign run: no plan)") -> Table:
    """Put the plan's per-rank total and the device limit beside each measured peak.

    `plan` is a launch.plan.layout.Plan; each rank takes the RankPlan listing it, in the plan's
    implementation accounting (the backend's own), total = model states + activations + buffers
    + allowance.
    """
    rows = []
    for r in memory.rows():
        pred, what = None, no_plan_reason
        if plan is not None:
            rp = next((p for p in plan.ranks if r["rank"] in p.ranks), None)
            if rp is None and r["rank"] is None and len(plan.ranks) == 1:
                rp = plan.ranks[0]
            if rp is not None:
                mem = rp.memory[rp.implementation]
                pred = mem.total
                what = (f"{plan_source}: {rp.kind}, {rp.implementation} accounting, total = model states "
                        f"{mem.model_states} + activations {mem.activations} + buffers {mem.buffers} + "
                        f"allowance {mem.allowance} B")
                if device_memory_bytes is None:
                    device_memory_bytes, device_source = rp.device_memory_bytes, f"{plan_source} (hardware profile)"
            else:
                what = f"{plan_source}: no rank plan lists rank {r['rank']}"
        dev = device_memory_bytes
        rows.append({**r, "predicted_bytes": pred, "predicted_what": what,
                     "measured_over_predicted": r["measured_bytes"] / pred if pred else None,
                     "device_memory_bytes": dev,
                     "pct_of_device": 100.0 * r["measured_bytes"] / dev if dev else None})
    return Table.from_rows("memory", MEMORY_COLUMNS, rows, source=memory.source, warnings=memory.warnings,
                           meta=MemoryVsPlanMeta(plan_source=plan_source, device_source=device_source))


