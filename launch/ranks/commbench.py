"""Built-in collective sweep: `bash launch/run.sh recipes/NAME run.mode=commbench`.

Every rank of the recipe's layout (gloo on the CPU profile, NCCL on GPUs) times all_reduce,
all_gather, reduce_scatter, all_to_all, broadcast and ring send/recv over message sizes
min_bytes, min_bytes × step_factor, ... max_bytes, out-of-place and in-place like nccl-tests, and
checks every result element against the expected value of a deterministic input. Rank 0 writes
`commbench/<op>.txt` in nccl-tests' own text layout (launch/comm/nccl_format.py; the analysis parser
reads it back) and `commbench/<op>.json` with the same numbers unrounded (`read_result`).

What the numbers mean, as in nccl-tests: time = mean over the participating ranks of the average
time of `iters` back-to-back calls after `warmup_iters` (with `interleave_us`: each call after that much matmul
work, whose time alone is subtracted: a call as a training step meets it); algbw = size / time; busbw = algbw ×
bus_factor(op, n) for a group of n ranks; #wrong = elements that differ from the expected result,
summed over the participating ranks. With `group = "tp" | "dp" | "pp"` every such group runs at
once (as in training) and the text describes the group holding rank 0.

torch offers some collectives in one form only, so one placement includes a local copy of the
message (timed): all_reduce and broadcast work in place, so out-of-place copies the input into the
output first; all_to_all and send/recv cannot alias their buffers (torch 2.13's gloo returns wrong
data when they do, measured; NCCL does not support it either), so in-place receives into a scratch
buffer and copies back.

The tables, sizes, groups, settings check and result file format live in launch/comm/commbench_spec.py
(torch-free, read at planning and analysis time); this module is the rank program only, imported by
the rank entry point launch/ranks/train.py.
"""
from __future__ import annotations

import datetime as dt
import os
import socket
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from launch.comm.commbench_spec import (
    DTYPES,
    PLACEMENTS,
    REDUCING,
    ROOT,
    DType,
    Shape,
    result_document,
    result_rows,
    shapes,
    sweep_sizes,
    write_result,
)
from launch.config.commbench import groups_of
from launch.config.resolve import Resolved
from launch.ranks.trainers import common
from launch.run.rundir import RunDir
from launch.units import human_bytes


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
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return (idx + (31 * q + 3)) % span + lo


def expected_output(op: str, r: int, n: int, s: Shape, lo: int, span: int, device=None):
    """What group rank r must hold after `op` when every rank q sent `pattern(q, 0, s.in_numel)` (int64)."""
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
    return int((out.to(torch.float64) != expected.to(torch.float64)).sum())


def put(view, values) -> None:
    """Write int64 `values` into `view` of any dtype (via float32: exact for the small integers used)."""
    view.copy_(values.to(torch.float32))


# --------------------------------------------------------------------------- one op on one rank (torch)


class Collective:
    """The out-of-place and in-place calls of `op` for group rank r of `members`, on preallocated buffers."""

    def __init__(self, op: str, group, members: Sequence[int], r: int) -> None:
        self.op, self.group, self.members, self.r, self.n = op, group, tuple(members), r, len(members)

    def out_of_place(self, send, recv, scratch, s: Shape) -> Callable[[], None]:
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
    """Entry point on every rank (launch/ranks/train.py dispatches here when run.mode = "commbench")."""
    return common.run_rank(run_dir, _sweep)


