"""Collectives observed against what they could and should be: every collective call with its size and bus bandwidth
(`collective_calls`), per collective type against the nccl-tests ceiling (`collective_bandwidth`), and the counts
per step against what the resolved layout needs (`expected_collectives`, `collectives_vs_layout`).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Mapping, NamedTuple

from analysis.analyzers import trace_analysis as ta
from analysis.analyzers.ceilings import busbw_at
from analysis.analyzers.collectives import (
    BACKEND_ANNOTATION,
    CPU_LAYERS,
    NCCL_TESTS_OP,
    REDUCTIONS,
    bus_factor_of,
    gloo_reduce_scatters,
    group_size_hint,
    nccl_tests_bytes,
)
from analysis.parsers.kineto import rows_equal, rows_not
from analysis.table import Table

# ------------------------------------------------------------------------------------ collectives

LARGE_MESSAGE_BYTES = 1 << 20

CALL_COLUMNS = {
    "rank": "trainer rank",
    "collective": "collective type",
    "step": "ProfilerStep the call belongs to (None outside steps)",
    "message_bytes": "message size in nccl-tests' convention (all_gather: the gathered output); None when unknown",
    "dur_us": "duration of the call (GPU kernel, or the CPU layer named in `layer`)",
    "start_us": "start of the call, trace clock",
    "group_size": "ranks in the group: recorded, else analysis.analyzers.collectives.group_size_hint (see "
                  "group_size_from)",
    "group_size_from": "recorded in the trace, or the rule of the hint that gave it",
    "busbw_GBps": "message_bytes / dur_us / 1e3 x nccl-tests bus factor(collective, group_size); None when unknown",
    "layer": "gpu_kernels, or the CPU layer counted (backend annotation, record_param_comms, c10d op)",
    "group": "process group as recorded (parsers.kineto `group`); None when not recorded",
    "seq": "the call's sequence number in its group as recorded (parsers.kineto `seq`); None when not recorded",
    "source": "trace file of the rank",
}


def collective_calls(trace: Table, *, group_size: int | None = None, group_size_from: str = "") -> Table:
    """Every collective call: GPU communication kernels, or on CPU-only ranks the most precise CPU layer.

    Calls that record no group size take `group_size`, by default group_size_hint(trace) without a
    layout, the size trace_analysis.collective_summary assumes."""
    if group_size is None:
        group_size, group_size_from = group_size_hint(trace)
    c = trace.columns
    by_rank: dict[Any, list[int]] = defaultdict(list)
    # Only rows that can be a call: two C scans over a 150 MB trace's half million events, not a loop.
    ranks = c["rank"]
    for i in sorted({*rows_not(c["collective"], None), *rows_equal(c["kind"], "communication")}):
        by_rank[ranks[i]].append(i)
    rows = []
    for rank, idx in by_rank.items():
        gpu = [i for i in idx if c["kind"][i] == "communication" and c["stream"][i] not in (None, -1)]
        if gpu:
            chosen, layer = gpu, "gpu_kernels"
        else:
            chosen, layer = [], None
            for lbl, rx in CPU_LAYERS:
                chosen = [i for i in idx if c["collective"][i] is not None and c["stream"][i] in (None, -1)
                          and rx.match(c["name"][i] or "")]
                if chosen:
                    layer = lbl
                    break
        carried = (gloo_reduce_scatters(c["name"], c["collective"], c["message_bytes"], c["ts_us"], idx)
                   if layer == BACKEND_ANNOTATION else set())
        for i in chosen:
            coll = "reduce_scatter" if i in carried else c["collective"][i] or "unknown"
            if coll == "barrier":
                continue
            n, n_from = c["group_size"][i], "recorded"
            if n is None:
                n, n_from = group_size, group_size_from or "unknown"
            msg = nccl_tests_bytes(coll, c["message_bytes"][i], c["message_from"][i], layer, n)
            dur = c["dur_us"][i]
            factor = bus_factor_of(coll, n) if n and n > 1 else None
            bw = msg / dur / 1e3 * factor if msg and dur and factor is not None else None
            rows.append({"rank": rank, "collective": coll, "step": c["step"][i], "message_bytes": msg, "dur_us": dur,
                         "start_us": c["ts_us"][i],
                         "group_size": n, "group_size_from": n_from if n else "unknown", "busbw_GBps": bw,
                         "layer": layer, "group": c["group"][i], "seq": c["seq"][i],
                         "source": ta.rank_source(trace, rank)})
    return Table.from_rows("collective_calls", CALL_COLUMNS, rows, source=trace.source)


BANDWIDTH_COLUMNS = {
    "collective": "collective type",
    "calls_per_step": "calls per profiled step in trace_analysis.window_steps, mean over ranks (None without "
                      "ProfilerStep annotations)",
    "time_per_step_ms": "time per profiled step with at least one call of the collective running (calls that run "
                        "at once, e.g. on gloo's two worker threads, count once), mean over ranks, ms",
    "calls": "calls counted over all ranks in the window",
    "mean_message_bytes": "mean message size of the calls whose size is known",
    "group_size": "most common group size (see group_size_from)",
    "group_size_from": "recorded, or the hint used",
    "busbw_GBps": "achieved bus bandwidth over all sized calls: sum(bytes x factor) / sum(time)",
    "busbw_large_GBps": "the same over calls of at least 1 MiB (bandwidth-bound sizes); None when there are none",
    "ceiling_GBps": "nccl-tests busbw of the same collective at the same message size: the calls' mean size (those "
                    "of at least 1 MiB where any), interpolated on the sweep (ceilings.busbw_at)",
    "ceiling_at_bytes": "the message size the ceiling is read at",
    "ceiling_ranks": "ranks of the nccl-tests run; compare with group_size (the note says when they differ)",
    "pct_of_ceiling": "(busbw_large_GBps, else busbw_GBps) / ceiling_GBps x 100",
    "ceiling_source": "nccl-tests file of the ceiling, or why there is none",
    "ceiling_note": "what makes the comparison weaker: another rank count, a size outside the sweep ('' if none)",
    "basis": "gpu_kernels or the CPU layer counted",
    "source": "trace files",
}


class BandwidthPart:
    """One rank's calls of one collective type in its profiled window, reduced to what collective_bandwidth adds up
    over ranks (bandwidth_parts): a few numbers, however many calls."""

    __slots__ = ("calls", "time_us", "sized", "large", "message_sum", "messages", "sizes", "size_from", "layers",
                 "sources")

    def __init__(self) -> None:
        self.calls = 0
        self.time_us = 0.0  # time with at least one of the calls running
        # [calls, summed dur_us, summed busbw_GBps x dur_us, summed message_bytes] of the calls with a busbw, and of
        # those of at least LARGE_MESSAGE_BYTES
        self.sized: list[Any] = [0, 0, 0, 0]
        self.large: list[Any] = [0, 0, 0, 0]
        self.message_sum: Any = 0  # over the calls whose size is known
        self.messages = 0
        self.sizes: Counter[Any] = Counter()  # calls per group size
        self.size_from: dict[Any, str] = {}  # the first call's group_size_from per group size (None included)
        self.layers: set[str] = set()
        self.sources: set[str] = set()

    def add(self, call: Mapping[str, Any]) -> None:
        """One call (a row of collective_calls)."""
        self.calls += 1
        msg, bw, dur, n = call["message_bytes"], call["busbw_GBps"], call["dur_us"], call["group_size"]
        if bw is not None:
            for acc in (self.sized, self.large) if msg >= LARGE_MESSAGE_BYTES else (self.sized,):
                acc[0] += 1
                acc[1] += dur
                acc[2] += bw * dur
                acc[3] += msg
        if msg is not None:
            self.message_sum += msg
            self.messages += 1
        if n:
            self.sizes[n] += 1
        self.size_from.setdefault(n, call["group_size_from"])
        if call["layer"]:
            self.layers.add(call["layer"])
        self.sources.add(call["source"])


def in_window(step: Any, window: set[int] | frozenset[int] | None) -> bool:
    """Whether a call of `step` counts for a rank whose profiled window (trace_analysis.window_steps) is `window`: every
    call of a rank without ProfilerSteps does."""
    return not window or step in window


def bandwidth_parts(calls: Table, windows: Mapping[Any, set[int]]) -> dict[Any, dict[str, BandwidthPart]]:
    """The ranks' calls in their profiled window (trace_analysis.window_steps; every call of a rank without
    ProfilerSteps) as one BandwidthPart per rank and collective type, ranks in the calls' order: the half of
    collective_bandwidth that needs each call, so that a run's ranks can be reduced one at a time."""
    parts: dict[Any, dict[str, BandwidthPart]] = {}
    spans: dict[tuple[Any, str], list[tuple[float, float]]] = defaultdict(list)
    for r in calls.rows():
        if not in_window(r["step"], windows.get(r["rank"])):
            continue
        parts.setdefault(r["rank"], {}).setdefault(r["collective"], BandwidthPart()).add(r)
        if r["start_us"] is not None and r["dur_us"]:
            spans[(r["rank"], r["collective"])].append((r["start_us"], r["start_us"] + r["dur_us"]))
    for (rank, coll), intervals in spans.items():
        parts[rank][coll].time_us = ta.covered_us(intervals)
    return parts


