"""The doctor: named pitfalls, each flagged with its evidence (file, numbers) and a fix.

Every rule is a pure function of analyzer tables and returns a list of `Finding`s; `RULES` states the
thresholds. Rules and thresholds:

  warmup_in_window     one of the first 3 measured steps takes > 1.5 x the median of the measured
                       steps after them (at least 5 of those): warm-up (compilation, allocator
                       growth, autotuning) leaked into the measurement
  slow_transport       analysis.parsers.nccl_debug.verdict says 'warn' (NET/Socket where IB was
                       expected, SHM where P2P was expected); its 'info' findings are kept as info
  mismatched_runs      compared runs differ in global batch size or sequence length
  extra_collectives    a collective type runs >= 1 call per layer per step more than the layout
                       explains (analysis.analyzers.collective_calls.expected_collectives)
  no_overlap           the layout lets communication overlap compute (dp > 1, ZeRO-3 or pp > 1;
                       assumed for foreign traces) yet < 30% of communication overlaps and exposed
                       communication is >= 10% of the measured span (median over ranks)
  straggler            analysis.analyzers.trace_analysis.stragglers flags a rank (> 10% slower steps, or
                       > 10% of a step less waiting in collectives than the others)
  late_rank            a rank's late arrivals are >= 75% of the arrival skew of the collective calls matched
                       across ranks (at least 4 calls; analysis.analyzers.arrivals) and arrival skew is >= 10%
                       of those calls' time: everyone waits for it. By time, not by count: a rank 150 ms late
                       once a step outweighs another last by microseconds at every other call
  idle_device          idle >= 20% of the measured span on some rank (GPU: no kernel running; CPU
                       basis: the training thread neither computes nor waits in a collective)
  memory_near_limit    a rank's peak is >= 95% of the device memory
  low_busbw            achieved bus bandwidth of a collective (messages >= 1 MiB when there are
                       any) is < 50% of the nccl-tests ceiling for it; 'info' only when every call
                       is smaller than 1 MiB (latency-bound sizes)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from analysis.parsers.nccl_debug import verdict
from analysis.table import Table

WARMUP_HEAD_STEPS = 3
WARMUP_FACTOR = 1.5
WARMUP_MIN_REST = 5
EXCESS_PER_LAYER = 1.0
OVERLAP_MIN_PCT = 30.0
EXPOSED_MIN_PCT = 10.0
STRAGGLER_PCT = 10.0
LATE_RANK_PCT = 75.0
LATE_RANK_MIN_CALLS = 4
SKEW_MIN_PCT = 10.0
IDLE_PCT = 20.0
MEMORY_LIMIT_PCT = 95.0
BUSBW_MIN_PCT = 50.0

RULES = {
    "warmup_in_window": f"one of the first {WARMUP_HEAD_STEPS} measured steps > {WARMUP_FACTOR} x the median of the "
                        f"later measured steps (>= {WARMUP_MIN_REST} of them)",
    "slow_transport": "NCCL_DEBUG transports: analysis.parsers.nccl_debug.verdict 'warn' findings",
    "mismatched_runs": "compared runs differ in global batch size or sequence length",
    "extra_collectives": f">= {EXCESS_PER_LAYER:g} call per layer per step beyond what the layout explains",
    "no_overlap": f"layout allows overlap, < {OVERLAP_MIN_PCT:g}% of communication overlapped and exposed "
                  f"communication >= {EXPOSED_MIN_PCT:g}% of the span (median over ranks)",
    "straggler": f"trace_analysis.stragglers with threshold {STRAGGLER_PCT:g}%",
    "late_rank": f"a rank's late arrivals are >= {LATE_RANK_PCT:g}% of the arrival skew of the collective calls "
                 f"matched across ranks (at least {LATE_RANK_MIN_CALLS}) and arrival skew is >= {SKEW_MIN_PCT:g}% of "
                 "those calls' time",
    "idle_device": f"idle >= {IDLE_PCT:g}% of the measured span on a rank",
    "memory_near_limit": f"peak >= {MEMORY_LIMIT_PCT:g}% of device memory",
    "low_busbw": f"achieved busbw < {BUSBW_MIN_PCT:g}% of the nccl-tests large-message busbw",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str  # "warn" | "info"
    run: str
    message: str
    evidence: tuple[str, ...]
    fix: str


def _fmt(x: float | None, unit: str = "", digits: int = 3) -> str:
    return "?" if x is None else f"{x:.{digits}g}{unit}"


def warmup_in_window(run: str, step_times: Sequence[tuple[int, float, str]], *, ours: bool) -> list[Finding]:
    """step_times: (step, seconds, source) of the measured window in step order."""
    if len(step_times) < WARMUP_HEAD_STEPS + WARMUP_MIN_REST:
        return []
    head, rest = step_times[:WARMUP_HEAD_STEPS], step_times[WARMUP_HEAD_STEPS:]
    med = statistics.median(t for _, t, _ in rest)
    slow = [(s, t, src) for s, t, src in head if med > 0 and t > WARMUP_FACTOR * med]
    if not slow:
        return []
    last = max(s for s, _, _ in slow)
    fix = (f"raise train.warmup_steps so the measured window starts after step {last} (e.g. "
           f"train.warmup_steps={last})" if ours else
           f"exclude the steps up to {last} from the measurement (start the window after it)")
    return [Finding("warmup_in_window", "warn", run,
                    f"step {slow[0][0]} is {slow[0][1] / med:.1f}x the median step of the measured window: warm-up "
                    f"leaked into the measurement",
                    tuple(f"{src}: step {s} took {t:.4g} s vs median {med:.4g} s of steps {rest[0][0]}-{rest[-1][0]}"
                          for s, t, src in slow), fix)]


def slow_transport(run: str, logs: Iterable[Table], *, expect_net: str | None = None) -> list[Finding]:
    out = []
    for t in logs:
        if not len(t):
            continue
        for f in verdict(t, expect_net=expect_net):
            fix = ("check NCCL_IB_DISABLE / NCCL_NET / NCCL_SOCKET_IFNAME and that the IB plugin and devices are "
                   "visible in the container" if "Socket" in f.message else
                   "unset NCCL_P2P_DISABLE, check PCIe ACS/IOMMU and that containers share IPC (--ipc=host)"
                   if "SHM" in f.message else "load nvidia-peermem; keep GPU and NIC on the same PCIe switch")
            out.append(Finding("slow_transport", f.severity, run, f.message,
                               tuple(f"{t.source} {e}" for e in f.evidence) or (t.source,), fix))
    return out


def mismatched_runs(facts: Sequence[tuple[str, Any, Any, str]]) -> list[Finding]:
    """facts: (run label, global_batch_size, seq_len, source) per run; None where unknown."""
    out = []
    for idx, what, flag in ((1, "global batch size", "batch.global_batch_size"), (2, "sequence length", "batch.seq_len")):
        known = [(f[0], f[idx], f[3]) for f in facts if f[idx] is not None]
        if len({v for _, v, _ in known}) > 1:
            out.append(Finding("mismatched_runs", "warn", ", ".join(lbl for lbl, _, _ in known),
                               f"the compared runs differ in {what}: their throughput and memory do not compare "
                               f"like for like",
                               tuple(f"{src}: {lbl} has {what} {v}" for lbl, v, src in known),
                               f"re-run with the same {what} ({flag}=...); when comparing layouts keep the global "
                               f"batch fixed and let gradient accumulation absorb the data-parallel degree"))
    return out


def extra_collectives(run: str, vs_layout: Table | None) -> list[Finding]:
    if vs_layout is None:
        return []
    out = []
    for r in vs_layout.rows():
        if r["excess_per_layer"] is not None and r["excess_per_layer"] >= EXCESS_PER_LAYER:
            out.append(Finding(
                "extra_collectives", "warn", run,
                f"{r['collective']}: {r['observed_per_step']:.1f} calls per step, the layout explains at most "
                f"{r['expected_max_per_step']} ({r['excess_per_layer']:.1f} extra per layer)",
                (f"{r['source']}: observed {r['observed_per_step']:.1f}/step over {r['layers']} layers; expected "
                 f"{r['expected_min_per_step']}-{r['expected_max_per_step']}/step ({r['why']})",),
                "look for gathers around norms, embeddings or the loss that the parallel plan does not cover "
                "(module not sharded, missing sequence-parallel marking, ZeRO-3 re-gathering a parameter each "
                "use: raise stage3_max_reuse_distance / prefetch bucket)"))
    return out


def no_overlap(run: str, breakdown: Table | None, *, allows: bool | None, why: str) -> list[Finding]:
    if breakdown is None or not len(breakdown) or allows is False:
        return []
    rows = [r for r in breakdown.rows() if r["comm_us"]]
    if not rows:
        return []
    ov = statistics.median(r["overlap_pct"] or 0.0 for r in rows)
    ex = statistics.median(r["exposed_comm_pct"] or 0.0 for r in rows)
    if ov >= OVERLAP_MIN_PCT or ex < EXPOSED_MIN_PCT:
        return []
    basis = {r["basis"] for r in rows}
    cpu = basis == {"cpu_ops"}
    return [Finding(
        "no_overlap", "info" if cpu else "warn", run,
        f"communication barely overlaps computation ({ov:.0f}% overlapped, exposed {ex:.0f}% of the span) although "
        f"{why}",
        tuple(f"{r['source']}: rank {r['rank']} overlap {_fmt(r['overlap_pct'], '%')}, exposed "
              f"{_fmt(r['exposed_comm_pct'], '%')} of {r['span_us'] / 1e3:.1f} ms ({r['basis']})" for r in rows[:4]),
        ("DeepSpeed: zero_optimization.overlap_comm=true, contiguous_gradients=true, a reduce_bucket_size that "
         "lets the first buckets start early; Megatron: --overlap-grad-reduce --overlap-param-gather"
         + ("; on gloo CPU ranks collectives block the training thread, so no overlap is expected there" if cpu else "")))]


def straggler(run: str, table: Table | None) -> list[Finding]:
    if table is None:
        return []
    flagged = [r for r in table.rows() if r["straggler"]]
    if len(table) < 2 or not flagged:
        return []
    return [Finding("straggler", "warn", run,
                    f"rank {r['rank']} stands out: {r['reason']}",
                    (f"{r['source']}: median step {_fmt(r['step_time_us'] / 1e3 if r['step_time_us'] else None, ' ms')}"
                     f" ({_fmt(r['step_excess_pct'], '%')} vs the other ranks), collectives "
                     f"{_fmt(r['comm_time_us'] / 1e3 if r['comm_time_us'] is not None else None, ' ms')}/step "
                     f"({_fmt(r['comm_deficit_pct'], '%')} of a step less waiting than the others)",),
                    "compare the rank's host and device (thermal throttling, a slower link, a busier data "
                    "loader, uneven sequence lengths); profile that rank alone")
            for r in flagged]


def late_rank(run: str, by_rank: Table | None, by_collective: Table | None) -> list[Finding]:
    """by_rank, by_collective: analysis.analyzers.arrivals' tables of the run."""
    if by_rank is None or by_collective is None:
        return []
    skew = sum(r["skew_us"] for r in by_collective.rows())
    total = skew + sum(r["transfer_us"] for r in by_collective.rows())
    if not total or 100.0 * skew / total < SKEW_MIN_PCT:
        return []
    late = [r for r in by_rank.rows() if r["calls"] >= LATE_RANK_MIN_CALLS and 100.0 * r["late_us"] / skew >= LATE_RANK_PCT]
    per_coll = ", ".join(f"{r['collective']} {r['skew_us'] / 1e3:.3g} of {(r['skew_us'] + r['transfer_us']) / 1e3:.3g} "
                         f"ms" for r in by_collective.rows())
    return [Finding("late_rank", "warn", run,
                    f"rank {r['rank']} holds the others up: {100.0 * r['late_us'] / skew:.0f}% of the arrival skew at "
                    f"collectives is waiting for it (it arrives last at {r['last_pct']:.0f}% of the matched calls)",
                    (f"{r['source']}: last at {r['last']} of {r['calls']} calls, {r['late_us'] / 1e3:.3g} ms after the "
                     f"first rank in total",
                     f"{by_collective.source}: arrival skew {skew / 1e3:.3g} ms of the calls' {total / 1e3:.3g} ms "
                     f"({100.0 * skew / total:.0f}%; {per_coll})"),
                    "look at what the rank does before its collectives: its input pipeline, host or device (thermal "
                    "throttling, a busier CPU, a slower link), uneven work (sequence lengths, routing); profile it "
                    "alone")
            for r in late]


