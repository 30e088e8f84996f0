"""Where each collective waited: every collective call matched across the ranks that made it, its arrival skew (the
last rank in minus the first) apart from its transfer time (from the last arrival to the last rank's end), summed per
collective type (`by_collective`) and per rank (`by_rank`): which rank everyone waits for, and whether a slow
collective is slow on the wire or waiting on a late rank (what AMD's TraceLens reports as skew and latency).

A call is counted at the layer collective_calls counts (the GPU kernel, else the most precise CPU layer), so its start
on a rank is when that rank arrives: an NCCL kernel or a gloo worker's annotation starts and then waits for the
others. Calls are matched
  - by (process group, 'Seq') where the trace records PyTorch's per-group sequence number (parsers.kineto `seq`),
    which every rank of the group gives the same call;
  - else by (process group, collective, ProfilerStep, k): the k-th call of that collective in that step on each rank,
    in start order (the ranks of a group must issue its collectives in one order, NCCL and gloo both require it;
    two calls running at once on gloo's two worker threads may pair crosswise).
Point-to-point calls (send_recv) are left out: only the two peers wait for each other, and the trace does not say
which rank the peer is. A call seen on one rank only matches nothing. Times are compared across ranks as written, so
ranks on different hosts need clocks kept in step (NTP or PTP) for the skew to mean anything.

`match_keys` gives each call of one rank its key; `ArrivalSet` takes the ranks one at a time (compact arrays, so a run
of many ranks is held as 24 bytes per call) and builds both tables; `collective_arrivals` does it all for a table of
collective_calls.
"""
from __future__ import annotations

import array
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from analysis.analyzers.collective_calls import in_window
from analysis.table import Table

POINT_TO_POINT = "send_recv"

BY_COLLECTIVE_COLUMNS = {
    "collective": "collective type",
    "calls": "calls matched on two or more ranks",
    "ranks": "ranks per matched call (the most common count)",
    "matched_by": "Seq (the recorded sequence number), order (the k-th call of the step), or both",
    "skew_us": "summed arrival skew: last rank's start minus first rank's start, per call",
    "transfer_us": "summed transfer time: last rank's end minus last rank's start, per call (skew_us + transfer_us = "
                   "the calls' time from the first arrival to the last end)",
    "skew_pct": "skew_us / (skew_us + transfer_us) x 100: the share of the calls' time spent waiting for a late rank",
    "mean_skew_us": "skew_us / calls",
    "max_skew_us": "the largest arrival skew of one call",
    "last_rank": "the rank that alone arrived last most often (the lowest such rank on a tie); None when no call had "
                 "a single last rank",
    "last_rank_pct": "calls at which last_rank alone arrived last / calls x 100",
    "mostly": "'arrival skew' when skew_us > transfer_us (the calls wait on a late rank), else 'transfer' (on the wire)",
    "source": "trace files",
}

BY_RANK_COLUMNS = {
    "rank": "trainer rank",
    "calls": "matched calls the rank took part in",
    "last": "calls at which it alone arrived last (a call whose latest start several ranks share has no last rank)",
    "last_pct": "last / calls x 100",
    "late_us": "summed time it arrived after the first rank: what it made the others wait",
    "wait_us": "summed time it waited for the last rank",
    "source": "trace file of the rank",
}


def match_keys(collective: Sequence[str], step: Sequence[Any], start_us: Sequence[float | None],
               group: Sequence[Any], seq: Sequence[int | None]) -> list[tuple | None]:
    """The match key of each call of one rank (columns of collective_calls, that rank's rows); None for a call that
    is matched to nothing (point-to-point, or no start)."""
    keys: list[tuple | None] = [None] * len(collective)
    counted: Counter[tuple] = Counter()
    order = sorted((i for i, t in enumerate(start_us) if t is not None), key=lambda i: start_us[i])
    for i in order:
        coll = collective[i]
        if coll == POINT_TO_POINT:
            continue
        if seq[i] is not None:
            keys[i] = ("Seq", group[i], seq[i])
        else:
            at = (group[i], coll, step[i])
            keys[i] = ("order", *at, counted[at])
            counted[at] += 1
    return keys


