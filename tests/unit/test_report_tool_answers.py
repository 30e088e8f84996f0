"""Each tool's own summary figures shown in the report as the tool printed them: the DeepSpeed Flops Profiler's
forward and backward FLOPS per GPU, and HTA's temporal breakdown in µs beside its shares (the nccl-tests average and
the transports are in test_comm_tables.py)."""
from __future__ import annotations

import re

from analysis.report import build_report, render_markdown
from tests.unit.report_support import HTA, LOGS


def _table(md: str, heading: str) -> list[list[str]]:
    """The cells of the first table after `heading`, header row first."""
    block = md.split(heading)[1].split("\n\n")[1]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines() if "---" not in line]


def test_the_flops_profilers_forward_and_backward_flops_per_gpu_are_shown(tmp_path):
    path = LOGS / "c_ds_v0_17_flops_profiler.txt"
    printed = dict(re.findall(r"^(fwd|bwd) FLOPS per GPU = [^:]*:\s+([\d.]+) TFLOPS", path.read_text(), re.MULTILINE))
    assert set(printed) == {"fwd", "bwd"}
    out = tmp_path / "r.md"
    render_markdown(build_report([(None, path)]), out)
    header, row = _table(out.read_text(), "### DeepSpeed Flops Profiler")
    cells = dict(zip(header, row, strict=True))
    assert (cells["fwd TFLOP/s/GPU"], cells["bwd TFLOP/s/GPU"]) == (printed["fwd"], printed["bwd"])


def test_htas_absolute_compute_non_compute_and_idle_times_are_shown_beside_the_shares(tmp_path):
    from tests.unit.test_kineto import HTA_TEMPORAL_SAMPLED

    d = tmp_path / "sampled"
    d.mkdir()
    for src in HTA:
        (d / src.name).write_bytes(src.read_bytes())
    out = tmp_path / "r.md"
    render_markdown(build_report([(None, d)]), out)
    header, *rows = _table(out.read_text(), "### Where the time went, every rank")  # the appendix's rows
    got = {}
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        got[int(cells["rank"])] = (*(int(cells[k].replace(",", "")) for k in (
            "idle, µs", "compute, µs", "non-compute, µs", "span, µs")), *(float(cells[k]) for k in (
                "idle %", "compute %", "non-compute %")))
    # HTA 0.5.0's get_temporal_breakdown: its µs exactly, its shares (two decimals) to the report's one.
    assert {rank: (*v[:4], *(round(p, 1) for p in v[4:])) for rank, v in HTA_TEMPORAL_SAMPLED.items()} == got
