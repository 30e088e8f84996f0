"""What the communication files say, as the report lists it: nccl-tests rows as printed (out-of-place and
in-place side by side, with the run's rank count) and each run's own `# Avg bus bandwidth`, and the transports
NCCL_DEBUG shows per rank pair (in a log, or among an nccl-tests output's rows), so that a healthy run shows that
it is healthy. Computing only; analysis/report/ renders.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

from analysis.parsers.nccl_tests import NcclTestsSection
from analysis.table import Table

NCCL_TESTS_ROWS = {
    "op": "collective",
    "ranks": "rank count of the run: as printed, or inferred from busbw / algbw; None when neither tells",
    "ranks_from": "'printed', 'inferred from busbw/algbw', or None",
    "size_bytes": "message size in bytes as printed",
    "count": "element count as printed",
    "dtype": "data type as printed",
    "redop": "reduction as printed (None: the table has no redop column)",
    "oop_time_us": "out-of-place time per call, µs",
    "oop_algbw_GBps": "out-of-place algorithm bandwidth, GB/s",
    "oop_busbw_GBps": "out-of-place bus bandwidth, GB/s",
    "ip_time_us": "in-place time per call, µs",
    "ip_algbw_GBps": "in-place algorithm bandwidth, GB/s",
    "ip_busbw_GBps": "in-place bus bandwidth, GB/s",
    "wrong": "#wrong elements summed over both placements (None: validation off or not printed)",
    "source": "file:line of the row",
}


class NcclTestsAverage(NamedTuple):
    """One run (section) of an nccl-tests output as the tool sums it up itself."""

    op: str  # collective
    ranks: int | None  # as NCCL_TESTS_ROWS
    ranks_from: str | None  # as NCCL_TESTS_ROWS
    rows: int  # the printed sizes (rows of NCCL_TESTS_ROWS) the average is over
    avg_busbw_GBps: float | None  # its `# Avg bus bandwidth` line (the mean busbw of every size and placement),
    # GB/s; None where the output lacks it (cut short: the parser's warnings say so)
    source: str  # file:line of that line; the file alone where the output lacks it
    footer_printed: bool = False  # the line is there: a None average then read as no possible bandwidth (inf, nan)


class NcclTestsRowsMeta(NamedTuple):
    """Table.meta of `nccl_tests_rows`: what the output says besides its rows."""

    averages: list[NcclTestsAverage]  # one per section that has rows or an average, in the file's order


def _ranks(sec: NcclTestsSection | None) -> tuple[int | None, str | None]:
    """A section's rank count and where it came from (NCCL_TESTS_ROWS['ranks_from'])."""
    if sec is not None and sec.nranks is not None:
        return sec.nranks, "printed"
    if sec is not None and sec.nranks_inferred is not None:
        return sec.nranks_inferred, "inferred from busbw/algbw"
    return None, None


def nccl_tests_rows(table: Table) -> Table:
    """One row per printed row (size) of each section, both placements side by side; `meta` (NcclTestsRowsMeta)
    holds each section's own average."""
    sections = table.meta.sections
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in table.rows():
        # A printed line holds both placements of one size; sizes repeat (nccl-tests prints every 0-byte step), so
        # rows are told apart by their line. Rows without one (a commbench JSON) have one row per size.
        key = (r["section"], r["line"]) if r["line"] is not None else (
            r["section"], r["op"], r["size_bytes"], r["count"], r["dtype"], r["redop"])
        sec = sections[r["section"]] if isinstance(r["section"], int) and r["section"] < len(sections) else None
        ranks, ranks_from = _ranks(sec)
        row = merged.setdefault(key, {
            "section": r["section"], "op": r["op"], "ranks": ranks, "ranks_from": ranks_from,
            "size_bytes": r["size_bytes"], "count": r["count"], "dtype": r["dtype"], "redop": r["redop"],
            "oop_time_us": None, "oop_algbw_GBps": None, "oop_busbw_GBps": None, "ip_time_us": None,
            "ip_algbw_GBps": None, "ip_busbw_GBps": None, "wrong": None,
            "source": table.source if r["line"] is None else f"{table.source}:{r['line']}"})
        prefix = "ip" if r["placement"] == "in-place" else "oop"
        row[f"{prefix}_time_us"], row[f"{prefix}_algbw_GBps"], row[f"{prefix}_busbw_GBps"] = (
            r["time_us"], r["algbw_GBps"], r["busbw_GBps"])
        if r["wrong"] is not None:
            row["wrong"] = (row["wrong"] or 0) + r["wrong"]
    averages = []
    for index, sec in enumerate(sections):
        printed = sum(1 for row in merged.values() if row["section"] == index)
        if printed or sec.avg_busbw_GBps is not None:
            averages.append(NcclTestsAverage(
                sec.op, *_ranks(sec), printed, sec.avg_busbw_GBps,
                table.source if sec.avg_busbw_line is None else f"{table.source}:{sec.avg_busbw_line}",
                sec.avg_busbw_line is not None))
    return Table.from_rows("nccl_tests_rows", NCCL_TESTS_ROWS, merged.values(), source=table.source,
                           warnings=table.warnings, meta=NcclTestsRowsMeta(averages))


TRANSPORT_ROWS = {
    "comm": "communicator (NCCL's commId or comm pointer; None where the log does not say)",
    "peer_from": "sending rank",
    "peer_to": "receiving rank (None for CollNet/NVLS, which have no single peer)",
    "kind": "ring, tree, nvls, collnet or p2p where the log tells",
    "transport": "normalised transport (analysis.parsers.nccl_debug.COLUMNS['transport']: P2P/IPC, SHM, NET/IB, "
                 "NET/IB/GDRDMA, NET/RoCE, NET/Socket, ...)",
    "gdrdma": "GPUDirect RDMA: True when the transport goes NIC to GPU memory directly (…/GDRDMA)",
    "channels": "channels using this pair and transport",
    "cuda_dev": "local CUDA device(s) of the printing rank",
    "hosts": "host of the rank that printed the line → host of the other end, where known",
    "source": "file:line of the first such connection line",
}


def transports(table: Table) -> Table:
    """Connection lines of an NCCL_DEBUG log grouped by communicator, rank pair, kind and transport."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    channels: dict[tuple[Any, ...], set[Any]] = defaultdict(set)
    devices: dict[tuple[Any, ...], set[Any]] = defaultdict(set)
    for r in table.rows():
        key = (r["comm"], r["peer_from"], r["peer_to"], r["kind"], r["transport"])
        channels[key].add(r["channel"])
        if r["cuda_dev"] is not None:
            devices[key].add(r["cuda_dev"])
        groups.setdefault(key, {
            "comm": r["comm"], "peer_from": r["peer_from"], "peer_to": r["peer_to"], "kind": r["kind"],
            "transport": r["transport"], "gdrdma": "GDRDMA" in str(r["transport"]),
            "hosts": f"{r['host'] or '?'} → {r['peer_host'] or '?'}" if r["host"] or r["peer_host"] else None,
            "source": f"{table.source}:{r['line']}"})
    rows = []
    for key, g in groups.items():
        rows.append({**g, "channels": len(channels[key]),
                     "cuda_dev": ",".join(map(str, sorted(devices[key]))) or None})
    rows.sort(key=lambda g: (str(g["comm"]), g["peer_from"] if g["peer_from"] is not None else -1,
                             g["peer_to"] if g["peer_to"] is not None else -1, str(g["kind"]), str(g["transport"])))
    return Table.from_rows("transports", TRANSPORT_ROWS, rows, source=table.source, warnings=table.warnings)
