"""The nccl-tests and NCCL_DEBUG tables of the report, against the real files read here with this test's own
regexes."""
from __future__ import annotations

import re

import pytest

from analysis.analyzers.comm_tables import nccl_tests_rows, transports
from analysis.parsers.nccl_debug import parse_nccl_debug
from analysis.parsers.nccl_tests import parse_nccl_tests
from analysis.report import build_report, render_markdown
from tests.unit.report_support import ALLREDUCE_8XH100, NCCL

ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+-?\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)"
                 r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s*$")
CONN = re.compile(r"Channel (\d+)/\d+ : (\d+)\[\d+\] -> (\d+)\[\d+\](?: \[\w+\])? via (\S+)")
DEBUG = NCCL / "c_debug_v2_21_2node_ib_gdrdma.txt"


def test_nccl_tests_rows_hold_both_placements_of_every_printed_size():
    want = [m for m in map(ROW.match, ALLREDUCE_8XH100.read_text().splitlines()) if m]
    assert len(want) > 20
    got = list(nccl_tests_rows(parse_nccl_tests(ALLREDUCE_8XH100)).rows())
    for m, g in zip(want, got, strict=True):
        assert (g["size_bytes"], g["count"], g["dtype"], g["redop"]) == (int(m[1]), int(m[2]), m[3], m[4])
        assert (g["oop_time_us"], g["oop_busbw_GBps"], g["ip_time_us"], g["ip_busbw_GBps"]) == pytest.approx(
            (float(m[5]), float(m[7]), float(m[9]), float(m[11])))
        assert g["wrong"] == int(m[8]) + int(m[12])
        assert (g["ranks"], g["ranks_from"]) == (8, "printed")  # the header lists ranks 0-7


def test_every_printed_row_is_kept_when_sizes_repeat():
    # nccl-tests prints a row per step, and a reduce_scatter sweep from 0 B prints five 0-byte rows: five rows.
    path = NCCL / "real_reducescatter_2node_4gpu_issue128_EXCERPT.txt"
    want = [(n, m) for n, m in enumerate(map(ROW.match, path.read_text().splitlines()), start=1) if m]
    assert [int(m[1]) for _, m in want] == [0, 0, 0, 0, 0, 128, 256]
    got = list(nccl_tests_rows(parse_nccl_tests(path)).rows())
    assert [(g["size_bytes"], g["oop_time_us"], g["ip_time_us"], g["source"]) for g in got] == [
        (int(m[1]), float(m[5]), float(m[9]), f"{path}:{n}") for n, m in want]


AVG = re.compile(r"^#? *Avg bus bandwidth *: *(\S+)")


@pytest.mark.parametrize("name", ["c_allreduce_v2_13_8xh100.txt", "c_sweep_four_collectives_concatenated.txt",
                                  "c_legacy_v2_11_allgather_then_broadcast.txt", "c_allreduce_2017_ms.txt"])
def test_each_runs_own_average_is_kept_with_its_line(name):
    path = NCCL / name
    want = [(float(m[1]), f"{path}:{n}") for n, m in enumerate(map(AVG.match, path.read_text().splitlines()), 1) if m]
    assert want
    averages = nccl_tests_rows(parse_nccl_tests(path)).meta.averages
    assert [(a.avg_busbw_GBps, a.source) for a in averages] == want


def test_an_output_without_its_average_says_so():
    path = NCCL / "real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt"
    (a,) = nccl_tests_rows(parse_nccl_tests(path)).meta.averages
    assert (a.op, a.ranks, a.ranks_from, a.rows, a.avg_busbw_GBps, a.source) == (
        "all_reduce", 2, "inferred from busbw/algbw", 2, None, str(path))


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-nan", "1e400"])
def test_a_footer_that_is_no_bandwidth_is_dropped_not_called_cut_short(tmp_path, value):
    """printf writes inf, -inf, nan and -nan; the footer is there (the run finished), its figure is impossible."""
    text = (NCCL / "c_allreduce_v2_13_8xh100.txt").read_text()
    (line,) = [n for n, m in enumerate(map(AVG.match, text.splitlines()), 1) if m]
    path = tmp_path / "footer.txt"
    path.write_text(re.sub(r"(Avg bus bandwidth *: *)\S+", rf"\g<1>{value}", text))
    table = parse_nccl_tests(path)
    assert not any("cut short" in w for w in table.warnings), table.warnings
    assert any("avg_busbw_GBps dropped as physically impossible" in w for w in table.warnings), table.warnings
    (a,) = nccl_tests_rows(table).meta.averages
    assert (a.avg_busbw_GBps, a.footer_printed, a.source) == (None, True, f"{path}:{line}")


