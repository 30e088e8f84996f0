"""The sweep's text output is nccl-tests' layout: analysis/parsers/nccl_tests.py reads back the JSON's numbers."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.parsers import nccl_tests as parser
from launch.comm import commbench_spec, nccl_format
from launch.comm.commbench_spec import (
    DTYPES,
    NCCL_TESTS_OP,
    OPS,
    read_result,
    result_rows,
    shapes,
    sweep_sizes,
    write_result,
)
from launch.comm.nccl_format import BW_WIDTH, TIME_WIDTH, float_field
from launch.run.rundir import RunDir


def printed(value: float, width: int) -> float:
    return float(float_field(value, width))


def make_result(op, n, seconds, wrong, dtype="float32", groups=None):
    d = DTYPES[dtype]
    plan = shapes(op, sweep_sizes(8, 1 << 20, 2), d.size, n)
    groups = groups or [list(range(n))]
    participants = sum(len(g) for g in groups)
    sums = [[(seconds(i, p) * participants, wrong(i, p)) for p in range(2)] for i in range(len(plan))]
    rows = result_rows(op, plan, sums, d, n, participants)
    devices = [{"rank": r, "group": 0, "pid": 1000 + r, "host": "node0", "device": r, "busid": "cpu",
                "name": "CPU rank (gloo)"} for r in groups[0]]
    return {"version": commbench_spec.RESULT_VERSION, "op": op, "nccl_tests_op": NCCL_TESTS_OP[op], "dtype": dtype,
            "groups": groups, "group_size": n, "min_bytes": 8, "max_bytes": 1 << 20, "step_factor": 2,
            "warmup_iters": 1, "iters": 3, "devices": devices, "nccl_version": None, "rows": rows,
            "avg_busbw_GBps": sum(r["busbw_GBps"] for r in rows) / len(rows),
            "out_of_bounds": sum(r["wrong"] for r in rows)}


def assert_reads_back(run: RunDir, result: dict) -> None:
    op = result["op"]
    back = read_result(run.commbench_json(op))
    assert back == result
    t = parser.parse_nccl_tests(run.commbench_text(op))
    assert t.warnings == ()  # every busbw agrees with algbw × the bus factor of the group size
    assert t.meta.op == NCCL_TESTS_OP[op] and t.meta.nranks == result["group_size"]
    assert (t.meta.min_bytes, t.meta.max_bytes, t.meta.step_factor) == (8, 1 << 20, 2)
    assert (t.meta.warmup_iters, t.meta.iters, t.meta.validation) == (1, 3, 1)
    assert t.meta.out_of_bounds == result["out_of_bounds"]
    assert t.meta.avg_busbw_GBps == pytest.approx(result["avg_busbw_GBps"], rel=1e-5, abs=1e-6)
    parsed = list(t.rows())
    assert len(parsed) == len(result["rows"])
    for got, want in zip(parsed, result["rows"]):
        for key in ("size_bytes", "count", "dtype", "redop", "root", "placement", "wrong"):
            assert got[key] == want[key], key
        assert got["time_us"] == printed(want["time_us"], TIME_WIDTH)
        assert got["algbw_GBps"] == printed(want["algbw_GBps"], BW_WIDTH)
        assert got["busbw_GBps"] == printed(want["busbw_GBps"], BW_WIDTH)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_every_op_reads_back_with_the_bus_factor_of_its_group(tmp_path, op, n):
    run = RunDir(tmp_path)
    result = make_result(op, n, lambda i, p: 2e-6 * (1.5 ** i) * (1 + 0.1 * p), lambda i, p: 0)
    write_result(run, result)
    assert_reads_back(run, result)
    factor = nccl_format.bus_factor(NCCL_TESTS_OP[op], n)
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor, rel=1e-12) for r in result["rows"])
    text = run.commbench_text(op).read_text()
    assert "# Out of bounds values : 0 OK" in text and f"# Collective test starting: {NCCL_TESTS_OP[op]}_perf" in text


def test_wrong_elements_show_in_the_column_and_the_footer(tmp_path):
    run = RunDir(tmp_path)
    result = make_result("all_reduce", 4, lambda i, p: 1e-4, lambda i, p: 3 if (i, p) == (2, 1) else 0)
    write_result(run, result)
    assert_reads_back(run, result)
    assert "# Out of bounds values : 3 FAILED" in run.commbench_text("all_reduce").read_text()


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(OPS), n=st.integers(2, 16), dtype=st.sampled_from(sorted(DTYPES)),
       times=st.lists(st.floats(1e-7, 50.0), min_size=2, max_size=2))
def test_round_trip_property(tmp_path_factory, op, n, dtype, times):
    run = RunDir(tmp_path_factory.mktemp("rt"))
    result = make_result(op, n, lambda i, p: times[p] * (1 + i / 7), lambda i, p: (i * p) % 3, dtype=dtype)
    write_result(run, result)
    assert_reads_back(run, result)


def test_the_parser_writes_with_launchs_writer():
    # one writer of the format: analysis re-exports launch's (launch never imports analysis)
    assert parser.format_nccl_tests is nccl_format.format_nccl_tests
    assert parser.bus_factor is nccl_format.bus_factor


def test_launch_never_imports_analysis():
    from tests.conftest import REPO

    offenders = [str(p) for p in (REPO / "launch").rglob("*.py")
                 if any(line.lstrip().startswith(("import analysis", "from analysis"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
