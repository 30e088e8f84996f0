"""gloo's collectives counted once, under the name the program asked for, on a real 2-rank gloo trace
(tests/fixtures/kineto/gloo_rs_rank*.json.gz, made by make_gloo_trace.py --reduce-scatter): per step a
reduce-scatter (gloo runs it as an all-reduce of the whole input), an all-reduce of the same size, one of 8 bytes,
and two async all-reduces in flight at once on gloo's two worker threads. The oracle is the raw JSON, read here."""
import gzip
import json

import pytest

from analysis.analyzers import trace_analysis as ta
from analysis.analyzers.collective_calls import collective_bandwidth, collective_calls
from analysis.parsers.kineto import parse_kineto_ranks
from tests.unit.report_support import REPO

TRACES = [REPO / "tests" / "fixtures" / "kineto" / f"gloo_rs_rank{r}.json.gz" for r in (0, 1)]


def raw(rank: int) -> list[dict]:
    return [e for e in json.loads(gzip.open(TRACES[rank]).read())["traceEvents"] if e.get("ph") == "X"]


def in_steps(events: list[dict]) -> list[dict]:
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    return [e for e in events if any(s <= e["ts"] < t for s, t in steps)]


@pytest.fixture(scope="module")
def trace():
    return parse_kineto_ranks(TRACES)


def test_every_call_is_one_row_under_its_own_name(trace):
    calls = list(collective_calls(trace).rows())
    for rank in (0, 1):
        events = raw(rank)
        names = [e["name"] for e in events]
        mine = [c["collective"] for c in calls if c["rank"] == rank]
        assert mine.count("reduce_scatter") == names.count("c10d::_reduce_scatter_base_") == 3
        assert mine.count("all_reduce") == names.count("c10d::allreduce_") == 12
        assert len(mine) == names.count("gloo:all_reduce") == 15  # what gloo ran: one row per call


def test_summary_and_exposed_time_name_a_reduce_scatter_once(trace):
    summary = list(ta.collective_summary(trace, include_last_step=True, hta_rounding=False).rows())
    exposed = list(ta.exposed_communication(trace, include_last_step=True, hta_rounding=False).rows())
    for rank in (0, 1):
        events = in_steps(raw(rank))
        names = [e["name"] for e in events]
        rows = {r["collective"]: r for r in summary if r["rank"] == rank}
        assert sorted(rows) == ["all_reduce", "reduce_scatter"]
        assert rows["reduce_scatter"]["count"] == names.count("c10d::_reduce_scatter_base_")
        assert rows["all_reduce"]["count"] == names.count("c10d::allreduce_")
        assert {r["source"] for r in rows.values()} == {"backend annotation"}
        # Concurrent calls: wall time is the union of the all-reduce annotations' intervals, below their sum. Each
        # step issues the reduce-scatter before the all-reduce of the same 2048 floats, and gloo runs them in that
        # order: the earlier 2048-float annotation of a step is the reduce-scatter's.
        ar = [e for e in events if e["name"] == "gloo:all_reduce"]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#"))
        carried = [min((e for e in ar if e["args"]["Input Dims"] == [[2048]] and s <= e["ts"] < t),
                       key=lambda e: e["ts"]) for s, t in steps]
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ar if not any(e is x for x in carried))
        union, end = 0.0, float("-inf")
        for s, t in spans:
            union += max(0.0, t - max(s, end))
            end = max(end, t)
        assert rows["all_reduce"]["wall_us"] == pytest.approx(union, rel=1e-9)
        assert rows["all_reduce"]["wall_us"] < rows["all_reduce"]["total_us"]
        assert sorted(r["collective"] for r in exposed if r["rank"] == rank) == ["all", "all_reduce", "reduce_scatter"]



def test_time_per_step_counts_concurrent_calls_once(trace):
    calls = collective_calls(trace)
    windows = {rank: {int(e["name"].split("#")[1]) for e in raw(rank) if e["name"].startswith("ProfilerStep#")}
               for rank in (0, 1)}
    table = {r["collective"]: r for r in collective_bandwidth(calls, windows, None).rows()}
    per_rank = []
    for rank in (0, 1):
        events = in_steps(raw(rank))
        names = [e["name"] for e in events]
        assert names.count("gloo:all_reduce") == 15  # every call of the three steps lies inside them
        big = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e["name"] == "gloo:all_reduce" and e["args"]["Input Dims"] == [[262144]])
        assert big[0][1] > big[1][0]  # the two async all-reduces of the first step overlap: the case at issue
        per_rank.append(len(windows[rank]))
    summary = {(r["rank"], r["collective"]): r for r in ta.collective_summary(trace, include_last_step=True,
                                                                               hta_rounding=False).rows()}
    want = sum(summary[(rank, "all_reduce")]["wall_us"] / per_rank[rank] for rank in (0, 1)) / 2 / 1e3
    assert table["all_reduce"]["time_per_step_ms"] == pytest.approx(want, rel=1e-9)
    summed = sum(summary[(rank, "all_reduce")]["total_us"] / per_rank[rank] for rank in (0, 1)) / 2 / 1e3
    assert table["all_reduce"]["time_per_step_ms"] < summed
