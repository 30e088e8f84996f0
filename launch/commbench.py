"""Built-in collective sweep: `bash launch/run.sh recipes/NAME run.mode=commbench`.

Every rank of the recipe's layout (gloo on the CPU profile, NCCL on GPUs) times all_reduce,
all_gather, reduce_scatter, all_to_all, broadcast and ring send/recv over message sizes
min_bytes, min_bytes × step_factor, ... max_bytes, out-of-place and in-place like nccl-tests, and
checks every result element against the expected value of a deterministic input. Rank 0 writes
`commbench/<op>.txt` in nccl-tests' own text layout (launch/nccl_format.py; the analysis parser
reads it back) and `commbench/<op>.json` with the same numbers unrounded (`read_result`).

What the numbers mean, as in nccl-tests: time = mean over the participating ranks of the average
time of `iters` back-to-back calls after `warmup_iters`; algbw = size / time; busbw = algbw ×
bus_factor(op, n) for a group of n ranks; #wrong = elements that differ from the expected result,
summed over the participating ranks. With `group = "tp" | "dp" | "pp"` every such group runs at
once (as in training) and the text describes the group holding rank 0.

torch offers some collectives in one form only, so one placement includes a local copy of the
message (timed): all_reduce and broadcast work in place, so out-of-place copies the input into the
output first; all_to_all and send/recv cannot alias their buffers (torch 2.13's gloo returns wrong
data when they do, measured; NCCL does not support it either), so in-place receives into a scratch
buffer and copies back.

This module imports torch only inside the functions that run on a rank, so that resolve.py can
read the tables below at planning time.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from launch.grid import RankGrid
from launch.nccl_format import BUS_FACTORS, bus_factor, format_nccl_tests
from launch.rundir import RunDir

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
NCCL_TESTS_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                 "all_to_all": "alltoall", "broadcast": "broadcast", "send_recv": "sendrecv"}
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


def backend_of(profile_name: str) -> str:
    return "gloo" if profile_name == "cpu" else "nccl"


def default_max_bytes(profile_name: str) -> int:
    return DEFAULT_MAX_BYTES_CPU if profile_name == "cpu" else DEFAULT_MAX_BYTES_GPU


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


def groups_of(cb, grid: RankGrid) -> tuple[tuple[int, ...], ...]:
    """The groups the sweep runs on at once (a `CommbenchSection` on a rank grid); other ranks wait."""
    if cb.ranks:
        return (tuple(cb.ranks),)
    if cb.group == "world":
        return (tuple(range(grid.world)),)
    if cb.group == "inter_node":
        return (tuple(node * grid.gpus_per_node for node in range(grid.nodes)),)
    return tuple(grid.all_groups(cb.group))


def value_plan(dtype: DType, summed: int) -> tuple[int, int, int]:
    """(lo, span, poison) of the deterministic input: values lo .. lo+span-1, chosen so that a sum of
    `summed` of them is exact in `dtype` in any order; `poison` (written into every output before a
    checked call) lies outside every expected result, so an element the collective did not write
    counts as wrong."""
    limit = min(dtype.exact // summed, 500)
    if limit == 0:
        return 0, 1, 1
    lo, span = (0, limit) if dtype.unsigned else (-limit, 2 * limit)
    return lo, span, summed * limit


# --------------------------------------------------------------------------- inputs and expected results (torch)


def pattern(q: int, start: int, numel: int, lo: int, span: int, device=None):
    """Input elements start .. start+numel-1 of group rank q (int64)."""
    import torch

    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return (idx + (31 * q + 3)) % span + lo


def expected_output(op: str, r: int, n: int, s: Shape, lo: int, span: int, device=None):
    """What group rank r must hold after `op` when every rank q sent `pattern(q, 0, s.in_numel)` (int64)."""
    import torch

    c = s.count
    if op == "all_reduce":
        return sum(pattern(q, 0, c, lo, span, device) for q in range(n))
    if op == "all_gather":
        return torch.cat([pattern(q, 0, c, lo, span, device) for q in range(n)])
    if op == "reduce_scatter":
        return sum(pattern(q, r * c, c, lo, span, device) for q in range(n))
    if op == "all_to_all":
        return torch.cat([pattern(j, r * c, c, lo, span, device) for j in range(n)])
    if op == "broadcast":
        return pattern(ROOT, 0, c, lo, span, device)
    if op == "send_recv":
        return pattern((r - 1) % n, 0, c, lo, span, device)
    raise ValueError(f"expected_output: unknown collective {op!r}")


def count_wrong(out, expected) -> int:
    """Elements of `out` (any dtype) that differ from `expected` (int64): nccl-tests' #wrong."""
    import torch

    return int((out.to(torch.float64) != expected.to(torch.float64)).sum())