def test_the_report_shows_the_average_nccl_tests_printed(tmp_path):
    rep = build_report([(None, ALLREDUCE_8XH100), (None, NCCL / "real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt")])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text()
    (avg,) = [m[1] for m in map(AVG.match, ALLREDUCE_8XH100.read_text().splitlines()) if m]
    assert f"| all_reduce | 8 (printed) | 31 | {avg} | c_allreduce_v2_13_8xh100.txt:48 |" in md
    assert "| 2 | not printed (the output was cut short) | real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt |" in md


def test_the_report_shows_the_transports_an_nccl_tests_output_logged(tmp_path):
    path = NCCL / "real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt"
    rep = build_report([(None, path)])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text().split("### Transports (NCCL_DEBUG)")[1]
    assert ("| 1 → 0 | – | P2P/direct pointer | no | 1 | 1 | – | real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt:6 |"
            in md)


def test_the_report_names_a_roce_connection_roce(tmp_path):
    # Excerpt (e): `NET/IB : Using [0]mlx5_0:1/RoCE`, then `Ring 00 : 15[41000] -> 0[1b000] [receive] via NET/IB/0`.
    rep = build_report([(None, NCCL / "real_debug_transport_excerpts_from_issues.txt")])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text()
    assert "| 15 → 0 | ring | NET/RoCE | no | 1 | 0 | – | real_debug_transport_excerpts_from_issues.txt:37 |" in md


def test_transports_name_every_rank_pair_and_whether_it_uses_gpudirect_rdma():
    lines = [m for m in map(CONN.search, DEBUG.read_text().splitlines()) if m]
    assert lines
    want = {(int(m[2]), int(m[3]), "GDRDMA" in m[4]) for m in lines}
    table = transports(parse_nccl_debug(DEBUG))
    got = {(g["peer_from"], g["peer_to"], g["gdrdma"]) for g in table.rows()}
    assert got == want
    # Every channel of a pair counted once per transport and kind: the channels over all rows are at least the
    # distinct (channel, from, to) of the log (a channel can appear in a ring and in a tree).
    assert sum(g["channels"] for g in table.rows()) >= len({(m[1], m[2], m[3]) for m in lines})


def test_the_report_shows_both_tables(tmp_path):
    rep = build_report([(None, DEBUG), (None, ALLREDUCE_8XH100)])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text()
    assert "### nccl-tests per message size" in md and "### Transports (NCCL_DEBUG)" in md
    assert "NET/IB/GDRDMA | yes" in md and "8 (printed)" in md


def _hta_sampled(tmp_path):
    """HTA's two sampled traces, alone in a folder: one run with GPU kernels."""
    from tests.unit.report_support import HTA

    d = tmp_path / "sampled"
    d.mkdir()
    for src in HTA:
        (d / src.name).write_bytes(src.read_bytes())
    return d


def test_the_report_shows_htas_kernel_types_to_the_microsecond(tmp_path):
    from tests.unit.test_kineto import HTA_KERNEL_TYPES_SAMPLED

    rep = build_report([(None, _hta_sampled(tmp_path))])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    md = out.read_text()
    assert "### GPU kernel types (HTA's get_gpu_kernel_breakdown)" in md
    # the section holds the run's row (its distribution); every rank's row is in the appendix
    section = md.split("### GPU kernel types, every rank")[1].split("\n\n")[1]
    summed: dict[str, int] = {}
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        summed[cells[2]] = summed.get(cells[2], 0) + int(cells[3].replace(",", ""))
    assert summed == HTA_KERNEL_TYPES_SAMPLED  # HTA 0.5.0's own answer, summed over ranks as it does


