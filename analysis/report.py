"""One comparative report for N runs: compute everything first (`build_report`, analysis.report_data), lay it out
as sections (`report_blocks`, analysis.report_sections), then render it as Markdown (`render_markdown`) or one
self-contained HTML file (`render_html`, both analysis.report_render).

Sections: runs and their files (used, skipped with the reason, warnings), the doctor's findings,
how fast (step time, tokens/s/GPU, MFU), memory per rank against the plan, where the time went
(compute, each collective's exposed time, other, idle; overlap), collectives (calls per step,
achieved bus bandwidth against the nccl-tests ceiling, counts against the layout), stragglers, a
kernel-level diff of the first two runs with GPU traces, prediction against measurement, and the
definitions used. Every table carries a `source` column naming the file (and line) each number
came from; strings read from logs and traces are escaped in both formats.
"""
from analysis.report_data import Report, RunResult, build_report
from analysis.report_render import render_html, render_markdown, write_report
from analysis.report_sections import report_blocks

__all__ = ["Report", "RunResult", "build_report", "render_html", "render_markdown", "report_blocks", "write_report"]