def put(view, values) -> None:
    """Write int64 `values` into `view` of any dtype (via float32: exact for the small integers used)."""
    import torch

    view.copy_(values.to(torch.float32))


# --------------------------------------------------------------------------- one op on one rank (torch)


class Collective:
    """The out-of-place and in-place calls of `op` for group rank r of `members`, on preallocated buffers."""

    def __init__(self, op: str, group, members: Sequence[int], r: int) -> None:
        self.op, self.group, self.members, self.r, self.n = op, group, tuple(members), r, len(members)

    def out_of_place(self, send, recv, scratch, s: Shape) -> Callable[[], None]:
        import torch.distributed as dist

        op, g, r = self.op, self.group, self.r
        inp, out = send[:s.in_numel], recv[:s.out_numel]
        if op == "all_reduce":
            return lambda: (out.copy_(inp), dist.all_reduce(out, group=g))
        if op == "all_gather":
            return lambda: dist.all_gather_single(out, inp, group=g)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_single(out, inp, group=g)
        if op == "all_to_all":
            return lambda: dist.all_to_all_single(out, inp, group=g)
        if op == "broadcast":
            root = self.members[ROOT]
            if r == ROOT:
                return lambda: (out.copy_(inp), dist.broadcast(out, root, group=g))
            return lambda: dist.broadcast(out, root, group=g)
        return lambda: self._ring(inp, out)

    def in_place(self, send, recv, scratch, s: Shape) -> Callable[[], None]:
        import torch.distributed as dist

        op, g, r, c = self.op, self.group, self.r, s.count
        buf = recv[:s.buf_numel]
        if op == "all_reduce":
            return lambda: dist.all_reduce(buf, group=g)
        if op == "all_gather":
            return lambda: dist.all_gather_single(buf, buf[r * c:(r + 1) * c], group=g)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_single(buf[r * c:(r + 1) * c], buf, group=g)
        if op == "broadcast":
            return lambda: dist.broadcast(buf, self.members[ROOT], group=g)
        tmp = scratch[:s.buf_numel]
        if op == "all_to_all":
            return lambda: (dist.all_to_all_single(tmp, buf, group=g), buf.copy_(tmp))
        return lambda: (self._ring(buf, tmp), buf.copy_(tmp))

    def _ring(self, src, dst) -> None:
        import torch.distributed as dist

        nxt, prv = self.members[(self.r + 1) % self.n], self.members[(self.r - 1) % self.n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, src, nxt, self.group),
                                            dist.P2POp(dist.irecv, dst, prv, self.group)]):
            work.wait()

    def load_input(self, placement: str, send, recv, s: Shape, lo: int, span: int, poison: int) -> None:
        """Fill what the call reads with this rank's pattern and what it writes with poison."""
        mine = pattern(self.r, 0, s.in_numel, lo, span, send.device)
        if placement == "out-of-place":
            put(send[:s.in_numel], mine)
            recv[:s.out_numel].fill_(poison)
            return
        buf = recv[:s.buf_numel]
        buf.fill_(poison)
        if self.op == "all_gather":
            put(buf[self.r * s.count:(self.r + 1) * s.count], mine)
        else:
            put(buf[:s.in_numel], mine)

    def result(self, placement: str, recv, s: Shape):
        if placement == "out-of-place":
            return recv[:s.out_numel]
        if self.op == "reduce_scatter":
            return recv[self.r * s.count:(self.r + 1) * s.count]
        return recv[:s.out_numel]


# --------------------------------------------------------------------------- the rank program


def main(run_dir: str) -> int:
    """Entry point on every rank (launch/train.py dispatches here when run.mode = "commbench")."""
    from launch.resolve import Resolved
    from launch.trainers import common

    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)
    env = common.rank_env()
    terminal = common.redirect_logs(run, env.rank)
    cuda = resolved.hardware.name != "cpu"
    if cuda:
        os.environ.setdefault("NCCL_DEBUG_FILE", str(run.nccl_log(env.rank)))
    watchdog = common.Watchdog(env.rank, float(resolved.recipe.run.timeout_s), terminal if env.rank == 0 else None)
    try:
        return _sweep(run, resolved, env, terminal if env.rank == 0 else None, cuda, watchdog)
    except BaseException as e:  # noqa: BLE001 - name the rank and the step, then let torchrun stop the others
        msg = common.fail_message(env.rank, watchdog.step, e)
        print(msg, file=sys.stderr, flush=True)
        print(msg, file=terminal, flush=True)
        raise
    finally:
        watchdog.stop()