def collective_bandwidth(calls: Table, windows: Mapping[Any, set[int]], ceilings: Table | None, *,
                         no_ceiling_reason: str = "no nccl-tests output (commbench/ or ceiling=)") -> Table:
    """Per collective type over the calls in the profiled window (trace_analysis.window_steps; every call of a rank
    without ProfilerSteps): calls and time per step, achieved busbw, and the nccl-tests ceiling."""
    return combine_bandwidth(bandwidth_parts(calls, windows), {k: len(w) for k, w in windows.items()}, ceilings,
                             no_ceiling_reason=no_ceiling_reason, source=calls.source)


def combine_bandwidth(parts: Mapping[Any, Mapping[str, BandwidthPart]], window_steps: Mapping[Any, int],
                      ceilings: Table | None, *, no_ceiling_reason: str = "no nccl-tests output (commbench/ or ceiling=)",
                      source: str = "") -> Table:
    """collective_bandwidth from the ranks' bandwidth_parts (in the calls' rank order) and each rank's number of
    profiled steps (0: no ProfilerStep; such a rank adds no calls or time per step)."""
    ceil = {r["op"]: r for r in ceilings.rows()} if ceilings is not None else {}
    groups: dict[str, list[BandwidthPart]] = defaultdict(list)
    for per_coll in parts.values():
        for coll, part in per_coll.items():
            groups[coll].append(part)
    rows = []
    for coll, ps in sorted(groups.items()):
        of_rank = {rank: per_coll[coll] for rank, per_coll in parts.items() if coll in per_coll}
        cps = [(of_rank[k].calls if k in of_rank else 0) / n for k, n in window_steps.items() if n]
        tps = [(of_rank[k].time_us if k in of_rank else 0.0) / n / 1e3 for k, n in window_steps.items() if n]
        sized = [sum(p.sized[i] for p in ps) for i in range(4)]
        large = [sum(p.large[i] for p in ps) for i in range(4)]

        def achieved(acc: list[Any]) -> float | None:
            return acc[2] / acc[1] if acc[0] and acc[1] else None

        sizes: Counter[Any] = Counter()
        for p in ps:
            sizes.update(p.sizes)
        n = sizes.most_common(1)[0][0] if sizes else None
        n_from = next((p.size_from[n] for p in ps if n in p.size_from), "unknown")
        bw, bw_large = achieved(sized), achieved(large)
        op = NCCL_TESTS_OP.get(coll)
        c = ceil.get(op) if op else None
        chosen = bw_large if bw_large is not None else bw
        messages = sum(p.messages for p in ps)
        basis = large if large[0] else sized
        at = basis[3] / basis[0] if basis[0] else None
        ceiling = busbw_at(c["curve"], at) if c and at is not None else None
        notes = []
        if c and n and c["nranks"] and c["nranks"] != n:
            notes.append(f"the sweep ran on {c['nranks']} ranks, these calls on {n}")
        if c and at is not None and c["curve"] and not c["curve"][0][0] <= at <= c["curve"][-1][0]:
            notes.append(f"{at:,.0f} B is outside the sweep ({c['curve'][0][0]:,.0f}–{c['curve'][-1][0]:,.0f} B): "
                         "its nearest end is used")
        rows.append({"collective": coll, "calls_per_step": statistics.fmean(cps) if cps else None,
                     "time_per_step_ms": statistics.fmean(tps) if tps else None, "calls": sum(p.calls for p in ps),
                     "mean_message_bytes": sum(p.message_sum for p in ps) / messages if messages else None,
                     "group_size": n, "group_size_from": n_from, "busbw_GBps": bw, "busbw_large_GBps": bw_large,
                     "ceiling_GBps": ceiling, "ceiling_at_bytes": at if c else None,
                     "ceiling_ranks": c["nranks"] if c else None,
                     "pct_of_ceiling": 100.0 * chosen / ceiling if ceiling and chosen is not None else None,
                     "ceiling_source": c["source"] if c else (f"no {op} in the nccl-tests output" if ceil and op
                                                              else no_ceiling_reason),
                     "ceiling_note": "; ".join(notes),
                     "basis": ", ".join(sorted(set().union(*(p.layers for p in ps)))),
                     "source": ", ".join(sorted(set().union(*(p.sources for p in ps))))})
    return Table.from_rows("collective_bandwidth", BANDWIDTH_COLUMNS, rows, source=source)


