"""analysis.analyzers (steps, memory, breakdown, collective_calls, ceilings, timers) on the real fixtures: every
number is checked against the fixture's own text (read here with a regex of the test's own) or against
HolisticTraceAnalysis's published numbers."""
from __future__ import annotations

import json
import math
import re
import statistics

import pytest

from analysis.analyzers import trace_analysis as ta
from analysis.analyzers.breakdown import kernel_diff, nsys_stats_totals, time_breakdown
from analysis.analyzers.ceilings import nccl_ceilings
from analysis.analyzers.collective_calls import (
    BANDWIDTH_COLUMNS,
    collective_bandwidth,
    collective_calls,
    collectives_vs_layout,
    expected_from_resolved,
)
from analysis.analyzers.collectives import group_size_hint
from analysis.analyzers.memory import memory_from_megatron, memory_from_metrics, memory_vs_plan
from analysis.analyzers.steps import (
    measured_step_times,
    step_statistics,
    steps_from_deepspeed,
    steps_from_megatron,
    steps_from_metrics,
)
from analysis.analyzers.timers import framework_timers
from analysis.parsers.deepspeed_log import parse_deepspeed_log
from analysis.parsers.kineto import parse_kineto_ranks
from analysis.parsers.megatron_log import parse_megatron_log
from analysis.parsers.metrics import parse_metrics
from analysis.parsers.nccl_tests import large_message_busbw, parse_nccl_tests
from analysis.parsers.nsys import parse_nsys_sqlite
from analysis.parsers.nsys_adapter import as_kineto
from analysis.parsers.nsys_stats import parse_nsys_stats_csv
from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from tests.unit.report_support import (
    ALCF,
    ALLREDUCE_8XH100,
    BIGSCIENCE,
    GLOO,
    HTA,
    LOGS,
    NSYS,
    REPO,
    build_nsys_exports,
    default_step_times,
    make_run_dir,
)

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def _iterations(path) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in ITERATION.finditer(path.read_text())}


@pytest.fixture(scope="module")
def bigscience():
    return parse_megatron_log(BIGSCIENCE, source=BIGSCIENCE.name)


@pytest.fixture(scope="module")
def hta():
    return parse_kineto_ranks(HTA)


# --------------------------------------------------------------------------------- steps

def test_megatron_steps_and_the_foreign_warmup_rule(bigscience):
    text_ms = _iterations(BIGSCIENCE)
    assert len(text_ms) == 20 and min(text_ms) == 10 and max(text_ms) == 200
    steps = steps_from_megatron(bigscience)
    by_step = {r["step"]: r for r in steps.rows()}
    assert {s: r["step_time_s"] * 1e3 for s, r in by_step.items()} == pytest.approx(text_ms)
    # tokens/s/GPU from the arguments: global batch 4 x seq 1024 / step time / world 32
    assert by_step[30]["tokens_per_s_per_device"] == pytest.approx(4 * 1024 / 1.6137 / 32)
    assert by_step[30]["source"].endswith(":412")
    stats = next(step_statistics(steps).rows())
    # range 10-200: 10% is 19.1 -> 20 steps, so iterations < 30 (two records) are warm-up
    assert stats["steps_dropped"] == 2 and stats["steps_measured"] == 18 and stats["first_measured_step"] == 30
    assert "at least 10 steps" in stats["drop_rule"] and "< 30" in stats["drop_rule"]
    kept = [v / 1e3 for k, v in text_ms.items() if k >= 30]
    assert stats["step_time_median_s"] == pytest.approx(statistics.median(kept))
    assert stats["step_time_mean_s"] == pytest.approx(statistics.fmean(kept))
    assert stats["mfu_pct"] is None  # the 2021 log prints no TFLOP/s