class ArrivalSet:
    """Calls of a run's ranks, added a rank at a time (`add`), matched by key (`tables`)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}  # key -> call id
        self._collective: list[str] = []  # per call id
        self._ranks: dict[Any, tuple[str, array.array, array.array, array.array]] = {}

    def add(self, rank: Any, source: str, keys: Iterable[tuple | None], collective: Sequence[str],
            start_us: Sequence[float | None], end_us: Sequence[float | None]) -> None:
        """One rank's calls (match_keys of its calls, their collective, start and end); a rank added again replaces
        its earlier calls."""
        ids, starts, ends = array.array("q"), array.array("d"), array.array("d")
        for key, coll, s, e in zip(keys, collective, start_us, end_us, strict=True):
            if key is None or e is None:
                continue
            cid = self._ids.get(key)
            if cid is None:
                cid = self._ids[key] = len(self._collective)
                self._collective.append(coll)
            ids.append(cid)
            starts.append(s)
            ends.append(e)
        self._ranks[rank] = (source, ids, starts, ends)

    def tables(self, *, source: str = "") -> tuple[Table, Table]:
        """(by_collective, by_rank): BY_COLLECTIVE_COLUMNS and BY_RANK_COLUMNS over the calls seen on two or more
        ranks; ranks in rank order."""
        n = len(self._collective)
        seen = array.array("q", bytes(8 * n))
        first = array.array("d", [float("inf")]) * n
        last = array.array("d", [float("-inf")]) * n
        end = array.array("d", [float("-inf")]) * n
        last_rank: list[Any] = [None] * n
        ranks = sorted(self._ranks, key=lambda r: (r is None, r if r is not None else 0))
        for rank in ranks:
            _, ids, starts, ends = self._ranks[rank]
            for cid, s, e in zip(ids, starts, ends, strict=True):
                seen[cid] += 1
                if s < first[cid]:
                    first[cid] = s
                if s > last[cid]:
                    last[cid], last_rank[cid] = s, rank
                elif s == last[cid]:  # a shared latest start: no single rank came last
                    last_rank[cid] = None
                if e > end[cid]:
                    end[cid] = e
        matched = [cid for cid in range(n) if seen[cid] >= 2]
        by_rank_rows = []
        lasts: Counter[Any] = Counter(last_rank[cid] for cid in matched if last_rank[cid] is not None)
        for rank in ranks:
            src, ids, starts, _ = self._ranks[rank]
            calls, late, wait = 0, 0.0, 0.0
            for cid, s in zip(ids, starts, strict=True):
                if seen[cid] >= 2:
                    calls += 1
                    late += s - first[cid]
                    wait += last[cid] - s
            if calls:
                by_rank_rows.append({"rank": rank, "calls": calls, "last": lasts[rank],
                                     "last_pct": 100.0 * lasts[rank] / calls, "late_us": late, "wait_us": wait,
                                     "source": src})
        per_coll: dict[str, list[int]] = defaultdict(list)
        for cid in matched:
            per_coll[self._collective[cid]].append(cid)
        keys_of = {cid: key for key, cid in self._ids.items()} if matched else {}
        rows = []
        for coll, cids in sorted(per_coll.items()):
            skews = [last[c] - first[c] for c in cids]
            skew, transfer = sum(skews), sum(end[c] - last[c] for c in cids)
            late_counts = Counter(last_rank[c] for c in cids if last_rank[c] is not None)
            top = max(late_counts.values(), default=0)
            worst = min((r for r, k in late_counts.items() if k == top), key=lambda r: (r is None, r or 0),
                        default=None)
            rows.append({"collective": coll, "calls": len(cids),
                         "ranks": Counter(seen[c] for c in cids).most_common(1)[0][0],
                         "matched_by": ", ".join(sorted({keys_of[c][0] for c in cids})),
                         "skew_us": skew, "transfer_us": transfer,
                         "skew_pct": 100.0 * skew / (skew + transfer) if skew + transfer else None,
                         "mean_skew_us": skew / len(cids), "max_skew_us": max(skews), "last_rank": worst,
                         "last_rank_pct": 100.0 * top / len(cids) if worst is not None else None,
                         "mostly": "arrival skew" if skew > transfer else "transfer", "source": source})
        return (Table.from_rows("collective_arrivals", BY_COLLECTIVE_COLUMNS, rows, source=source),
                Table.from_rows("rank_arrivals", BY_RANK_COLUMNS, by_rank_rows, source=source))


def collective_arrivals(calls: Table, windows: Mapping[Any, set[int]] | None = None) -> tuple[Table, Table]:
    """(by_collective, by_rank) of the calls of a table of analysis.analyzers.collective_calls.collective_calls, those
    in each rank's profiled window when `windows` (trace_analysis.window_steps) is given (every call of a rank without
    ProfilerSteps), as collective_calls.collective_bandwidth counts them."""
    per_rank: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in calls.rows():
        if in_window(r["step"], (windows or {}).get(r["rank"])):
            per_rank[r["rank"]].append(r)
    found = ArrivalSet()
    for rank, rows in per_rank.items():
        cols = {c: [r[c] for r in rows] for c in ("collective", "step", "start_us", "group", "seq", "dur_us")}
        ends = [s + d if s is not None and d is not None else None for s, d in zip(cols["start_us"], cols["dur_us"],
                                                                                 strict=True)]
        found.add(rank, rows[0]["source"], match_keys(cols["collective"], cols["step"], cols["start_us"],
                                                      cols["group"], cols["seq"]),
                  cols["collective"], cols["start_us"], ends)
    return found.tables(source=calls.source)