def _sweep(run: RunDir, resolved, env, terminal, cuda: bool, watchdog) -> int:
    import torch
    import torch.distributed as dist

    from launch.trainers.common import ProgressLine

    cb = resolved.recipe.commbench
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=resolved.recipe.run.timeout_s),
                            device_id=device if cuda else None)
    if dist.get_world_size() != resolved.world_size:
        raise RuntimeError(f"started with {dist.get_world_size()} ranks but resolved.json expects {resolved.world_size}")
    groups = groups_of(cb, resolved.grid)
    # Every rank creates every group, in the same order (torch.distributed.new_group's contract).
    handles = [None] if cb.group == "world" and not cb.ranks else [dist.new_group(list(g)) for g in groups]
    mine = next((i for i, g in enumerate(groups) if env.rank in g), None)
    infos: list[Any] = [None] * resolved.world_size
    dist.all_gather_object(infos, _device_info(env, cuda, mine))
    if env.rank == 0:
        print(f"commbench: {len(groups)} group(s) of {len(groups[0])} rank(s): {[list(g) for g in groups]}", flush=True)

    dtype = DTYPES[cb.dtype]
    sizes = sweep_sizes(cb.min_bytes, cb.max_bytes, cb.step_factor)
    n = len(groups[0])
    plan = {op: shapes(op, sizes, dtype.size, n) for op in cb.ops}
    progress = ProgressLine(terminal, sum(len(p) for p in plan.values()), 0, "commbench")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, wrong_total, summary = 0, 0, []
    for op in cb.ops:
        local = torch.zeros((len(plan[op]), len(PLACEMENTS), 2), dtype=torch.float64, device=device)
        coll = None
        if mine is not None:
            members = groups[mine]
            coll = Collective(op, handles[mine], members, members.index(env.rank))
        send, recv, scratch = _buffers(plan[op], dtype, device, torch)
        lo, span, poison = value_plan(dtype, n if op in REDUCING else 1)
        for k, s in enumerate(plan[op]):
            step += 1
            watchdog.beat(step, f"{op} {s.size_bytes} B")
            if coll is not None:
                for p, placement in enumerate(PLACEMENTS):
                    local[k, p, 0], local[k, p, 1] = _measure(coll, placement, send, recv, scratch, s,
                                                              (lo, span, poison), cb, sync)
            dist.barrier()  # ranks outside the groups wait here, one size at a time, within run.timeout_s
            progress.update(step, f"{op} {_human(s.size_bytes)}")
        dist.all_reduce(local)  # sums over the participating ranks; the others added zeros
        del send, recv, scratch  # before the next op allocates its own: one set of buffers at a time
        if env.rank == 0:
            rows = result_rows(op, plan[op], local.tolist(), dtype, n, sum(len(g) for g in groups))
            result = _result(op, rows, cb, dtype, resolved, groups, infos, cuda)
            write_result(run, result)
            wrong = result["out_of_bounds"]
            wrong_total += wrong
            summary.append(f"  {op:<15} n={n}  peak busbw {max(r['busbw_GBps'] for r in rows):10.3f} GB/s  "
                           f"#wrong {wrong}  -> {run.commbench_text(op)}")
    progress.close()
    dist.barrier()
    dist.destroy_process_group()
    if env.rank == 0:
        print("commbench results (time: mean over ranks; busbw = algbw × nccl-tests' bus factor):", file=terminal)
        print("\n".join(summary), file=terminal, flush=True)
        if wrong_total:
            msg = (f"layoutlab: rank 0: commbench found {wrong_total} wrong result elements; the #wrong column of "
                   f"{run.commbench} says where")
            print(msg, file=sys.stderr, flush=True)
            print(msg, file=terminal, flush=True)
    return 1 if wrong_total else 0


def _buffers(plan: Sequence[Shape], dtype: DType, device, torch):
    """nccl-tests' send and receive buffers at the largest size (every size uses their prefix), plus the
    scratch buffer that in-place all_to_all and send/recv receive into."""
    td = getattr(torch, dtype.torch_name)
    send = torch.empty(max((s.in_numel for s in plan), default=0), dtype=td, device=device)
    recv = torch.empty(max((s.buf_numel for s in plan), default=0), dtype=td, device=device)
    scratch = torch.empty(max((s.buf_numel for s in plan), default=0), dtype=td, device=device)
    return send, recv, scratch


