"""Present an Nsight Systems timeline (analysis.parsers.nsys) as a Kineto-shaped table.

`analysis.analyzers.trace_analysis` computes HTA's temporal breakdown, overlap, exposed communication,
collective counts and stragglers from a Kineto table. An nsys export holds the same facts under
other names, so instead of a second implementation this module renames them:

| Kineto column   | from the nsys row                                                               |
|-----------------|---------------------------------------------------------------------------------|
| rank            | the caller's rank for the file; else the process's position among the file's    |
|                 | processes that launched GPU work, in pid order (stated in meta.rank_from)       |
| stream          | the CUDA stream of kernels / memcpy / memset; None for CPU rows                 |
| category        | kernel, gpu_memcpy, gpu_memset (GPU); cuda_runtime; user_annotation (NVTX)      |
| name            | as in nsys, except an NVTX range that names a step ('step 3', 'iteration 3',    |
|                 | 'ProfilerStep#3') becomes 'ProfilerStep#3', the name trace_analysis scopes by   |
| ts_us, dur_us   | start_ns / 1000, dur_ns / 1000 (exact: no HTA rounding, meta ts_float False)    |
| kind            | nsys's kind: HTA's rule from analysis.parsers.gpu_kernels, the Kineto parser's own       |
|                 | (^nccl.*Kernel communication, memcpy/memset memory, Sync other, the rest compute) |
| collective      | nsys's collective (all_reduce, all_gather, reduce_scatter, send_recv, ...)      |
| correlation,    | CUPTI correlation id and the launching call's start: trace_analysis keeps a GPU |
| launch_ts_us    | activity in a step when its launch lies in it, as HTA does                      |
| pid, tid        | GPU rows: device and stream; CPU rows: process and thread                       |
| message_bytes,  | None: nsys records no collective sizes, so bus bandwidth is unknown             |
| group, group_size |                                                                               |

NVTX ranges still open when capture stopped (no end) and rows without a start are dropped.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from analysis.parsers.kineto import COLUMNS as KINETO_COLUMNS
from analysis.parsers.kineto import KinetoMeta, KinetoRanksMeta
from analysis.parsers.nsys import step_number
from analysis.table import Table

_CATEGORY = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset", "cuda_runtime": "cuda_runtime",
             "nvtx": "user_annotation"}


def as_kineto(tables: Iterable[Table], *, ranks: Mapping[str, int] | None = None) -> Table:
    """One Kineto-shaped table from the `nsys` tables of one run (one file per node or per rank).

    `ranks` maps a table's source to its rank when each file holds one rank; otherwise ranks are
    numbered over (file, pid) in order, counting only processes that ran GPU work.
    """
    cols: dict[str, list[Any]] = {c: [] for c in KINETO_COLUMNS}
    warnings: list[str] = []
    meta_ranks: dict[int, KinetoMeta] = {}
    sources = []
    next_rank = 0
    for t in tables:
        sources.append(t.source)
        warnings.extend(t.warnings)
        c = t.columns
        gpu_pids = sorted({p for p, cat in zip(c["pid"], c["category"])
                           if cat in ("kernel", "memcpy", "memset") and p is not None})
        given = (ranks or {}).get(t.source)
        rank_of: dict[Any, int] = {}
        for p in gpu_pids:
            if given is not None:
                rank_of[p] = given
            else:
                rank_of[p] = next_rank
                next_rank += 1
        for row in t.rows():
            start, dur = row["start_ns"], row["dur_ns"]
            if start is None or dur is None:
                continue
            pid = row["pid"]
            rank = row["rank"] if row["rank"] is not None else rank_of.get(pid)
            if rank is None:
                continue  # a process that launched no GPU work (a launcher, a data worker)
            gpu = row["category"] in ("kernel", "memcpy", "memset")
            name = row["name"] or ""
            if row["category"] == "nvtx":
                n = step_number(name)
                if n is not None:
                    name = f"ProfilerStep#{n}"
            stream = row["stream"] if gpu else None
            if gpu and stream is None:
                stream = 0
            launch = row["launch_start_ns"]
            values = {
                "rank": rank, "pid": row["device"] if gpu else pid, "tid": stream if gpu else row["tid"],
                "stream": stream, "category": _CATEGORY.get(row["category"], row["category"]), "name": name,
                "ts_us": start / 1000.0, "dur_us": dur / 1000.0, "kind": row["kind"] if gpu else None,
                "collective": row["collective"] if gpu else None, "message_bytes": None, "message_from": None,
                "group": None, "group_size": None, "seq": None, "step": row["step"], "correlation": row["correlation"],
                "launch_ts_us": launch / 1000.0 if gpu and launch is not None else None,
            }
            for k in cols:
                cols[k].append(values[k])
            if rank not in meta_ranks:
                meta_ranks[rank] = KinetoMeta(rank=rank, ts_float=False, source=t.source, pid=pid, pg_config=[],
                                              world_size=None)
    rank_from = ("given per file" if ranks else
                 "position of the process among those that ran GPU work, in file then pid order")
    meta = KinetoRanksMeta(ranks=meta_ranks, world_size=None, rank_from=rank_from, adapted_from="nsys")
    return Table("kineto", cols, dict(KINETO_COLUMNS), ", ".join(sources), tuple(warnings), meta)