def test_short_foreign_log_keeps_half_and_mfu_against_a_given_peak():
    log = parse_megatron_log(ALCF, source=ALCF.name)
    steps = steps_from_megatron(log, peak_flops=312e12)
    stats = next(step_statistics(steps, mfu_formula="x").rows())
    text = ALCF.read_text()
    ms = {int(m[1]): float(m[2]) for m in re.finditer(r"iteration=\s*(\d+)/.*?elapsed_ms_per_iteration=([\d.]+)|"
                                                        r"iteration=\s*(\d+)", text) if m[2]}
    tflops = dict(re.findall(r"iteration=\s*(\d+)/.*?TFLOPs=([\d.]+)", text))
    tgs = dict(re.findall(r"iteration=\s*(\d+)/.*?tokens_per_gpu_per_second_tgs=([\d.]+)", text))
    assert len(tflops) == 7
    # 7 records (136004-136010): "at least 10" would drop all, so only the first 3 go
    assert (stats["steps_dropped"], stats["steps_measured"], stats["first_measured_step"]) == (3, 4, 136007)
    kept = [k for k in tflops if int(k) >= 136007]
    assert stats["mfu_pct"] == pytest.approx(statistics.median(float(tflops[k]) for k in kept) / 312 * 100)
    assert stats["tokens_per_s_per_device"] == pytest.approx(statistics.median(float(tgs[k]) for k in kept))
    if ms:
        assert stats["step_time_median_s"] == pytest.approx(statistics.median(ms[int(k)] for k in kept) / 1e3)


