"""nccl-tests / rccl-tests parser: values checked against the fixture text (see fixtures/nccl/README.md)."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.parsers.nccl_tests import (
    COLUMNS,
    bus_factor,
    format_nccl_tests,
    large_message_busbw,
    op_from_name,
    parse_nccl_tests,
    peak_busbw,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"
RESULT_FIXTURES = sorted(p for p in FIXTURES.glob("*.txt") if "debug" not in p.name)


def fixture(name: str) -> Path:
    return FIXTURES / name


def row(table, size, placement, section=None):
    found = [r for r in table.rows() if r["size_bytes"] == size and r["placement"] == placement
             and (section is None or r["section"] == section)]
    assert len(found) == 1, found
    return found[0]


def without_position(rows):
    return [{k: v for k, v in r.items() if k not in ("line", "section")} for r in rows]


# --- real outputs -------------------------------------------------------------------------------

def test_real_h100_pcie_pair_issue194_values_and_interleaved_info_lines():
    t = parse_nccl_tests(fixture("real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt"))
    # The excerpt stops before the footer: said, and nothing else.
    (w,) = t.warnings
    assert "ends without its `Avg bus bandwidth` footer" in w and "after 2,147,483,648 B" in w
    assert len(t) == 4
    assert set(t.column("op")) == {"all_reduce"}
    r = row(t, 1073741824, "out-of-place")
    assert (r["count"], r["dtype"], r["redop"], r["root"]) == (268435456, "float", "sum", -1)
    assert (r["time_us"], r["algbw_GBps"], r["busbw_GBps"], r["wrong"]) == (9306.7, 115.37, 115.37, 0)
    r = row(t, 1073741824, "in-place")
    assert (r["time_us"], r["algbw_GBps"], r["busbw_GBps"]) == (9291.5, 115.56, 115.56)
    r = row(t, 2147483648, "out-of-place")
    assert (r["time_us"], r["busbw_GBps"]) == (18535.0, 115.86)
    assert r["line"] == 12
    # No device lines in the excerpt: the rank count comes from busbw/algbw (all_reduce: 2(n-1)/n = 1).
    assert t.meta.nranks is None and t.meta.nranks_inferred == 2
    assert peak_busbw(t) == 115.93


def test_real_issue194_op_from_command_line_without_a_file_name():
    text = fixture("real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt").read_text()
    t = parse_nccl_tests(text)
    assert t.source == "<text>"
    assert set(t.column("op")) == {"all_reduce"}


def test_real_issue194_nccl_lines_among_the_rows_are_read_as_a_log():
    # `[1] NCCL INFO Channel 00/0 : 1[21000] -> 0[1000] via P2P/direct pointer`, host prefix cut away by the poster.
    t = parse_nccl_tests(fixture("real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt"))
    log = t.meta.nccl_debug
    assert [(r["transport"], r["via_detail"], r["peer_from"], r["peer_to"], r["cuda_dev"], r["line"])
            for r in log.rows()] == [("P2P/direct pointer", "P2P/direct pointer", 1, 0, 1, 6)]
    assert log.source == t.source and log.warnings == ()
    assert t.meta.sections[0].nccl_debug is log  # the run's own lines
    assert parse_nccl_tests(fixture("c_allreduce_v2_13_8xh100.txt")).meta.nccl_debug is None  # no NCCL line


def test_nccl_lines_glued_into_rows_keep_their_own_host():
    # `      524288 ... -1node7:2210:2226 [0] NCCL INFO Channel 00/1 ...`: the row's `-1` is no part of the host.
    t = parse_nccl_tests(fixture("c_allreduce_v2_17_info_glued_midrow.txt"))
    assert [(r["host"], r["pid"], r["transport"], r["line"]) for r in t.meta.nccl_debug.rows()] == [
        ("node7", 2210, "P2P/CUMEM", 15), ("node7", 2210, "P2P/CUMEM", 16)]


def test_real_reduce_scatter_issue128_size_zero_rows():
    t = parse_nccl_tests(fixture("real_reducescatter_2node_4gpu_issue128_EXCERPT.txt"))
    (w,) = t.warnings  # the excerpt stops before the footer
    assert "the reduce_scatter table ends without its `Avg bus bandwidth` footer" in w
    assert set(t.column("op")) == {"reduce_scatter"}
    assert len(t) == 14
    zero = [r for r in t.rows() if r["size_bytes"] == 0]
    assert len(zero) == 10 and {r["count"] for r in zero} == {0}
    assert [r["time_us"] for r in zero[:4]] == [5.70, 5.54, 5.92, 5.51]
    r = row(t, 128, "out-of-place")
    assert (r["count"], r["time_us"], r["algbw_GBps"], r["busbw_GBps"]) == (4, 32.31, 0.0, 0.0)
    assert row(t, 128, "in-place")["algbw_GBps"] == 0.01
    # Size-0 rows are not messages: the large-message figure ignores them.
    assert large_message_busbw(t) == 0.01


# --- constructed layouts -------------------------------------------------------------------------

def test_classic_v2_13_header_devices_footer_and_bandwidth_summaries():
    t = parse_nccl_tests(fixture("c_allreduce_v2_13_8xh100.txt"))
    assert t.warnings == ()  # every row agrees with busbw = algbw * 2(n-1)/n for n = 8
    assert len(t) == 62
    m = t.meta
    assert m.nranks == 8 and m.hosts == ["dgx-h100-07"]
    assert m.devices[3] == {"rank": 3, "group": 0, "pid": 3814, "host": "dgx-h100-07", "device": 3,
                               "busid": "0x5d", "name": "NVIDIA H100 80GB HBM3"}
    assert (m.nthreads, m.ngpus, m.min_bytes, m.max_bytes) == (1, 1, 8, 8589934592)
    assert (m.step_factor, m.warmup_iters, m.iters, m.agg_iters, m.validation, m.graph) == \
        (2, 5, 20, 1, 1, 0)
    assert m.avg_busbw_GBps == 140.191 and m.out_of_bounds == 0
    r = row(t, 8589934592, "out-of-place")
    assert (r["time_us"], r["algbw_GBps"], r["busbw_GBps"], r["line"]) == (41640.0, 206.29, 361.01, 46)
    assert row(t, 8589934592, "in-place")["busbw_GBps"] == 358.60
    assert row(t, 8, "out-of-place")["time_us"] == 14.09
    # The footer average mixes in latency-bound sizes; peak and large-message figures do not.
    assert peak_busbw(t) == 364.52
    assert peak_busbw(t, placement="out-of-place") == 362.82
    large = [349.98, 344.50, 357.10, 350.02, 354.49, 357.62, 362.56, 363.62, 362.82, 354.84, 355.38, 364.33,
             360.76, 364.52, 361.01, 358.60]  # lines 39-46: sizes >= 64 MiB, the top quartile of 31 sizes
    assert large_message_busbw(t) == pytest.approx(statistics.median(large))
    assert large_message_busbw(t, min_bytes=8589934592) == pytest.approx((361.01 + 358.60) / 2)


def test_v2_17_version_lines_redop_none_and_two_hosts():
    t = parse_nccl_tests(fixture("c_allgather_v2_17_2node_16gpu.txt"))
    assert t.warnings == ()
    m = t.meta
    assert (m.nccl_tests_version, m.nccl_version) == ("2.17.3", "2.28.3")
    assert m.nranks == 16 and m.hosts == ["gpu-a017", "gpu-a018"]
    assert m.devices[8]["busid"] == "0000:18:00"
    assert set(t.column("op")) == {"all_gather"} and set(t.column("redop")) == {"none"}
    r = row(t, 4294967296, "in-place")
    assert (r["count"], r["time_us"], r["algbw_GBps"], r["busbw_GBps"]) == (67108864, 12341.5, 348.01, 326.26)
    assert m.avg_busbw_GBps == 127.96


def test_legacy_tables_without_redop_or_root_and_error_column():
    t = parse_nccl_tests(fixture("c_legacy_v2_11_allgather_then_broadcast.txt"))
    assert t.warnings == ()
    assert [s.op for s in t.meta.sections] == ["all_gather", "broadcast"]
    gather = t.where(op="all_gather")
    assert set(gather.column("redop")) == {None} and set(gather.column("root")) == {None}
    assert set(gather.column("wrong")) == {None} and set(gather.column("max_error")) == {0.0}
    first = next(gather.rows())
    assert (first["size_bytes"], first["count"], first["time_us"]) == (0, 0, 11.25)
    bcast = t.where(op="broadcast")
    assert set(bcast.column("root")) == {0} and set(bcast.column("redop")) == {None}
    r = row(t, 134217728, "in-place", section=1)
    assert (r["count"], r["time_us"], r["algbw_GBps"], r["busbw_GBps"]) == (33554432, 1133.4, 118.42, 118.42)
    assert [s.avg_busbw_GBps for s in t.meta.sections] == [36.6565, 34.4446]


def test_rccl_tests_na_wrong_and_device_lines_without_group():
    t = parse_nccl_tests(fixture("c_rccl_tests_allreduce_validation_off.txt"))
    assert t.warnings == ()
    assert set(t.column("wrong")) == {None}
    assert t.meta.rccl_tests_version == "develop:ae3e635" and t.meta.validation == 0
    assert t.meta.devices[0] == {"rank": 0, "group": None, "pid": 80311, "host": "mi300x-n01", "device": 0,
                                    "busid": "0000:05:00", "name": "AMD Instinct MI300X"}
    assert set(t.column("op")) == {"all_reduce"}  # from the file name


def test_rccl_tests_in_place_only_table():
    t = parse_nccl_tests(fixture("c_rccl_tests_inplace_only.txt"))
    assert t.warnings == ()
    assert len(t) == 5 and set(t.column("placement")) == {"in-place"}
    assert set(t.column("op")) == {"all_reduce"}  # from the `$ ./build/all_reduce_perf` line
    r = row(t, 268435456, "in-place")
    assert (r["dtype"], r["count"], r["time_us"], r["busbw_GBps"], r["wrong"]) == ("half", 134217728, 1657.7, 283.38, 0)


def test_mpirun_tag_prefixes_and_info_lines_between_rows():
    t = parse_nccl_tests(fixture("c_reduce_v2_13_mpirun_tagged.txt"))
    assert t.warnings == ()
    assert len(t) == 10 and set(t.column("op")) == {"reduce"} and set(t.column("root")) == {0}
    assert t.meta.nranks == 4 and t.meta.hosts == ["cn041", "cn042"]
    r = row(t, 16777216, "out-of-place")
    assert (r["time_us"], r["algbw_GBps"], r["busbw_GBps"], r["line"]) == (1503.5, 11.16, 11.16, 18)


def test_several_collectives_concatenated_with_prose_after():
    t = parse_nccl_tests(fixture("c_sweep_four_collectives_concatenated.txt"))
    assert t.warnings == ()
    sections = t.meta.sections
    assert [s.op for s in sections] == ["all_reduce", "reduce_scatter", "alltoall", "sendrecv"]
    assert t.meta.ops == ["all_reduce", "alltoall", "reduce_scatter", "sendrecv"]
    for index in range(4):
        assert len(t.where(section=index)) == 18
    assert row(t, 0, "out-of-place", section=2)["time_us"] == 9.88
    assert row(t, 67108864, "in-place", section=3)["busbw_GBps"] == 21.9
    with pytest.raises(ValueError, match="several collectives"):
        peak_busbw(t)
    assert peak_busbw(t, "reduce_scatter") == 21.52


def test_info_lines_glued_into_rows_are_put_back():
    t = parse_nccl_tests(fixture("c_allreduce_v2_17_info_glued_midrow.txt"))
    assert t.warnings == ()
    assert len(t) == 14
    r = row(t, 524288, "out-of-place")
    assert (r["root"], r["time_us"], r["algbw_GBps"], r["busbw_GBps"], r["wrong"]) == (-1, 9.26, 56.63, 56.63, 0)
    assert row(t, 524288, "in-place")["time_us"] == 9.36
    r = row(t, 2097152, "out-of-place")
    assert (r["time_us"], r["busbw_GBps"], r["wrong"]) == (13.90, 150.84, 0)
    assert row(t, 2097152, "in-place")["time_us"] == 14.03
    m = t.meta
    assert (m.nccl_version, m.cuda_runtime, m.cuda_driver) == ("2.22.3", "12.6", "12.6")


def test_output_cut_mid_row_keeps_complete_placements_and_warns():
    path = fixture("c_allreduce_v2_13_truncated_midrow.txt")
    t = parse_nccl_tests(path)
    assert len(t) == 47
    last = list(t.rows())[-1]
    assert (last["size_bytes"], last["placement"], last["time_us"], last["busbw_GBps"]) == \
        (67108864, "out-of-place", 540.7, 217.21)
    cut, footer = t.warnings
    assert str(path) in cut and ":39:" in cut
    # The truncated table reached 64 MiB of the 128 MiB its header asked for (`maxBytes 134217728`).
    assert "measured up to 67,108,864 B of the 134,217,728 B asked for" in footer
    assert t.meta.avg_busbw_GBps is None


def test_per_iteration_columns_and_timestamps():
    t = parse_nccl_tests(fixture("c_v2_19_per_iteration_and_timestamps.txt"))
    assert t.warnings == ()
    assert [s.op for s in t.meta.sections] == ["all_reduce", "reduce_scatter"]
    assert t.meta.nccl_version == "2.29.7" and t.meta.unalign == 0
    r = row(t, 16777216, "in-place", section=0)
    assert (r["time_us"], r["algbw_GBps"], r["busbw_GBps"]) == (81.56, 205.71, 308.56)
    r = row(t, 1073741824, "in-place", section=1)
    assert (r["time_us"], r["busbw_GBps"], r["wrong"]) == (2046.69, 393.47, 0)


def test_2017_layout_time_in_milliseconds():
    t = parse_nccl_tests(fixture("c_allreduce_2017_ms.txt"))
    assert t.warnings == ()
    r = row(t, 1048576, "out-of-place")
    assert (r["time_us"], r["redop"], r["root"], r["max_error"], r["wrong"]) == (73.0, "sum", None, 0.0, None)
    assert t.meta.nranks == 4 and t.meta.avg_busbw_GBps == 24.1108


def test_columns_are_documented_with_units():
    t = parse_nccl_tests(fixture("c_allreduce_v2_13_8xh100.txt"))
    assert list(t.columns) == list(COLUMNS)
    assert {"time_us", "algbw_GBps", "busbw_GBps", "size_bytes"} <= set(t.doc)


# --- bus factor cross-check -----------------------------------------------------------------------

@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 8, 1.75), ("all_reduce", 2, 1.0), ("all_gather", 16, 15 / 16), ("reduce_scatter", 2, 0.5),
    ("alltoall", 4, 0.75), ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("sendrecv", 8, 1.0), ("all_gather", 1, 0.0),
])
def test_bus_factor(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_input():
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allreduce", 8)
    with pytest.raises(ValueError, match="nranks"):
        bus_factor("all_reduce", 0)


def test_busbw_disagreeing_with_algbw_times_factor_is_reported():
    text = fixture("c_allreduce_v2_13_8xh100.txt").read_text().replace("206.29  361.01", "206.29  300.01")
    t = parse_nccl_tests(text, source="all_reduce_edited.txt")
    assert row(t, 8589934592, "out-of-place")["busbw_GBps"] == 300.01  # the row is kept as printed
    assert len(t.warnings) == 1
    assert t.warnings[0].startswith("all_reduce_edited.txt:46:") and "2(n-1)/n" in t.warnings[0] and "8 ranks" in t.warnings[0]


@pytest.mark.parametrize("path", RESULT_FIXTURES, ids=lambda p: p.name)
def test_every_fixture_row_agrees_with_the_bus_factor(path):
    t = parse_nccl_tests(path)
    assert not [w for w in t.warnings if "bus_factor" in w or "is not algbw" in w]
    for s_index, section in enumerate(t.meta.sections):
        n = section.nranks or section.nranks_inferred
        if n is None or section.op == "unknown":
            continue
        for r in t.where(section=s_index).rows():
            if r["algbw_GBps"] >= 1.0:
                assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], n), rel=0.02, abs=0.01)


def test_op_from_names():
    assert op_from_name("/opt/nccl-tests/build/reduce_scatter_perf") == "reduce_scatter"
    assert op_from_name("nccl_allreduce_h100pcie.txt") == "all_reduce"
    assert op_from_name("all_reduce_perf_mpi") == "all_reduce"
    assert op_from_name("logs/alltoall.out") == "alltoall"
    assert op_from_name("reduce_perf") == "reduce"
    assert op_from_name("results.txt") is None


# --- damaged input --------------------------------------------------------------------------------

def test_empty_missing_and_garbage_inputs_warn_instead_of_raising():
    t = parse_nccl_tests("")
    assert len(t) == 0 and any("no nccl-tests result rows" in w for w in t.warnings)
    t = parse_nccl_tests(Path("/nonexistent/all_reduce.txt"))
    assert len(t) == 0 and t.warnings[0].endswith("does not exist; not read")
    t = parse_nccl_tests(b"\x00\xff\xfe garbage \x80".decode("latin-1") + "\n12 34\n")
    assert len(t) == 0


def test_undecodable_bytes_in_a_file(tmp_path):
    data = fixture("c_allreduce_v2_13_8xh100.txt").read_bytes().replace(b"# Using devices", b"# Using \xff\xfe")
    path = tmp_path / "all_reduce.txt"
    path.write_bytes(data)
    t = parse_nccl_tests(path)
    assert len(t) == 62 and any("not UTF-8" in w for w in t.warnings)


FIXTURE_TEXTS = {p.name: p.read_text() for p in RESULT_FIXTURES}
FULL_ROWS = {name: list(parse_nccl_tests(text, source=name).rows()) for name, text in FIXTURE_TEXTS.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FIXTURE_TEXTS)), fraction=st.floats(0.0, 1.0))
def test_truncation_yields_a_prefix_of_the_rows(name, fraction):
    text = FIXTURE_TEXTS[name]
    cut = text[:int(len(text) * fraction)]
    rows = list(parse_nccl_tests(cut, source=name).rows())
    assert rows == FULL_ROWS[name][:len(rows)]


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(FIXTURE_TEXTS)), data=st.data())
def test_garbage_lines_spliced_into_real_files_never_raise(name, data):
    lines = FIXTURE_TEXTS[name].split("\n")
    for _ in range(data.draw(st.integers(1, 5))):
        at = data.draw(st.integers(0, len(lines)))
        lines.insert(at, data.draw(st.text(max_size=80)))
    parse_nccl_tests("\n".join(lines), source=name)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("0123456789 .-#\nabcNA/[]:e+sumfloat")), max_size=400))
def test_arbitrary_text_never_raises(text):
    parse_nccl_tests(text)


# --- writer round trip ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["c_allreduce_v2_13_8xh100.txt", "c_allgather_v2_17_2node_16gpu.txt",
                                  "c_rccl_tests_allreduce_validation_off.txt", "c_rccl_tests_inplace_only.txt",
                                  "c_reduce_v2_13_mpirun_tagged.txt"])
def test_writer_round_trip_of_parsed_files(name):
    t = parse_nccl_tests(fixture(name))
    op = t.meta.op
    text = format_nccl_tests(op, t.rows(), t.meta._asdict())
    back = parse_nccl_tests(text, source="sweep.txt")
    assert back.warnings == ()
    assert without_position(back.rows()) == without_position(t.rows())
    for key in ("op", "nranks", "devices", "hosts", "nthreads", "ngpus", "min_bytes", "max_bytes", "iters",
                "warmup_iters", "validation", "avg_busbw_GBps"):
        assert getattr(back.meta, key) == getattr(t.meta, key), key


def test_writer_emits_nccl_tests_own_layout():
    t = parse_nccl_tests(fixture("c_allgather_v2_17_2node_16gpu.txt"))
    text = format_nccl_tests("all_gather", t.rows(), t.meta._asdict())
    lines = text.splitlines()
    original = fixture("c_allgather_v2_17_2node_16gpu.txt").read_text().splitlines()
    data = [line for line in original if line[:1] == " "]
    assert [line for line in lines if line[:1] == " "] == data  # byte-identical rows
    assert lines[0] == "# nccl-tests version 2.17.3 nccl-headers=22803 nccl-library=22803"
    assert lines[1] == "# Collective test starting: all_gather_perf"
    assert original[5] in lines  # a device line
    assert "# Out of bounds values : 0 OK" in lines
    assert "# Avg bus bandwidth    : 127.96 " in lines
    assert lines[-1] == "# Collective test concluded: all_gather_perf"


def test_writer_prints_like_nccl_tests_when_values_overflow_the_column():
    rows = [{"size_bytes": 1 << 33, "count": 1 << 31, "dtype": "float", "redop": "sum", "root": -1,
             "placement": p, "time_us": 123456.7, "algbw_GBps": 1816.16, "busbw_GBps": 3178.28, "wrong": None}
            for p in ("out-of-place", "in-place")]
    header = {"devices": [{"rank": 0, "host": "h", "device": 0}], "nccl_version": (2, 21, 5), "iters": None}
    text = format_nccl_tests("all_reduce", rows, header)  # torch reports the NCCL version as a tuple
    line = next(line for line in text.splitlines() if line.startswith("  8589934592"))
    assert line.split()[5:9] == ["123457", "1816.2", "3178.3", "N/A"]
    back = parse_nccl_tests(text)
    assert (back.meta.nccl_version, back.meta.iters) == ("2.21.5", 20)  # None: nccl-tests' default
    first = next(back.rows())
    assert (first["time_us"], first["algbw_GBps"], first["wrong"]) == (123457.0, 1816.2, None)


def test_writer_rejects_rows_it_cannot_lay_out():
    r = {"size_bytes": 8, "count": 2, "dtype": "float", "redop": "sum", "root": -1, "time_us": 1.0,
         "algbw_GBps": 0.0, "busbw_GBps": 0.0, "wrong": 0}
    with pytest.raises(ValueError, match="need"):
        format_nccl_tests("all_reduce", [dict(r, placement="out-of-place"), dict(r, size_bytes=16, placement="in-place"),
                                         dict(r, size_bytes=16, placement="out-of-place")])
    with pytest.raises(ValueError, match="unknown collective"):
        format_nccl_tests("allreduce", [])


cents = st.integers(0, 99999).map(lambda v: v / 100)  # what %.2f prints exactly within the column widths


@settings(max_examples=100, deadline=None)
@given(op=st.sampled_from(["all_reduce", "all_gather", "broadcast", "sendrecv", "alltoall"]),
       sizes=st.lists(st.integers(0, 1 << 34), min_size=1, max_size=12, unique=True),
       values=st.data(), nranks=st.integers(1, 16), validation=st.booleans())
def test_writer_round_trip_property(op, sizes, values, nranks, validation):
    rows = []
    for size in sorted(sizes):
        for placement in ("out-of-place", "in-place"):
            algbw = values.draw(cents.filter(lambda v: v < 500))  # busbw <= 2 algbw stays within 999.99
            rows.append({"section": 0, "op": op, "size_bytes": size, "count": size // 4, "dtype": "float",
                         "redop": "sum", "root": -1, "placement": placement,
                         "time_us": values.draw(cents.filter(lambda v: v < 10000)), "algbw_GBps": algbw,
                         "busbw_GBps": round(algbw * bus_factor(op, nranks), 2),
                         "wrong": values.draw(st.integers(0, 5)) if validation else None, "max_error": None})
    devices = [{"rank": r, "group": 0, "pid": 100 + r, "host": f"n{r // 8}", "device": r % 8, "busid": "0x00",
                "name": "GPU"} for r in range(nranks)]
    back = parse_nccl_tests(format_nccl_tests(op, rows, {"devices": devices}))
    assert without_position(back.rows()) == without_position(rows)
    assert back.meta.nranks == nranks
    assert not [w for w in back.warnings if "is not algbw" in w]


def test_a_footer_reading_inf_is_a_dropped_figure_not_a_run_cut_short(tmp_path):
    """`# Avg bus bandwidth : inf` is a footer whose figure is impossible: the run finished, and the warning says the
    figure was dropped, not that the table ends without its footer."""
    src = FIXTURES / "c_allgather_v2_17_2node_16gpu.txt"
    text = src.read_text()
    assert re.search(r"# Avg bus bandwidth\s*: [\d.]+", text)
    path = tmp_path / "inf.txt"
    path.write_text(re.sub(r"(# Avg bus bandwidth\s*: )[\d.]+", r"\1inf", text))
    warnings = parse_nccl_tests(path).warnings
    assert any("avg_busbw_GBps dropped as physically impossible" in w for w in warnings), warnings
    assert not any("cut short" in w for w in warnings), warnings
