"""analysis.analyzers.doctor: each rule fires on a case built to trigger it and stays quiet on one that must not."""
from __future__ import annotations

import pytest

from analysis.analyzers import doctor as D
from analysis.analyzers.breakdown import BREAKDOWN_COLUMNS, STRAGGLER_COLUMNS, stragglers, time_breakdown
from analysis.analyzers.collective_calls import BANDWIDTH_COLUMNS, collectives_vs_layout, expected_from_resolved
from analysis.analyzers.memory import MEMORY_COLUMNS
from analysis.parsers.kineto import parse_kineto_ranks
from analysis.parsers.nccl_debug import parse_nccl_debug
from analysis.table import Table
from launch.config.resolve import resolve_path
from tests.unit.report_support import GLOO, HTA, NCCL, REPO


def _table(doc, rows):
    return Table.from_rows("t", doc, rows)


def _steps(times, first=6):
    return [(first + i, t, f"metrics/rank0.jsonl:{first + i + 1}") for i, t in enumerate(times)]


def test_warmup_in_window():
    slow_start = _steps([0.31, 0.1, 0.1, 0.1, 0.11, 0.1, 0.1, 0.1])
    (f,) = D.warmup_in_window("r", slow_start, ours=True)
    assert f.rule == "warmup_in_window" and "train.warmup_steps=6" in f.fix
    assert "metrics/rank0.jsonl:7: step 6 took 0.31 s" in f.evidence[0]
    assert not D.warmup_in_window("r", _steps([0.12, 0.1, 0.1, 0.1, 0.11, 0.1, 0.1, 0.1]), ours=True)
    assert not D.warmup_in_window("r", _steps([0.5, 0.1, 0.1]), ours=True)  # too few steps to judge
    (foreign,) = D.warmup_in_window("r", _steps([0.1, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], first=30), ours=False)
    assert "exclude the steps up to 31" in foreign.fix


def test_slow_transport_uses_the_nccl_verdict():
    socket = parse_nccl_debug(NCCL / "c_debug_v2_19_roce_listed_socket_used.txt")
    found = D.slow_transport("r", [socket])
    assert found and found[0].severity == "warn" and "NET/Socket" in found[0].message
    assert found[0].evidence[0].startswith(str(NCCL / "c_debug_v2_19_roce_listed_socket_used.txt"))
    good = parse_nccl_debug(NCCL / "c_debug_v2_21_2node_ib_gdrdma.txt")
    assert not [f for f in D.slow_transport("r", [good]) if f.severity == "warn"]


def test_mismatched_runs():
    (f,) = D.mismatched_runs([("a", 8, 64, "a/resolved.json"), ("b", 16, 64, "b/resolved.json")])
    assert "global batch size" in f.message and "b/resolved.json: b has global batch size 16" in f.evidence
    assert not D.mismatched_runs([("a", 8, 64, "x"), ("b", 8, 64, "y"), ("c", None, None, "z")])


def test_extra_collectives():
    # Megatron TP 2 over tiny-llama's 4 layers, one micro-batch: 4 x 4 + 2 + 3 + 1 = 22 all-reduces explained
    expected = expected_from_resolved(resolve_path(REPO / "recipes" / "tiny_tp2_sp",
                                                     ["parallel.sp=false", "batch.micro_batch_size=8"]))
    bw = _table(BANDWIDTH_COLUMNS, [{"collective": "all_reduce", "calls_per_step": 22.0 + 2, "source": "t"}])
    assert not D.extra_collectives("r", collectives_vs_layout(bw, expected))  # half a call per layer: no
    bw = _table(BANDWIDTH_COLUMNS, [{"collective": "all_reduce", "calls_per_step": 22.0 + 7, "source": "t"}])
    (f,) = D.extra_collectives("r", collectives_vs_layout(bw, expected))
    assert "1.8 extra per layer" in f.message  # (29 - 22 explained) / 4 layers


BREAK = BREAKDOWN_COLUMNS


def _breakdown(overlap, exposed, idle=5.0, basis="gpu_kernels"):
    return _table(BREAK, [{"rank": r, "basis": basis, "span_us": 1000.0, "compute_us": 500.0, "comm_us": 300.0,
                           "overlapped_us": 3.0 * overlap, "exposed_comm_us": 10.0 * exposed,
                           "other_us": 0.0, "idle_us": 10.0 * idle, "compute_pct": 50.0, "exposed_comm_pct": exposed,
                           "other_pct": 0.0, "idle_pct": idle, "overlap_pct": overlap, "source": f"rank{r}.json"}
                          for r in (0, 1)])