def idle_device(run: str, breakdown: Table | None) -> list[Finding]:
    if breakdown is None:
        return []
    idle = [r for r in breakdown.rows() if r["idle_pct"] is not None and r["idle_pct"] >= IDLE_PCT]
    if not idle:
        return []
    worst = max(idle, key=lambda r: r["idle_pct"])
    gpu = worst["basis"] == "gpu_kernels"
    what = ("the GPU runs nothing while the host prepares work" if gpu else
            "the training thread neither computes nor waits in a collective (host-side overhead)")
    return [Finding("idle_device", "warn", run,
                    f"rank {worst['rank']} is idle {worst['idle_pct']:.0f}% of the measured span: {what}",
                    tuple(f"{r['source']}: rank {r['rank']} idle {r['idle_us'] / 1e3:.1f} ms of "
                          f"{r['span_us'] / 1e3:.1f} ms ({r['idle_pct']:.1f}%, {r['basis']})" for r in idle[:4]),
                    "input-bound: more DataLoader workers, pinned memory, prefetching; launch-bound: larger "
                    "micro-batches, CUDA graphs or torch.compile, fewer host syncs (.item(), prints) per step" if gpu
                    else "host-bound: more work per step (larger micro-batches), torch.compile, fewer Python-side "
                         "syncs and prints per step; on a shared machine, fewer ranks than cores")]