def test_deepspeed_step_times_pipe_timestamps_and_timers():
    pipe = steps_from_deepspeed(parse_deepspeed_log(LOGS / "c_ds_v0_14_pipe_engine.txt"))
    assert [(r["step"], r["step_time_s"]) for r in pipe.rows()] == [(10, 2.540), (20, 2.532)]
    stamped = steps_from_deepspeed(parse_deepspeed_log(LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt"))
    # step=2 at 10:00:05,931 and step=4 at 10:00:07,172: 1.241 s over two steps
    (row,) = list(stamped.rows())
    assert row["step"] == 4 and row["step_time_s"] == pytest.approx(1.241 / 2)
    assert row["step_source"] == "time between DeepSpeed 'step=' lines"
    timers = steps_from_deepspeed(parse_deepspeed_log(LOGS / "c_ds_v0_17_flops_profiler.txt"))
    (row,) = list(timers.rows())  # one step= line: fwd 402.50 + bwd 1050.00 + step 85.20 ms
    assert row["step"] == 3 and row["step_time_s"] == pytest.approx(1.5377)


def test_our_metrics_drop_the_marked_warmup(tmp_path):
    run = make_run_dir(tmp_path, traces=False, steps=12)
    steps = steps_from_metrics(parse_metrics(run, relative_to=run))
    stats = step_statistics(steps, warmup_from="meta")
    row = next(stats.rows())
    times = default_step_times(12, 5)
    assert (row["steps_dropped"], row["steps_measured"], row["first_measured_step"]) == (5, 7, 6)
    assert "warmup=true" in row["drop_rule"]
    assert row["step_time_median_s"] == pytest.approx(statistics.median(times[5:]))
    assert row["step_time_p90_s"] <= max(times[5:]) and row["step_time_p10_s"] >= min(times[5:])
    assert [s for s, _, _ in measured_step_times(steps, stats)] == list(range(6, 13))


# -------------------------------------------------------------------------------- memory

def test_megatron_peak_memory_per_rank(bigscience):
    mem = {r["rank"]: r for r in memory_from_megatron(bigscience).rows()}
    assert len(mem) == 32
    assert mem[0]["max_reserved_bytes"] == 26732 * 2**20  # "[Rank 0] ... max reserved: 26732.0"
    assert mem[0]["measured_what"] == "max_reserved (GPU)"
    assert mem[18]["max_allocated_bytes"] == pytest.approx(20045.0126953125 * 2**20, abs=1)


def test_memory_against_the_plan_and_the_device(tmp_path):
    run = make_run_dir(tmp_path, traces=False, steps=6)
    mem = memory_from_metrics(parse_metrics(run, relative_to=run))
    plan = plan_resolved(resolve_path(REPO / "recipes" / "tiny_zero2", ["train.steps=6"]))
    out = {r["rank"]: r for r in memory_vs_plan(mem, plan, plan_source="plan.json").rows()}
    rp = plan.ranks[0]
    assert out[1]["measured_bytes"] == 601 * 2**20 + 5 * 1024  # the last step's running peak
    assert out[1]["measured_what"] == "peak RSS (CPU process)"
    assert out[1]["predicted_bytes"] == rp.memory["deepspeed"].total
    assert out[1]["device_memory_bytes"] == 8 * 2**30  # the cpu profile
    assert out[1]["pct_of_device"] == pytest.approx(100 * out[1]["measured_bytes"] / 2**33)
    assert "plan.json: all ranks, deepspeed accounting" in out[1]["predicted_what"]
    assert out[1]["source"] == "metrics/rank1.jsonl:7"
    none = next(memory_vs_plan(mem, None).rows())
    assert none["predicted_bytes"] is None and none["predicted_what"].startswith("none")


# ----------------------------------------------------------------------- time breakdown

def test_breakdown_on_hta_traces_matches_hta(hta):
    rows = {r["rank"]: r for r in time_breakdown(hta).rows()}
    # HolisticTraceAnalysis 0.5.0 on these files (tests/unit/test_kineto.py): idle 321378, compute 106252
    r0 = rows[0]
    assert (r0["idle_us"], r0["compute_us"], r0["span_us"]) == (321378.0, 106252.0, 600058.0)
    for r in rows.values():
        total = r["compute_pct"] + r["exposed_comm_pct"] + r["other_pct"] + r["idle_pct"]
        assert total == pytest.approx(100.0)
        assert r["exposed_comm_us"] == pytest.approx(r["comm_us"] - r["overlapped_us"])
    ov = {r["rank"]: r["overlap_pct"] for r in ta.comm_comp_overlap(hta).rows()}
    assert rows[1]["overlap_pct"] == pytest.approx(ov[1])
    assert r0["source"].endswith("hta_trace_filter__sampled_rank-0.json.gz")


def test_nsys_export_goes_through_the_same_breakdown(tmp_path):
    exports = build_nsys_exports(tmp_path)
    trace = as_kineto([parse_nsys_sqlite(exports["modern"])])
    r0 = next(r for r in time_breakdown(trace).rows() if r["rank"] == 0)
    # make_fixtures.py, process 4101, steps 'step 1' (1.0-2.0 ms) and 'step 2': GPU work launched before the
    # last step starts: memcpy 1020-1060 us, gemm 1110-1310, memset 1455-1460, NCCL all-reduce 1510-1900,
    # elementwise 1905-2010 (launched at 1850). compute 200 + 105, comm 390 (nothing overlaps it),
    # other 40 + 5, span 2010 - 1020, idle the gaps.
    assert r0["basis"] == "gpu_kernels"
    assert (r0["span_us"], r0["compute_us"], r0["exposed_comm_us"], r0["other_us"], r0["idle_us"]) == \
        pytest.approx((990.0, 305.0, 390.0, 45.0, 250.0))
    assert r0["overlap_pct"] == 0.0
    calls = collective_calls(trace)
    assert {(c["rank"], c["collective"]) for c in calls.rows()} == {(0, "all_reduce"), (1, "reduce_scatter"),
                                                                  (1, "send_recv")}
    assert trace.meta.ranks[0].source.endswith("modern.sqlite")


# ------------------------------------------------------------------------------ collectives

def test_collective_calls_and_bandwidth_on_hta_traces(hta):
    n, why = group_size_hint(hta)
    assert n == 128 and "world_size" in why
    calls = collective_calls(hta, group_size=n, group_size_from=why)
    window = ta.window_steps(hta)
    assert window == {0: {551}, 1: {551}}  # ProfilerStep#551 and #552, the last one dropped as HTA does
    ag = [c for c in calls.rows() if c["rank"] == 0 and c["collective"] == "all_gather" and c["step"] in window[0]]
    assert len(ag) == 1 and ag[0]["message_bytes"] == 1073741824 and ag[0]["layer"] == "gpu_kernels"
    summary = next(r for r in ta.collective_summary(hta).rows() if r["rank"] == 0 and r["collective"] == "all_gather")
    assert ag[0]["busbw_GBps"] == pytest.approx(summary["busbw_GBps"])
    ceil = nccl_ceilings([parse_nccl_tests(ALLREDUCE_8XH100)])
    (c,) = list(ceil.rows())
    assert c["op"] == "all_reduce" and c["busbw_GBps"] == large_message_busbw(parse_nccl_tests(ALLREDUCE_8XH100))
    bw = {r["collective"]: r for r in collective_bandwidth(calls, window, ceil).rows()}
    ar = bw["all_reduce"]
    # The ceiling is the sweep at the calls' own mean size (those >= 1 MiB), interpolated in log size: the oracle
    # reads the nccl-tests file with this test's regex and interpolates by hand.
    large = [r["message_bytes"] for r in calls.rows() if r["collective"] == "all_reduce"
             and r["step"] in window[r["rank"]] and r["message_bytes"] and r["message_bytes"] >= 2**20]
    at = sum(large) / len(large)
    assert ar["ceiling_at_bytes"] == pytest.approx(at)
    # busbw from each placement's size and time (the printed busbw has two decimals) x 2(n-1)/n on the 8 ranks.
    row = re.compile(r"^\s+(\d+)\s+\d+\s+\w+\s+\w+\s+-?\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+\d+\s+([\d.]+)")
    sweep = sorted((int(m[1]), sum(int(m[1]) / float(t) / 1e3 * 2 * 7 / 8 for t in (m[2], m[3])) / 2)
                   for m in map(row.match, ALLREDUCE_8XH100.read_text().splitlines()) if m)
    (s0, b0), (s1, b1) = next((p, q) for p, q in zip(sweep[:-1], sweep[1:], strict=True) if p[0] <= at <= q[0])
    want = b0 + (math.log(at / s0) / math.log(s1 / s0)) * (b1 - b0)
    assert ar["ceiling_GBps"] == pytest.approx(want, rel=1e-9)
    assert ar["pct_of_ceiling"] == pytest.approx(100 * ar["busbw_large_GBps"] / want)
    # The sweep ran on 8 GPUs, the traced calls on 128 ranks: said.
    assert ar["ceiling_ranks"] == 8 and ar["ceiling_note"] == "the sweep ran on 8 ranks, these calls on 128"
    assert bw["all_gather"]["ceiling_GBps"] is None and "no all_gather" in bw["all_gather"]["ceiling_source"]
    assert bw["all_gather"]["calls_per_step"] == 1.0


def test_cpu_trace_calls_use_the_backend_annotation():
    gloo = parse_kineto_ranks(GLOO)
    assert ta.window_steps(gloo) == {0: {2, 3}, 1: {2, 3}}  # ProfilerStep#2-4, the last one dropped
    calls = collective_calls(gloo)
    assert {c["layer"] for c in calls.rows()} == {"backend annotation"}
    summary = {(r["rank"], r["collective"]): r for r in ta.collective_summary(gloo).rows()}
    counted = {}
    for c in calls.rows():
        if c["step"] in (2, 3):
            counted[(c["rank"], c["collective"])] = counted.get((c["rank"], c["collective"]), 0) + 1
    for key, n in counted.items():
        assert summary[key]["count"] == n


def _cpu_trace(tmp_path, name, rank, args_by_op, pg_config):
    """A CPU-only trace of one rank: one ProfilerStep, one gloo annotation per op with the args given."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000}]
    for k, (op, args) in enumerate(args_by_op.items()):
        events.append({"ph": "X", "cat": "cpu_op", "name": f"gloo:{op}", "pid": 1, "tid": 1, "ts": 100 + 200 * k,
                       "dur": 100, "args": args})
    doc = {"traceEvents": events, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 4,
                                                      "pg_config": pg_config}}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_all_gather_sizes_are_scaled_only_when_they_are_the_input_shard(tmp_path):
    pgs = [{"pg_name": "0", "pg_size": 4}]
    shard = _cpu_trace(tmp_path, "shard.json", 0, {"all_gather": {"Input Dims": [[256]], "Input type": ["float"]}}, pgs)
    # 'In/Out msg size' already hold the gathered output (4 KiB): no scaling by the group
    gathered = _cpu_trace(tmp_path, "gathered.json", 0,
                          {"all_gather": {"In msg size": 1024, "Out msg size": 4096}}, pgs)
    for path, expected in ((gathered, 4096), (shard, 256 * 4 * 4)):
        trace = parse_kineto_ranks([path])
        (call,) = [c for c in collective_calls(trace).rows() if c["collective"] == "all_gather"]
        (summ,) = [r for r in ta.collective_summary(trace).rows() if r["collective"] == "all_gather"]
        assert (call["message_bytes"], summ["message_bytes"]) == (expected, expected), path.name
        assert call["busbw_GBps"] == pytest.approx(summ["busbw_GBps"])


def test_library_and_report_assume_the_same_group_size(tmp_path):
    # Two process groups of one size, recorded in no call: the report's hint and collective_summary agree
    pgs = [{"pg_name": "0", "pg_size": 2}, {"pg_name": "1", "pg_size": 2}]
    args = {"all_reduce": {"Input Dims": [[1024]], "Input type": ["float"]}}
    trace = parse_kineto_ranks([_cpu_trace(tmp_path, f"r{r}.json", r, args, pgs) for r in (0, 1)])
    n, why = group_size_hint(trace)
    assert (n, why) == (2, "every process group has this size")
    for r in ta.collective_summary(trace).rows():
        assert (r["group_size"], r["group_size_from"], r["bus_factor"]) == (2, why, 1.0)
    for c in collective_calls(trace).rows():
        assert (c["group_size"], c["group_size_from"]) == (2, why)
    # the report may narrow it with the layout only where the trace itself says nothing
    assert group_size_hint(trace, {"dp": 4})[0] == 2


def expected(recipe: str, *overrides: str) -> dict:
    resolved = resolve_path(REPO / "recipes" / recipe, list(overrides))
    return {r["collective"]: r for r in expected_from_resolved(resolved).rows()}


def test_expected_collectives_follow_the_layout():
    # tiny-llama: 4 decoder layers of 9 parameter tensors, plus the embedding, the final norm and the output layer.
    tp = expected("tiny_tp2_sp", "parallel.sp=false", "batch.micro_batch_size=8")  # one micro-batch
    # 2 per layer forward + 2 backward, + embedding output and output-layer input gradient + 3 in the loss, + the
    # backend's gradient norm over TP after the step
    assert tp["all_reduce"]["min_per_step"] == tp["all_reduce"]["max_per_step"] == 4 * 4 + 2 + 3 + 1
    sp = expected("tiny_tp2_sp")  # micro-batches of 4 of the global 8: two per step
    # per layer 2 + 4 gathers (forward; backward: output gradients and the re-gathered input) and 2 + 2
    # reduce-scatters; the embedding and output layer 3 and 2; per micro-batch (2)
    assert sp["all_gather"]["min_per_step"] == sp["all_gather"]["max_per_step"] == (6 * 4 + 3) * 2
    assert sp["reduce_scatter"]["min_per_step"] == sp["reduce_scatter"]["max_per_step"] == (4 * 4 + 2) * 2
    # the loss's 3 per micro-batch; after the step the norm weights' gradient sum and the gradient norm
    assert sp["all_reduce"]["min_per_step"] == sp["all_reduce"]["max_per_step"] == 3 * 2 + 1 + 1
    # TP2 x PP2: the range spans the stages, the embedding's call on the first, the output layer's and the loss's
    # on the last (2 layers each, 2 micro-batches), + the gradient norm over TP x PP; one send and one receive per
    # micro-batch at the boundary; the logged loss broadcast from the last stage
    pp = expected("tiny_tp2_pp2", "batch.micro_batch_size=4")
    assert (pp["all_reduce"]["min_per_step"], pp["all_reduce"]["max_per_step"]) == ((2 * 4 + 1) * 2 + 1,
                                                                                    (2 * 4 + 1 + 3) * 2 + 1)
    assert pp["send_recv"]["min_per_step"] == pp["send_recv"]["max_per_step"] == 2 * 2
    assert pp["broadcast"]["min_per_step"] == pp["broadcast"]["max_per_step"] == 1
    # ZeRO-3 on 4 ranks, one micro-batch: every tensor of the tiny model is under the persistence threshold, so each
    # is gathered once after the step (39 calls); the gradient reduce-scatters, one per reduce bucket, which gloo runs
    # as all-reduces, so they count under either name; the gradient norm and the logged loss mean: 2 all-reduces.
    z3 = expected("tiny_zero2", "parallel.zero_stage=3", "hardware.gpus_per_node=4")
    assert z3["all_gather"]["min_per_step"] == z3["all_gather"]["max_per_step"] == 4 * 9 + 3
    # one reduce bucket holds one decoder layer ("auto"): 36,992 of tiny-llama's 213,568 parameters, 6 buckets a step
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 KV heads of 16); gate, up, down; norms
    total = 4 * layer + 2 * 512 * 64 + 64  # 4 layers, embedding and lm_head (untied), final norm
    assert (layer, total) == (36_992, 213_568)
    buckets = -(-total // layer)
    assert (z3["reduce_scatter"]["min_per_step"], z3["reduce_scatter"]["max_per_step"]) == (0, buckets)
    assert (z3["all_reduce"]["min_per_step"], z3["all_reduce"]["max_per_step"]) == (2, 2 + buckets)


def test_observed_counts_against_the_layout():
    exp = expected_from_resolved(_tp2_four_layers())
    doc = BANDWIDTH_COLUMNS
    from analysis.table import Table

    bw = Table.from_rows("collective_bandwidth", doc, [
        {"collective": "all_reduce", "calls_per_step": 16.0 + 4 + 4 + 8, "source": "t"},
        {"collective": "all_gather", "calls_per_step": 2.0, "source": "t"}])
    rows = {r["collective"]: r for r in collectives_vs_layout(bw, exp).rows()}
    # explains 16 (TP layers) + 2 (embedding, output layer) + 3 (loss) + 1 (gradient norm) = 22; 32 observed -> 10
    # extra over 4 layers
    assert rows["all_reduce"]["expected_max_per_step"] == 22
    assert rows["all_reduce"]["excess_per_layer"] == pytest.approx(2.5)
    assert rows["all_gather"]["why"] == "not needed by the layout" and rows["all_gather"]["excess_per_layer"] == 0.5


def _tp2_four_layers():
    """Megatron TP 2 over tiny-llama's 4 layers, one micro-batch per step, no data parallelism."""
    return resolve_path(REPO / "recipes" / "tiny_tp2_sp", ["parallel.sp=false", "batch.micro_batch_size=8"])


def test_framework_timers_average_the_measured_iterations(bigscience):
    text = BIGSCIENCE.read_text()
    values = []
    last_iteration = None
    for line in text.splitlines():
        m = ITERATION.search(line)
        if m:
            last_iteration = int(m[1])
        t = re.search(r"^time \(ms\) \|.*backward-compute: ([\d.]+)", line)
        if t and last_iteration is not None and last_iteration >= 30:
            values.append(float(t[1]))
    timers = {r["name"]: r for r in framework_timers(bigscience, range(30, 201, 10)).rows()}
    bc = timers["backward-compute"]
    assert bc["samples"] == len(values) == 18
    assert bc["mean_ms"] == pytest.approx(statistics.fmean(values))
    assert bc["category"] == "compute" and timers["backward-params-all-reduce"]["category"] == "communication"
    assert timers["forward-recv"]["category"] == "pipeline" and timers["batch-generator"]["category"] == "data"


def test_nsys_stats_totals():
    t = nsys_stats_totals(parse_nsys_stats_csv(NSYS / "stats" / "profile_stats_column_2024.txt"))
    rows = {r["kind"]: r for r in t.rows()}
    # cuda_gpu_kern_sum: vectorAdd 1,831,281 ns over 1010 instances; memory: 2,432 + 2,336 ns
    assert rows["computation"]["total_ms"] == pytest.approx(1.831281)
    assert rows["computation"]["instances"] == 1010
    assert rows["memory"]["total_ms"] == pytest.approx((2432 + 2336) / 1e6)
    assert sum(r["share_pct"] for r in t.rows()) == pytest.approx(100.0)


def test_kernel_diff_per_step(hta):
    a = parse_kineto_ranks(HTA[:1])
    d = kernel_diff(a, hta, top=5)
    assert len(d) <= 5
    assert all(math.isfinite(r["time_delta_us"]) for r in d.rows())
