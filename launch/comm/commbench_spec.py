"""The built-in collective sweep described without torch: what it runs, on which ranks, and its result file.

`run.mode = "commbench"` times all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and
ring send/recv (OPS) over message sizes min_bytes, min_bytes × step_factor, ... max_bytes
(`sweep_sizes`), out-of-place and in-place (PLACEMENTS), on the groups `groups_of` picks from the
rank grid (launch/config/commbench.py). This module holds those tables, the dtypes and what each backend cannot run on them
(`unsupported`), the message shape of every size in nccl-tests' terms (`shape`), the check of the
recipe's `[commbench]` settings that resolve.py runs before any rank starts (`check`), and the
result format: the rows and document of `commbench/<op>.json` and its twin `commbench/<op>.txt` in
nccl-tests' text layout (`write_result`, `read_result`; the paths are launch/run/rundir.py's).

The rank program that measures (launch/ranks/commbench.py) imports it; so do the resolver, the nccl-tests
runner and analysis, which must not import torch.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from launch import inputs
from launch.comm.nccl_format import (
    BUS_FACTORS,
    NCCL_TESTS_OP,
    bus_factor,
    format_nccl_tests,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
REDUCING = frozenset({"all_reduce", "reduce_scatter"})
CHUNKED = frozenset({"all_gather", "reduce_scatter", "all_to_all"})  # the message is n equal per-rank chunks
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum", "send_recv": "sum",  # nccl-tests' sendrecv loops over redops
         "all_gather": "none", "all_to_all": "none", "broadcast": "none"}
ROOT = 0  # broadcast root, as a rank of the group
MiB = 1 << 20
DEFAULT_MAX_BYTES_GPU = 256 * MiB
DEFAULT_MAX_BYTES_CPU = 4 * MiB  # gloo moves ~1 GB/s: a full sweep of all six ops stays within seconds
PLACEMENTS = ("out-of-place", "in-place")
RESULT_VERSION = 1


@dataclass(frozen=True)
class DType:
    torch_name: str
    nccl_tests_name: str  # as nccl-tests prints it in the `type` column
    size: int
    exact: int  # every integer of magnitude <= exact is representable, so sums within it are order-independent
    unsigned: bool = False


DTYPES: dict[str, DType] = {
    "float32": DType("float32", "float", 4, 2**24),
    "bfloat16": DType("bfloat16", "bfloat16", 2, 2**8),
    "float16": DType("float16", "half", 2, 2**11),
    "float64": DType("float64", "double", 8, 2**53),
    "int8": DType("int8", "int8", 1, 127),
    "uint8": DType("uint8", "uint8", 1, 255, unsigned=True),
    "int32": DType("int32", "int32", 4, 2**31 - 1),
    "int64": DType("int64", "int64", 8, 2**63 - 1),
    "float8_e4m3": DType("float8_e4m3fn", "f8e4m3", 1, 16),
    "float8_e5m2": DType("float8_e5m2", "f8e5m2", 1, 8),
}


def backend_of(device_type: str) -> str:
    """The collective backend of ranks computing on `device_type` (HardwareProfile.device_type)."""
    return "gloo" if device_type == "cpu" else "nccl"


def default_max_bytes(device_type: str) -> int:
    return DEFAULT_MAX_BYTES_CPU if device_type == "cpu" else DEFAULT_MAX_BYTES_GPU


def unsupported(backend: str, op: str, dtype: str) -> str | None:
    """Why `backend` cannot run `op` on `dtype` through torch.distributed, or None.

    gloo, measured with torch 2.13 on 2 and 4 ranks: all six collectives give exact results for
    float32, bfloat16, float16, float64, int8, uint8, int32 and int64; for float8 (and int16,
    uint32, uint64) every collective fails with "Invalid scalar type" and only send/recv, which
    moves raw bytes, works. NCCL: torch's process group maps float8 to NCCL types but refuses
    float8 reductions (ProcessGroupNCCL: "Float8 dtypes are not currently supported for NCCL reductions").
    """
    if not dtype.startswith("float8"):
        return None
    if backend == "gloo" and op != "send_recv":
        return f"cannot run {op} on gloo: torch 2.13's gloo has no float8 kernels (\"Invalid scalar type\"; only send_recv works)"
    if backend == "nccl" and op in REDUCING:
        return f"cannot run {op} on NCCL: torch's NCCL process group refuses float8 reductions"
    return None


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """Message sizes as nccl-tests steps them (`-b min -e max -f factor`)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    return sizes


@dataclass(frozen=True)
class Shape:
    """One message size of one collective on n ranks, in nccl-tests' terms (common.cu setupArgs)."""

    size_bytes: int  # printed size: the larger of the send and receive buffers
    count: int  # printed count: elements per rank chunk for chunked collectives, else the message
    in_numel: int  # elements each rank sends (out-of-place input)
    out_numel: int  # elements each rank receives (out-of-place output)

    @property
    def buf_numel(self) -> int:
        """Elements of the one buffer an in-place call works on."""
        return max(self.in_numel, self.out_numel)