def test_no_overlap():
    (f,) = D.no_overlap("r", _breakdown(10.0, 27.0), allows=True, why="dp=8")
    assert f.severity == "warn" and "dp=8" in f.message and "rank0.json: rank 0 overlap 10%" in f.evidence[0]
    assert not D.no_overlap("r", _breakdown(80.0, 6.0), allows=True, why="dp=8")
    assert not D.no_overlap("r", _breakdown(10.0, 27.0), allows=False, why="")  # TP alone cannot overlap
    (cpu,) = D.no_overlap("r", _breakdown(0.0, 40.0, basis="cpu_ops"), allows=True, why="dp=2")
    assert cpu.severity == "info" and "gloo" in cpu.fix


def test_idle_device():
    (f,) = D.idle_device("r", _breakdown(50.0, 5.0, idle=35.0))
    assert "idle 35%" in f.message and "GPU runs nothing" in f.message
    assert not D.idle_device("r", _breakdown(50.0, 5.0, idle=12.0))


def test_no_idle_device_from_a_truncated_trace(tmp_path):
    # A gzip trace cut at 4000 bytes holds a sliver of its first step; the rest must not read as idle time.
    cut = tmp_path / "r0.json.gz"
    cut.write_bytes(GLOO[0].read_bytes()[:4000])
    trace = parse_kineto_ranks([cut, GLOO[1]])
    assert trace.meta.ranks[0].truncated
    assert not D.idle_device("r", time_breakdown(trace))


def test_straggler_on_traces():
    hta = parse_kineto_ranks(HTA)
    assert not D.straggler("r", stragglers(hta))  # the two HTA ranks are within 1%
    rows = [{"rank": 0, "steps": 3, "step_time_us": 100e3, "comm_time_us": 30e3, "step_excess_pct": -20.0,
             "comm_deficit_pct": -25.0, "straggler": False, "reason": None, "source": "r0.json"},
            {"rank": 1, "steps": 3, "step_time_us": 125e3, "comm_time_us": 5e3, "step_excess_pct": 25.0,
             "comm_deficit_pct": 25.0, "straggler": True, "reason": "both", "source": "r1.json"}]
    (f,) = D.straggler("r", _table(STRAGGLER_COLUMNS, rows))
    assert "rank 1" in f.message and f.evidence[0].startswith("r1.json: median step 125 ms")


def test_memory_near_limit():
    def mem(pct):
        b = int(80 * 2**30 * pct / 100)
        return _table(MEMORY_COLUMNS, [{"rank": 3, "measured_bytes": b, "measured_what": "max_reserved (GPU)",
                                          "device_memory_bytes": 80 * 2**30, "pct_of_device": pct,
                                          "source": "log:12"}])
    (f,) = D.memory_near_limit("r", mem(97.0))
    assert "rank 3" in f.message and "log:12: max_reserved (GPU) 77.60 GiB of 80.00 GiB" == f.evidence[0]
    assert not D.memory_near_limit("r", mem(90.0))


def test_low_busbw():
    def bw(achieved):
        return _table(BANDWIDTH_COLUMNS, [{"collective": "all_reduce", "busbw_GBps": achieved,
                                             "busbw_large_GBps": achieved, "ceiling_GBps": 358.0,
                                             "pct_of_ceiling": 100 * achieved / 358.0, "group_size": 8,
                                             "group_size_from": "recorded", "ceiling_source": "nccl.txt",
                                             "ceiling_at_bytes": 2.0**26, "ceiling_ranks": 16,
                                             "ceiling_note": "the sweep ran on 16 ranks, these calls on 8",
                                             "source": "trace.json"}])
    (f,) = D.low_busbw("r", bw(90.0))
    assert f.severity == "warn" and "25%" in f.message
    assert f.evidence == ("trace.json: 90 GB/s over messages >= 1 MiB, group size 8 (recorded)",
                          "nccl.txt: 358 GB/s at 67,108,864 B on 16 ranks (the sweep ran on 16 ranks, these calls "
                          "on 8)")
    assert not D.low_busbw("r", bw(300.0))
    small = bw(90.0)
    small.columns["busbw_large_GBps"][0] = None
    (f,) = D.low_busbw("r", small)
    assert f.severity == "info" and "latency-bound" in f.evidence[0]


@pytest.mark.parametrize("rule", sorted(D.RULES))
def test_every_rule_is_documented_with_its_threshold(rule):
    assert rule in D.__doc__
