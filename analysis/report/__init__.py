"""One comparative report for N runs: compute everything first (`build_report`, analysis.report.data), lay it out
as sections (`report_blocks`, analysis.report.sections), then render it as Markdown (`render_markdown`) or one
self-contained HTML file (`render_html`, both analysis.report.render).

Sections: runs and their files (used, skipped with the reason, warnings), the doctor's findings,
how fast (step time, tokens/s/GPU, MFU), memory per rank against the plan, where the time went
(compute, each collective's exposed time, other, idle; overlap), collectives (calls per step,
achieved bus bandwidth against the nccl-tests ceiling, counts against the layout, where each call waited:
arrival skew apart from transfer), stragglers and who the collectives waited for, a kernel-level diff of the first two runs with GPU traces, prediction against measurement, and the
definitions used. Every table carries a `source` column naming the file (and line) each number
came from; strings read from logs and traces are escaped in both formats.

The layer on top of analysis/: it may import analysis.analyzers and analysis.parsers, neither of which imports it.
analysis.report.plots draws the figures (matplotlib), analysis.report.sections places them. The names below load
their module on first use, so that `python -m analysis doctor` (analysis.report.data alone) never imports
matplotlib.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Report", "RunResult", "build_report", "render_html", "render_markdown", "report_blocks", "write_report"]


def __getattr__(name: str) -> Any:
    if name in ("Report", "RunResult", "build_report"):
        from analysis.report import data as module
    elif name in ("render_html", "render_markdown", "write_report"):
        from analysis.report import render as module
    elif name == "report_blocks":
        from analysis.report import sections as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