def _sweep(run: RunDir, resolved, env, terminal, cuda: bool, watchdog) -> int:
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
    progress = common.ProgressLine(terminal, sum(len(p) for p in plan.values()), 0, "commbench")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, wrong_total, summary = 0, 0, []
    for op in cb.ops:
        local = torch.zeros((len(plan[op]), len(PLACEMENTS), 2), dtype=torch.float64, device=device)
        coll = None
        if mine is not None:
            members = groups[mine]
            coll = Collective(op, handles[mine], members, members.index(env.rank))
        send, recv, scratch = _buffers(plan[op], dtype, device)
        lo, span, poison = value_plan(dtype, n if op in REDUCING else 1)
        for k, s in enumerate(plan[op]):
            step += 1
            watchdog.beat(step, f"{op} {s.size_bytes} B")
            if coll is not None:
                for p, placement in enumerate(PLACEMENTS):
                    local[k, p, 0], local[k, p, 1] = _measure(coll, placement, send, recv, scratch, s,
                                                              (lo, span, poison), cb, sync)
            dist.barrier()  # ranks outside the groups wait here, one size at a time, within run.timeout_s
            progress.update(step, f"{op} {human_bytes(s.size_bytes)}")
        dist.all_reduce(local)  # sums over the participating ranks; the others added zeros
        del send, recv, scratch  # before the next op allocates its own: one set of buffers at a time
        if env.rank == 0:
            rows = result_rows(op, plan[op], local.tolist(), dtype, n, sum(len(g) for g in groups))
            result = _result(op, rows, cb, resolved, groups, infos, cuda)
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


def _buffers(plan: Sequence[Shape], dtype: DType, device):
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
    lo, span, poison = values
    call = (coll.out_of_place if placement == "out-of-place" else coll.in_place)(send, recv, scratch, s)
    coll.load_input(placement, send, recv, s, lo, span, poison)
    for _ in range(cb.warmup_iters):
        call()
    sync()
    work = _interleave_work(coll, cb.interleave_us, recv.device, sync)
    dist.barrier(group=coll.group)  # start the timed calls together
    t0 = time.perf_counter()
    for _ in range(cb.iters):
        work()
        call()
    sync()
    seconds = (time.perf_counter() - t0) / cb.iters
    if cb.interleave_us:
        dist.barrier(group=coll.group)
        t0 = time.perf_counter()
        for _ in range(cb.iters):
            work()
        sync()
        seconds = max(0.0, seconds - (time.perf_counter() - t0) / cb.iters)
    # Repeated in-place calls compound the data (an in-place all_reduce sums its own output), so the
    # check is one fresh call on freshly written input.
    coll.load_input(placement, send, recv, s, lo, span, poison)
    call()
    sync()
    return seconds, count_wrong(coll.result(placement, recv, s), expected_output(coll.op, coll.r, coll.n, s, lo, span,
                                                                                 recv.device))


def _interleave_work(coll: Collective, interleave_us: float, device, sync: Callable[[], None]) -> Callable[[], None]:
    """A fixed amount of matmul work taking about `interleave_us` on the slowest rank of the group (the same count
    everywhere, so ranks drift apart as they do in a step), or nothing."""
    if not interleave_us:
        return lambda: None
    a = torch.randn(96, 96, device=device)
    a @ a
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    sync()
    per = torch.tensor([(time.perf_counter() - t0) / 20], dtype=torch.float64, device=device)
    dist.all_reduce(per, op=dist.ReduceOp.MAX, group=coll.group)
    count = max(1, round(interleave_us * 1e-6 / float(per)))

    def work() -> None:
        for _ in range(count):
            a @ a
    return work


def _result(op: str, rows: list[dict], cb, resolved: Resolved, groups, infos, cuda: bool) -> dict:
    return result_document(op, rows, cb, hardware_profile=resolved.hardware.name, backend="nccl" if cuda else "gloo",
                           groups=groups, devices=[infos[m] for m in groups[0]], torch_version=torch.__version__,
                           nccl_version=".".join(map(str, torch.cuda.nccl.version())) if cuda else None)


def _device_info(env, cuda: bool, group_index: int | None) -> dict:
    """This rank's nccl-tests device line: `Rank R Group G Pid P on HOST device D [BUSID] NAME`."""
    if cuda:
        props = torch.cuda.get_device_properties(env.local_rank)
        busid, name = f"0x{props.pci_bus_id:x}", props.name
    else:
        busid, name = "cpu", "CPU rank (gloo)"
    return {"rank": env.rank, "group": group_index, "pid": os.getpid(), "host": socket.gethostname(),
            "device": env.local_rank, "busid": busid, "name": name}