# -------------------------------------------------------------------- collectives vs the layout

EXPECTED_COLUMNS = {
    "collective": "collective type",
    "min_per_step": "calls per step one rank makes on the pipeline stage with the fewest (launch.plan.collectives.communication)",
    "max_per_step": "calls per step on the stage with the most, each data-parallel gradient reduction counted under "
                    "either name (it runs as all-reduce or reduce-scatter by implementation and backend)",
    "layers": "transformer layers on one rank (num_layers / pp)",
    "why": "the planner's account of the calls (first pipeline stage)",
}


class ExpectedCollectivesMeta(NamedTuple):
    """Table.meta of expected_collectives (and of collectives_vs_layout, which passes it on)."""

    micro_batches: int  # micro-batches per optimizer step (gradient accumulation) of the layout
    layers: int  # transformer layers on one rank (num_layers / pp)


def _gradient_reduction(c: Any) -> bool:
    return c.parallelism == "dp" and c.collective in REDUCTIONS and not c.after_step


def expected_collectives(layout: Any) -> Table:
    """Collectives one optimizer step needs on one rank, per collective type: the planner's own model
    (launch.plan.collectives.communication, per pipeline stage), so that what the plan times and what the report
    compares the traces with cannot drift apart. The observed count is a mean over ranks, so the range spans
    the stages (the embedding is on the first, the output layer and the loss on the last); a data-parallel
    gradient reduction counts under either name (DeepSpeed's ZeRO-2 reduce-scatters on NCCL, all-reduces on gloo)."""
    # the planner's imports cost a doctor run 50 ms
    from launch.plan.collectives import communication
    from launch.plan.memory import stage_params

    g = layout.grid
    stages = [communication(layout, stage=s) for s in range(g.pp)]
    fixed = [Counter() for _ in stages]
    either = [0 for _ in stages]
    for s, comms in enumerate(stages):
        for c in comms:
            if _gradient_reduction(c):
                either[s] += c.calls_per_step
            else:
                fixed[s][c.collective] += c.calls_per_step
    why: dict[str, list[str]] = defaultdict(list)
    for c in stages[0]:
        names = " or ".join(REDUCTIONS) if _gradient_reduction(c) else c.collective
        for coll in REDUCTIONS if _gradient_reduction(c) else (c.collective,):
            why[coll].append(f"{c.parallelism.upper()}: {c.calls_per_step} {names} ({c.note})")
    colls = sorted(set().union(*fixed) | (set(REDUCTIONS) if any(either) else set()))
    _, layers = stage_params(layout, 0)
    rows = [{"collective": coll, "min_per_step": min(f[coll] for f in fixed),
             "max_per_step": max(f[coll] + (e if coll in REDUCTIONS else 0) for f, e in zip(fixed, either, strict=True)),
             "layers": layers, "why": "; ".join(why.get(coll, []))} for coll in colls]
    return Table.from_rows("expected_collectives", EXPECTED_COLUMNS, rows,
                           meta=ExpectedCollectivesMeta(micro_batches=layout.grad_accum, layers=layers))