def memory_near_limit(run: str, memory: Table | None) -> list[Finding]:
    if memory is None:
        return []
    out = []
    for r in memory.rows():
        if r["pct_of_device"] is not None and r["pct_of_device"] >= MEMORY_LIMIT_PCT:
            out.append(Finding("memory_near_limit", "warn", run,
                               f"rank {r['rank']} peaks at {r['pct_of_device']:.1f}% of device memory",
                               (f"{r['source']}: {r['measured_what']} {r['measured_bytes'] / 2**30:.2f} GiB of "
                                f"{r['device_memory_bytes'] / 2**30:.2f} GiB",),
                               "leave headroom: activation checkpointing (train.activation_checkpointing=selective), "
                               "a smaller micro-batch, a higher ZeRO stage or TP degree, or "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation"))
    return out


def low_busbw(run: str, bandwidth: Table | None) -> list[Finding]:
    if bandwidth is None:
        return []
    out = []
    for r in bandwidth.rows():
        if r["pct_of_ceiling"] is not None and r["pct_of_ceiling"] < BUSBW_MIN_PCT:
            large = r["busbw_large_GBps"] is not None
            achieved = r["busbw_large_GBps"] if large else r["busbw_GBps"]
            scope = "messages >= 1 MiB" if large else "all sizes (none >= 1 MiB: latency-bound, so low is expected)"
            out.append(Finding("low_busbw", "warn" if large else "info", run,
                               f"{r['collective']} reaches {r['pct_of_ceiling']:.0f}% of the nccl-tests bus bandwidth",
                               (f"{r['source']}: {achieved:.3g} GB/s over {scope}, group size {r['group_size']} "
                                f"({r['group_size_from']})",
                                f"{r['ceiling_source']}: {r['ceiling_GBps']:.3g} GB/s at "
                                f"{r['ceiling_at_bytes'] or 0:,.0f} B on {r['ceiling_ranks'] or '?'} ranks"
                                + (f" ({r['ceiling_note']})" if r["ceiling_note"] else "")),
                               "larger buckets (fewer, bigger messages), check the transport (NCCL_DEBUG=INFO), "
                               "NCCL_ALGO/NCCL_PROTO defaults, and contention with other traffic"))
    return out