def shape(op: str, size: int, elem_size: int, n: int) -> Shape | None:
    """The message a `size`-byte step moves, rounded down to whole elements (None: less than one)."""
    count = size // elem_size
    if op in CHUNKED:
        per = count // n
        if per == 0:
            return None
        whole = per * n
        ins, outs = {"all_gather": (per, whole), "reduce_scatter": (whole, per), "all_to_all": (whole, whole)}[op]
        return Shape(whole * elem_size, per, ins, outs)
    return Shape(count * elem_size, count, count, count) if count else None


def shapes(op: str, sizes: Sequence[int], elem_size: int, n: int) -> list[Shape]:
    return [s for s in (shape(op, size, elem_size, n) for size in sizes) if s is not None]


# --------------------------------------------------------------------------- the result file


def result_rows(op: str, plan: Sequence[Shape], sums: list, dtype: DType, n: int, participants: int) -> list[dict]:
    """`nccl_tests` table rows from [size][placement] = (seconds summed over ranks, wrong elements)."""
    factor = bus_factor(NCCL_TESTS_OP[op], n)
    rows = []
    for s, per_size in zip(plan, sums):
        for placement, (time_sum, wrong) in zip(PLACEMENTS, per_size):
            seconds = time_sum / participants
            # 0 when an interleaved call was below the noise of the work around it on every rank (shown as inf).
            algbw = s.size_bytes / seconds / 1e9 if seconds > 0 else math.inf
            rows.append({"size_bytes": s.size_bytes, "count": s.count, "dtype": dtype.nccl_tests_name,
                         "redop": REDOP[op], "root": ROOT if op == "broadcast" else -1, "placement": placement,
                         "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                         "wrong": int(wrong)})
    return rows


def result_document(op: str, rows: list[dict], cb, *, hardware_profile: str, backend: str,
                    groups: Sequence[Sequence[int]], devices: list[dict], torch_version: str,
                    nccl_version: str | None) -> dict:
    """The contents of `commbench/<op>.json`; `cb` is the resolved recipe's `[commbench]` section
    (launch.config.schema.CommbenchSection, read by attribute: comm sits below config); `devices` are the nccl-tests
    device lines of the group holding rank 0."""
    n = len(groups[0])
    return {
        "version": RESULT_VERSION,
        "op": op,
        "nccl_tests_op": NCCL_TESTS_OP[op],
        "backend": backend,
        "hardware_profile": hardware_profile,
        "torch_version": torch_version,
        "nccl_version": nccl_version,
        "dtype": cb.dtype,
        "group": "ranks" if cb.ranks else cb.group,
        "groups": [list(g) for g in groups],
        "group_size": n,
        "participants": sum(len(g) for g in groups),
        "bus_factor": bus_factor(NCCL_TESTS_OP[op], n),
        "bus_factor_formula": BUS_FACTORS[NCCL_TESTS_OP[op]][0],
        "min_bytes": cb.min_bytes, "max_bytes": cb.max_bytes, "step_factor": cb.step_factor,
        "warmup_iters": cb.warmup_iters, "iters": cb.iters, "interleave_us": cb.interleave_us,
        "devices": devices,
        "rows": rows,
        "avg_busbw_GBps": statistics.fmean(r["busbw_GBps"] for r in rows),
        "out_of_bounds": sum(r["wrong"] for r in rows),
    }


def nccl_tests_header(result: dict) -> dict:
    """The nccl-tests header facts of a result: what `format_nccl_tests` prints above the rows."""
    return {"nthreads": 1, "ngpus": 1, "min_bytes": result["min_bytes"], "max_bytes": result["max_bytes"],
            "step_factor": result["step_factor"], "warmup_iters": result["warmup_iters"], "iters": result["iters"],
            "agg_iters": 1, "validation": 1, "graph": 0, "devices": result["devices"],
            "nccl_version": result["nccl_version"], "avg_busbw_GBps": result["avg_busbw_GBps"]}


def write_result(run, result: dict) -> None:
    """`commbench/<op>.json` (unrounded) and `commbench/<op>.txt` (nccl-tests' text layout) of one result, at the
    paths the run directory `run` (launch.run.rundir.RunDir: comm sits below run) gives."""
    op = result["op"]
    run.commbench.mkdir(parents=True, exist_ok=True)
    run.write_text_atomic(run.commbench_json(op), json.dumps(result, indent=2) + "\n")
    run.write_text_atomic(run.commbench_text(op), format_nccl_tests(result["nccl_tests_op"], result["rows"],
                                                                    nccl_tests_header(result)))


def read_result(path: str | Path) -> dict:
    """A `commbench/<op>.json` that `write_result` wrote; ValueError naming what is wrong with any other file (a FIFO
    is not opened: it would block, and `busbw DIR` reads whatever a folder holds)."""
    data = inputs.load_json(path, numbers=False)  # an α–β point may be Infinity
    if inputs.unusable(data):
        raise ValueError(f"{path}: {data}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: is not a JSON object")
    if data.get("version") != RESULT_VERSION:
        raise ValueError(f"{path}: commbench result version {data.get('version')!r}, this code reads {RESULT_VERSION}")
    return data