def expected_from_resolved(resolved: Any) -> Table:
    """expected_collectives for a launch.config.resolve.Resolved layout."""
    from launch.plan.layout import Layout

    return expected_collectives(Layout.from_resolved(resolved))


VS_LAYOUT_COLUMNS = {
    "collective": "collective type",
    "observed_per_step": "calls per profiled step in the trace, mean over ranks",
    "expected_min_per_step": "the layout's minimum (expected_collectives)",
    "expected_max_per_step": "the most the layout and its implementation explain",
    "layers": "transformer layers per rank",
    "observed_per_layer": "observed_per_step / layers",
    "excess_per_layer": "(observed_per_step - expected_max_per_step) / layers when positive, else 0",
    "why": "how the expectation follows from the layout",
    "source": "trace files (observed) and resolved.json (expected)",
}


def collectives_vs_layout(bandwidth: Table, expected: Table, *, expected_source: str = "resolved.json") -> Table:
    """Observed calls per step against the layout's expectation, per collective type."""
    obs = {r["collective"]: r for r in bandwidth.rows()}
    exp = {r["collective"]: r for r in expected.rows()}
    layers = next(iter(exp.values()))["layers"] if exp else None
    rows = []
    for coll in sorted(set(obs) | set(exp)):
        o, e = obs.get(coll), exp.get(coll)
        per_step = o["calls_per_step"] if o else 0.0
        hi = e["max_per_step"] if e else 0
        excess = max(0.0, (per_step - hi) / layers) if per_step is not None and layers else None
        rows.append({"collective": coll, "observed_per_step": per_step,
                     "expected_min_per_step": e["min_per_step"] if e else 0, "expected_max_per_step": hi,
                     "layers": layers, "observed_per_layer": per_step / layers if per_step is not None and layers else None,
                     "excess_per_layer": excess, "why": e["why"] if e else "not needed by the layout",
                     "source": f"{o['source'] if o else 'no calls in the traces'} vs {expected_source}"})
    return Table.from_rows("collectives_vs_layout", VS_LAYOUT_COLUMNS, rows, source=bandwidth.source,
                           meta=expected.meta)


