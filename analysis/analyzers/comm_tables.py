"""What the communication files say, as the report lists it: nccl-tests rows per message size (out-of-place and
in-place side by side, with the run's rank count), and the transports NCCL_DEBUG shows per rank pair, so that a
healthy run shows that it is healthy. Computing only; analysis/report/ renders.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

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
    "source": "file:line of the row (the out-of-place one where both exist)",
}


def nccl_tests_rows(table: Table) -> Table:
    """One row per section, op and message size with both placements side by side."""
    sections = table.meta.sections
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in table.rows():
        key = (r["section"], r["op"], r["size_bytes"], r["count"], r["dtype"], r["redop"])
        sec = sections[r["section"]] if isinstance(r["section"], int) and r["section"] < len(sections) else None
        ranks, ranks_from = (sec.nranks if sec is not None else None), "printed"
        if ranks is None:
            ranks, ranks_from = (sec.nranks_inferred if sec is not None else None), "inferred from busbw/algbw"
        row = merged.setdefault(key, {
            "op": r["op"], "ranks": ranks, "ranks_from": ranks_from if ranks is not None else None,
            "size_bytes": r["size_bytes"], "count": r["count"], "dtype": r["dtype"], "redop": r["redop"],
            "oop_time_us": None, "oop_algbw_GBps": None, "oop_busbw_GBps": None, "ip_time_us": None,
            "ip_algbw_GBps": None, "ip_busbw_GBps": None, "wrong": None, "source": f"{table.source}:{r['line']}"})
        prefix = "ip" if r["placement"] == "in-place" else "oop"
        row[f"{prefix}_time_us"], row[f"{prefix}_algbw_GBps"], row[f"{prefix}_busbw_GBps"] = (
            r["time_us"], r["algbw_GBps"], r["busbw_GBps"])
        if r["wrong"] is not None:
            row["wrong"] = (row["wrong"] or 0) + r["wrong"]
        if prefix == "oop":
            row["source"] = f"{table.source}:{r['line']}"
    return Table.from_rows("nccl_tests_rows", NCCL_TESTS_ROWS, merged.values(), source=table.source,
                           warnings=table.warnings)


TRANSPORT_ROWS = {
    "comm": "communicator (NCCL's commId or comm pointer; None where the log does not say)",
    "peer_from": "sending rank",
    "peer_to": "receiving rank (None for CollNet/NVLS, which have no single peer)",
    "kind": "ring, tree, nvls, collnet or p2p where the log tells",
    "transport": "normalised transport (P2P/IPC, SHM, NET/IB, NET/IB/GDRDMA, NET/Socket, ...)",
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
