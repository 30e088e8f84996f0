"""The nccl-tests sweeps (nccl-tests / rccl-tests text, or our commbench results as the same table): bus bandwidth
against message size, and the ceilings the report compares the traces' collectives with.

`busbw_curve` is the one busbw-vs-size curve of a sweep: the ceilings table (`nccl_ceilings`), the report's figure
(`ceiling_curves`) and the busbw-vs-size plot of `python -m analysis busbw` (`busbw_panels`) all read it, so that
the figures and the tables cannot disagree. `busbw_at` reads a curve at one message size.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

from analysis.analyzers._numbers import finite
from analysis.parsers.nccl_tests import large_message_busbw
from analysis.table import Table
from launch.comm.nccl_format import BUS_FACTORS, bus_factor

# "median": every row of the size (both placements, every section); otherwise the rows of that placement only.
PLACEMENTS = ("median", "out-of-place", "in-place")
# The panel order of the busbw-vs-size plot; collectives not listed follow in name order.
ORDER = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "sendrecv", "reduce", "gather",
         "scatter", "alltoallv", "hypercube")


def sweep_nranks(table: Table, op: str) -> int | None:
    """Ranks of the sweep of `op`: as its first section prints them, else inferred from busbw/algbw, else the
    table's own count."""
    sec = next((s for s in table.meta.sections if s.op == op), None)
    printed = (sec.nranks or sec.nranks_inferred) if sec is not None else None
    return printed or table.meta.nranks


def busbw_curve(table: Table, op: str, placement: str = "median") -> list[tuple[float, float]]:
    """(size bytes, busbw GB/s) of `op` per message size measured, by size: the median over both placements and
    every section of the size ("median"), or over the rows of one placement ("out-of-place", "in-place").

    busbw is computed from size and time where the bus factor is known (the printed busbw has two decimals, so
    small messages print 0.00 and a ceiling read there would be 0), else the printed busbw."""
    if placement not in PLACEMENTS:
        raise ValueError(f"busbw_curve: placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    nranks = sweep_nranks(table, op)
    factor = bus_factor(op, nranks) if nranks and op in BUS_FACTORS else None
    by_size: dict[float, list[float]] = defaultdict(list)
    for r in table.rows():
        if r["op"] != op or not finite(r["size_bytes"]) or r["size_bytes"] <= 0:
            continue
        if placement != "median" and r["placement"] != placement:
            continue
        if factor is not None and finite(r["time_us"]):
            by_size[r["size_bytes"]].append(r["size_bytes"] / r["time_us"] / 1e3 * factor)
        elif finite(r["busbw_GBps"]) is not None:
            by_size[r["size_bytes"]].append(r["busbw_GBps"])
    return [(size, statistics.median(v)) for size, v in sorted(by_size.items())]


CEILING_COLUMNS = {
    "op": "nccl-tests collective (all_reduce, all_gather, reduce_scatter, alltoall, sendrecv, broadcast, ...)",
    "busbw_GBps": "large-message bus bandwidth: median busbw over the top quartile of the sizes measured "
                  "(analysis.parsers.nccl_tests.large_message_busbw)",
    "peak_busbw_GBps": "highest busbw measured",
    "nranks": "ranks in the nccl-tests run (printed, else inferred from busbw/algbw)",
    "curve": "(size bytes, busbw GB/s) per size measured, the median over placements and sections, by size "
             "(busbw_curve)",
    "source": "nccl-tests output file",
}


def busbw_at(curve: Sequence[tuple[float, float]], nbytes: float) -> float | None:
    """The sweep's busbw at a message size: linear in log(size) between the two nearest sizes measured, the
    nearest end's value outside the range (busbw flattens at both ends of a sweep)."""
    pts = [(s, b) for s, b in curve if s > 0 and b is not None and math.isfinite(b)]
    if not pts or not (nbytes > 0 and math.isfinite(nbytes)):
        return None
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1]
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if s0 <= nbytes <= s1:
            f = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0)) if s1 > s0 else 0.0
            return b0 + f * (b1 - b0)
    return None


def nccl_ceilings(tables: Iterable[Table]) -> Table:
    """The best large-message busbw per collective over the nccl-tests files given."""
    best: dict[str, dict[str, Any]] = {}
    for t in tables:
        for op in sorted({r["op"] for r in t.rows() if r["op"]}):
            try:
                bw = large_message_busbw(t, op)
            except ValueError:
                continue
            if bw is None:
                continue
            peak = max((r["busbw_GBps"] for r in t.rows() if r["op"] == op and finite(r["busbw_GBps"]) is not None),
                       default=None)
            if op not in best or bw > best[op]["busbw_GBps"]:
                best[op] = {"op": op, "busbw_GBps": bw, "peak_busbw_GBps": peak, "nranks": sweep_nranks(t, op),
                            "curve": busbw_curve(t, op), "source": t.source}
    return Table.from_rows("nccl_ceilings", CEILING_COLUMNS, [best[k] for k in sorted(best)])


def ceiling_curves(tables: Sequence[Table]) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(op, file, busbw_curve) per collective of each nccl-tests table, for the report's busbw-vs-size figure."""
    out = []
    for t in tables:
        for op in sorted({r["op"] for r in t.rows() if r["op"]}):
            curve = busbw_curve(t, op)
            if curve:
                out.append((op, t.source, curve))
    return out


# One panel per collective: (op, [(index of the table among those given, legend label, busbw_curve)]).
Panel = tuple[str, list[tuple[int, str, list[tuple[float, float]]]]]


def busbw_panels(tables: Mapping[str, Table], placement: str = "median") -> list[Panel]:
    """The busbw-vs-size plot's data for {label: nccl_tests table}: one panel per collective any table holds (in
    ORDER), in it the busbw_curve of each table that has the collective, labelled with its rank count when known."""
    if placement not in PLACEMENTS:
        raise ValueError(f"busbw_plot: placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    present = {r["op"] for t in tables.values() for r in t.rows()}
    ops = [op for op in ORDER if op in present] + sorted(present - set(ORDER))
    if not ops:
        raise ValueError("busbw_plot: the tables hold no rows")
    panels: list[Panel] = []
    for op in ops:
        lines = []
        for i, (label, table) in enumerate(tables.items()):
            curve = busbw_curve(table, op, placement)
            if curve:
                n = sweep_nranks(table, op)
                lines.append((i, f"{label} (n={n})" if n else label, curve))
        panels.append((op, lines))
    return panels