def _measure(coll: Collective, placement: str, send, recv, scratch, s: Shape, values: tuple[int, int, int],
             cb, sync: Callable[[], None]) -> tuple[float, int]:
    """(seconds per call, wrong elements) of one placement at one size on this rank."""
    import torch.distributed as dist

    lo, span, poison = values
    call = (coll.out_of_place if placement == "out-of-place" else coll.in_place)(send, recv, scratch, s)
    coll.load_input(placement, send, recv, s, lo, span, poison)
    for _ in range(cb.warmup_iters):
        call()
    sync()
    dist.barrier(group=coll.group)  # start the timed calls together
    t0 = time.perf_counter()
    for _ in range(cb.iters):
        call()
    sync()
    seconds = (time.perf_counter() - t0) / cb.iters
    # Repeated in-place calls compound the data (an in-place all_reduce sums its own output), so the
    # check is one fresh call on freshly written input.
    coll.load_input(placement, send, recv, s, lo, span, poison)
    call()
    sync()
    return seconds, count_wrong(coll.result(placement, recv, s), expected_output(coll.op, coll.r, coll.n, s, lo, span,
                                                                                 recv.device))


def result_rows(op: str, plan: Sequence[Shape], sums: list, dtype: DType, n: int, participants: int) -> list[dict]:
    """`nccl_tests` table rows from [size][placement] = (seconds summed over ranks, wrong elements)."""
    factor = bus_factor(NCCL_TESTS_OP[op], n)
    rows = []
    for s, per_size in zip(plan, sums):
        for placement, (time_sum, wrong) in zip(PLACEMENTS, per_size):
            seconds = time_sum / participants
            algbw = s.size_bytes / seconds / 1e9
            rows.append({"size_bytes": s.size_bytes, "count": s.count, "dtype": dtype.nccl_tests_name,
                         "redop": REDOP[op], "root": ROOT if op == "broadcast" else -1, "placement": placement,
                         "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                         "wrong": int(wrong)})
    return rows


def _result(op: str, rows: list[dict], cb, dtype: DType, resolved, groups, infos, cuda: bool) -> dict:
    import torch

    n = len(groups[0])
    return {
        "version": RESULT_VERSION,
        "op": op,
        "nccl_tests_op": NCCL_TESTS_OP[op],
        "backend": "nccl" if cuda else "gloo",
        "hardware_profile": resolved.hardware.name,
        "torch_version": torch.__version__,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "dtype": cb.dtype,
        "group": "ranks" if cb.ranks else cb.group,
        "groups": [list(g) for g in groups],
        "group_size": n,
        "participants": sum(len(g) for g in groups),
        "bus_factor": bus_factor(NCCL_TESTS_OP[op], n),
        "bus_factor_formula": BUS_FACTORS[NCCL_TESTS_OP[op]][0],
        "min_bytes": cb.min_bytes, "max_bytes": cb.max_bytes, "step_factor": cb.step_factor,
        "warmup_iters": cb.warmup_iters, "iters": cb.iters,
        "devices": [infos[m] for m in groups[0]],
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


def write_result(run: RunDir, result: dict) -> None:
    op = result["op"]
    run.commbench.mkdir(parents=True, exist_ok=True)
    run.write_text_atomic(run.commbench_json(op), json.dumps(result, indent=2) + "\n")
    run.write_text_atomic(run.commbench_text(op), format_nccl_tests(result["nccl_tests_op"], result["rows"],
                                                                    nccl_tests_header(result)))


def read_result(path: str | Path) -> dict:
    """A `commbench/<op>.json` this module wrote."""
    data = json.loads(Path(path).read_text())
    if data.get("version") != RESULT_VERSION:
        raise ValueError(f"{path}: commbench result version {data.get('version')!r}, this code reads {RESULT_VERSION}")
    return data


def _device_info(env, cuda: bool, group_index: int | None) -> dict:
    """This rank's nccl-tests device line: `Rank R Group G Pid P on HOST device D [BUSID] NAME`."""
    if cuda:
        import torch

        props = torch.cuda.get_device_properties(env.local_rank)
        busid, name = f"0x{props.pci_bus_id:x}", props.name
    else:
        busid, name = "cpu", "CPU rank (gloo)"
    return {"rank": env.rank, "group": group_index, "pid": os.getpid(), "host": socket.gethostname(),
            "device": env.local_rank, "busid": busid, "name": name}


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