def test_one_gpu_run_is_not_called_cpu_only_and_cpu_runs_get_no_cuda_advice(tmp_path):
    from analysis.analyzers import doctor as D
    from analysis.table import Table
    from tests.unit.report_support import make_run_dir

    rep = build_report([(None, _hta_sampled(tmp_path))])
    assert rep.kernel_diff is None and "only sampled's do" in rep.kernel_diff_note
    assert "CPU-only" not in rep.kernel_diff_note
    cpu = build_report([(None, make_run_dir(tmp_path / "cpu"))])
    assert "CPU-only" in cpu.kernel_diff_note
    # The idle rule's advice follows the basis: a CPU-only breakdown gets none about CUDA.
    row = {"rank": 0, "basis": "cpu_ops", "idle_pct": 40.0, "idle_us": 4000.0, "span_us": 10000.0, "source": "t"}
    (finding,) = D.idle_device("r", Table.from_rows("b", {k: "" for k in row}, [row]))
    assert "CUDA" not in finding.fix and "torch.compile" in finding.fix
    (gpu_finding,) = D.idle_device("r", Table.from_rows("b", {k: "" for k in row}, [{**row, "basis": "gpu_kernels"}]))
    assert "CUDA graphs" in gpu_finding.fix


def test_deepspeeds_comms_logger_summary_is_read_row_by_row_and_overflowed_totals_are_left_out(tmp_path):
    from analysis.parsers.deepspeed_log import parse_deepspeed_log
    from tests.unit.report_support import ALCF

    lines = ALCF.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "Comm. Op" in line)
    unit = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}
    want, op = [], None
    for line in lines[start + 1:]:
        if m := re.fullmatch(r"\s*([\d.]+)\s*(K?M?G?B)\s+(\d+)\s+(-?[\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*", line):
            want.append((op, float(m[1]) * unit[m[2]], int(m[3]), float(m[4]), float(m[7])))
        elif m := re.fullmatch(r"\s*([a-z_]+)\s*", line):
            op = m[1]
        else:
            break
    assert len(want) >= 10 and any(w[3] < 0 for w in want)
    log = parse_deepspeed_log(ALCF)
    got = [(r["comm_op"], r["message_bytes"], r["count"], r["total_latency_ms"], r["busbw_gbps"])
           for r in log.rows() if r["kind"] == "comms"]
    for w, g in zip(want, got, strict=True):
        assert g[:3] == w[:3] and g[4] == w[4]
        assert g[3] == (None if w[3] < 0 else w[3])  # DeepSpeed's overflowed (negative) sums are not shown
    assert sum("counter overflowed" in x for x in log.warnings) == sum(w[3] < 0 for w in want)
    d = tmp_path / "alcf"
    d.mkdir()
    (d / "train.log").write_text(ALCF.read_text())
    rep = build_report([(None, d)])
    out = tmp_path / "r.md"
    render_markdown(rep, out)
    assert "### DeepSpeed comms logger" in out.read_text()


def test_the_doctor_judges_the_transports_an_nccl_tests_output_logged(tmp_path):
    """nccl-tests run with NCCL_DEBUG=INFO print NCCL's connection lines among their rows: the doctor reads those as it
    reads a log of their own (here a RoCE pair connected over NET/Socket, between the header and the first row)."""
    from analysis.report import build_report

    log = (NCCL / "c_debug_v2_19_roce_listed_socket_used.txt").read_text().splitlines()
    tests = (NCCL / "real_allreduce_h100pcie_2gpu_issue194_EXCERPT.txt").read_text().splitlines()
    at = next(i for i, line in enumerate(tests) if line.lstrip().startswith("1073741824"))
    path = tmp_path / "all_reduce_perf.txt"
    path.write_text("\n".join(tests[:at] + [x for x in log if "NCCL INFO" in x] + tests[at:]) + "\n")
    separate = build_report([(None, NCCL / "c_debug_v2_19_roce_listed_socket_used.txt")]).findings
    inside = build_report([(None, path)]).findings
    assert [f.rule for f in separate if f.rule == "slow_transport"]
    assert [f.rule for f in inside if f.rule == "slow_transport"] == [f.rule for f in separate if f.rule == "slow_transport"]
