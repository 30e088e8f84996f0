"""Parse `nsys stats` text into one table of report rows.

`parse_nsys_stats_csv` reads what `nsys stats` prints: CSV (`--format csv`, the default for files
and pipes) and the human `column` format, one block per report, optionally preceded by the banner
` ** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):`, a `Processing [...] with [.../x.py]...`
line, a `[5/8] Executing 'x' stats report` line (`nsys profile --stats=true`) or an older title
such as `CUDA Kernel Statistics:`. Headers from every generation are understood: 2020
(`Time(%)`, `Average`, `Minimum`, `Maximum`, no unit), 2021 (`Average (ns)`), 2022+ (`Time (%)`,
`Avg (ns)`, `Med (ns)`), raw SQL aliases (`Total Time:dur_ns`), and `--timeunit` variants.
The kernel kind and collective of a row follow analysis.parsers.nsys's rules (those of the SQLite table).
"""
from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from analysis.parsers._text import read_source, split_lines
from analysis.parsers.gpu_kernels import nccl_kernel_info
from analysis.parsers.nsys import kernel_kind
from analysis.table import Table

STATS_COLUMNS: dict[str, str] = {
    "report": "nsys report id (cuda_gpu_kern_sum, cuda_api_sum, nvtx_sum, cuda_gpu_mem_time_sum, "
              "cuda_gpu_mem_size_sum, osrt_sum, ...); older ids (gpukernsum, cudaapisum, nvtxppsum, ...) are "
              "mapped to today's; guessed from the header when no banner names it (meta.guessed)",
    "name": "kernel / API function / NVTX range / memory operation name as printed; nvtx_sum's "
            "default-domain prefix ':' is removed",
    "style": "nvtx ranges: 'PushPop' or 'StartEnd' as printed; None otherwise",
    "time_pct": "Time (%) column: share of the report's total time",
    "total_ns": "Total Time, in ns (converted from --timeunit us/ms/s)",
    "instances": "Instances / Num Calls / Calls / Count / Operations",
    "avg_ns": "average duration in ns",
    "med_ns": "median duration in ns (None before nsys 2021.2 printed no median)",
    "min_ns": "shortest duration in ns",
    "max_ns": "longest duration in ns",
    "stddev_ns": "standard deviation in ns (None where the report has none)",
    "total_bytes": "memory size reports: total bytes (from MB = 1e6 B, KiB = 1024 B, ...)",
    "avg_bytes": "memory size reports: average bytes per operation",
    "min_bytes": "memory size reports: smallest operation in bytes",
    "max_bytes": "memory size reports: largest operation in bytes",
    "start_ns": "trace reports: Start, in ns",
    "dur_ns": "trace reports: Duration, in ns",
    "kind": "kernel and memory reports: 'communication', 'memory', 'other' or 'computation' (the rule of the "
            "SQLite table); None for API and NVTX reports",
    "collective": "collective parsed from an NCCL kernel name; None otherwise",
    "extra": "dict of the other columns of the row, header label -> text as printed",
    "line": "1-based line number of the row in the source text",
}

# --- nsys stats ---------------------------------------------------------------------------------

# Report ids before the 2021.6 renaming, and the title lines older versions printed instead of a banner.
_OLD_REPORT_IDS = {
    "gpukernsum": "cuda_gpu_kern_sum", "cudaapisum": "cuda_api_sum", "gpumemtimesum": "cuda_gpu_mem_time_sum",
    "gpumemsizesum": "cuda_gpu_mem_size_sum", "gpusum": "cuda_gpu_sum", "nvtxsum": "nvtx_sum",
    "nvtxppsum": "nvtx_pushpop_sum", "nvtxsesum": "nvtx_startend_sum", "osrtsum": "osrt_sum",
    "cudaapitrace": "cuda_api_trace", "gputrace": "cuda_gpu_trace", "kernexecsum": "cuda_kern_exec_sum",
    "kernexectrace": "cuda_kern_exec_trace", "nvtxkernsum": "nvtx_kern_sum", "nvtxpptrace": "nvtx_pushpop_trace",
}
_OLD_TITLES = (
    (re.compile(r"^CUDA API Statistics", re.I), "cuda_api_sum", None),
    (re.compile(r"^CUDA Kernel Statistics", re.I), "cuda_gpu_kern_sum", None),
    (re.compile(r"^CUDA Memory Operation Statistics \(by time\)", re.I), "cuda_gpu_mem_time_sum", None),
    (re.compile(r"^CUDA Memory Operation Statistics \(by size in (\w+)\)", re.I), "cuda_gpu_mem_size_sum", 1),
    (re.compile(r"^NVTX (?:Push-Pop )?Range Statistics", re.I), "nvtx_sum", None),
    (re.compile(r"^Operating System Runtime API Statistics", re.I), "osrt_sum", None),
)
_BANNER = re.compile(r"^\s*\*\*\s*(?P<title>.*?)\s*\((?P<id>[A-Za-z0-9_]+)\)\s*:?\s*$")
_PROCESSING = re.compile(r"^\s*Processing \[[^\]]*\] with \[(?P<script>[^\]]*)\]")
_EXECUTING = re.compile(r"^\s*(?:\[\d+/\d+\]\s*)?Executing '(?P<id>[A-Za-z0-9_]+)' stats report")
_SKIPPED = re.compile(r"^\s*SKIPPED:\s*(?P<why>.*)$")
_DASHES = re.compile(r"^\s*-+(?:\s+-+)*\s*$")
_LABEL = re.compile(r"^(?P<label>.*?)\s*(?:\((?P<unit>[^()]*)\)|:(?P<raw>[A-Za-z]+_[A-Za-z%]+))?\s*$")
_TIME_UNITS = {"ns": 1.0, "nsec": 1.0, "nanoseconds": 1.0, "us": 1e3, "μs": 1e3, "usec": 1e3, "ms": 1e6,
               "msec": 1e6, "s": 1e9, "sec": 1e9}
_SIZE_UNITS = {"b": 1.0, "bytes": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024.0, "mib": 1024.0 ** 2,
               "gib": 1024.0 ** 3}
_COUNT_LABELS = {"instances", "num calls", "calls", "count", "operations"}
_STAT_LABELS = {"avg": "avg", "average": "avg", "med": "med", "median": "med", "min": "min", "minimum": "min",
                "max": "max", "maximum": "max", "stddev": "stddev", "std dev": "stddev"}
_NAME_LABELS = {"name", "range", "operation"}
_KNOWN_LABELS = (_COUNT_LABELS | set(_STAT_LABELS) | _NAME_LABELS
                 | {"time", "total time", "total", "style", "start", "duration", "end", "corrid", "pid", "tid"})


@dataclass
class _Col:
    label: str
    field: str | None       # output column, or None for `extra`
    scale: float = 1.0


def _label_parts(text: str) -> tuple[str, str | None]:
    m = _LABEL.match(text.strip())
    label = (m["label"] if m else text).strip().lower()
    unit = None
    if m and m["unit"] is not None:
        unit = m["unit"].strip()
    elif m and m["raw"]:
        # Raw SQL aliases some versions print: 'Total Time:dur_ns', 'Time:ratio_%', 'Total:mem_B'.
        unit = m["raw"].split("_", 1)[1]
    return label, unit


def _columns_for(labels: Sequence[str], report: str | None, size_unit: str | None) -> list[_Col]:
    sizes = report == "cuda_gpu_mem_size_sum"
    cols = []
    for raw in labels:
        label, unit = _label_parts(raw)
        u = (unit or "").lower()
        if label == "time" and u == "%":
            cols.append(_Col(raw, "time_pct"))
        elif label in ("total time", "total") and (u in _TIME_UNITS or (not u and not sizes)):
            cols.append(_Col(raw, "total_ns", _TIME_UNITS.get(u, 1.0)))
        elif label in ("total", "total size") and (u in _SIZE_UNITS or sizes):
            cols.append(_Col(raw, "total_bytes", _SIZE_UNITS.get(u or (size_unit or "kib").lower(), 1.0)))
        elif label in _COUNT_LABELS:
            cols.append(_Col(raw, "instances"))
        elif label in _STAT_LABELS:
            stat = _STAT_LABELS[label]
            if u in _SIZE_UNITS or (sizes and not u):
                field = f"{stat}_bytes" if stat in ("avg", "min", "max") else None
                cols.append(_Col(raw, field, _SIZE_UNITS.get(u or (size_unit or "kib").lower(), 1.0)))
            else:
                cols.append(_Col(raw, f"{stat}_ns", _TIME_UNITS.get(u, 1.0)))
        elif label in _NAME_LABELS:
            cols.append(_Col(raw, "name"))
        elif label == "style":
            cols.append(_Col(raw, "style"))
        elif label in ("start", "start time") and (u in _TIME_UNITS or not u):
            cols.append(_Col(raw, "start_ns", _TIME_UNITS.get(u, 1.0)))
        elif label == "duration" and (u in _TIME_UNITS or not u):
            cols.append(_Col(raw, "dur_ns", _TIME_UNITS.get(u, 1.0)))
        else:
            cols.append(_Col(raw, None))
    return cols


def _known_count(labels: Sequence[str]) -> int:
    return sum(1 for raw in labels if _label_parts(raw)[0] in _KNOWN_LABELS or _label_parts(raw)[1] == "%")


def _number(text: str) -> float | None:
    t = text.strip().replace(",", "")
    if not t or t.upper() in ("N/A", "NAN", "-NAN", "-"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def _guess_report(labels: Sequence[str], names: list[str]) -> str | None:
    """The report a header-only block most likely came from (CSV files written with --output carry no banner)."""
    low = {_label_parts(raw)[0] for raw in labels}
    if low & {"durchild", "rangestack", "nametree"}:
        return "nvtx_pushpop_trace"
    if low & {"grdx", "strm"}:
        return "cuda_gpu_trace"
    if "corrid" in low and low & {"t-pri", "thread name", "result"}:
        return "cuda_api_trace"
    if low & {"start", "duration"}:
        return None
    if "style" in low or "range" in low:
        return "nvtx_sum"
    if "operation" in low:
        return "cuda_gpu_mem_time_sum"
    if "instances" in low and "name" in low:
        return "cuda_gpu_kern_sum"
    if low & {"num calls", "calls"} and "name" in low and names:
        return "cuda_api_sum" if all(re.match(r"^cu[A-Z]|^cuda[A-Z]", n) for n in names) else "osrt_sum"
    return None


def _size_report_from_labels(labels: Sequence[str]) -> str | None:
    """A size summary printed without its title: 'Total' in bytes (or unitless) and no time share."""
    parts = [_label_parts(raw) for raw in labels]
    if any(label == "time" for label, _ in parts):
        return None
    if any(label in ("total", "total size") and (unit or "").lower() in set(_SIZE_UNITS) | {""}
           for label, unit in parts):
        return "cuda_gpu_mem_size_sum"
    return None


class NsysStatsMeta(NamedTuple):
    """Table.meta of an `nsys_stats` table (parse_nsys_stats_csv)."""

    reports: list[str]  # the reports read, in order (a report twice when it appears twice)
    skipped: list[dict[str, Any]]  # [{report, why}]: reports nsys said it skipped, with its reason
    guessed: list[dict[str, Any]]  # [{line, report}]: blocks whose report was inferred from the column header


class _StatsParser:
    def __init__(self, text: str, name: str, warnings: list[str]) -> None:
        self.lines, self.cut = split_lines(text)
        self.name = name
        self.warnings = warnings
        self.rows: list[dict[str, Any]] = []
        self.meta = NsysStatsMeta(reports=[], skipped=[], guessed=[])  # its lists filled while reading
        self.pending: str | None = None
        self.size_unit: str | None = None

    def run(self) -> Table:
        i, n = 0, len(self.lines)
        while i < n:
            line = self.lines[i]
            if self._context(line):
                i += 1
                continue
            if i + 1 < n and _DASHES.match(self.lines[i + 1]) and line.strip() and not _DASHES.match(line):
                i = self._column_block(i)
                continue
            labels = self._csv_fields(line)
            if labels and len(labels) >= 2 and _known_count(labels) >= 2 and _number(labels[0]) is None:
                i = self._csv_block(i, labels)
                continue
            i += 1
        if self.cut and self.rows and self.rows[-1]["line"] == n:
            self.warnings.append(f"{self.name}: line {n}: the text ends without a newline; its last row may be "
                                 f"cut short")
        return Table.from_rows("nsys_stats", STATS_COLUMNS, self.rows, source=self.name, warnings=self.warnings,
                               meta=self.meta)

    def _context(self, line: str) -> bool:
        stripped = line.strip()
        for rx in (_BANNER, _EXECUTING):
            m = rx.match(line)
            if m:
                self._set_report(m["id"])
                return True
        m = _PROCESSING.match(line)
        if m:
            self._set_report(os.path.splitext(os.path.basename(m["script"].replace("\\", "/")))[0])
            return True
        m = _SKIPPED.match(line)
        if m:
            self.meta.skipped.append({"report": self.pending, "why": m["why"].strip()})
            return True
        for rx, report, unit_group in _OLD_TITLES:
            m = rx.match(stripped)
            if m:
                self.pending = report
                self.size_unit = m.group(unit_group) if unit_group else None
                return True
        return False

    def _set_report(self, report_id: str) -> None:
        self.pending = _OLD_REPORT_IDS.get(report_id, report_id)
        self.size_unit = None

    @staticmethod
    def _csv_fields(line: str) -> list[str] | None:
        if "," not in line:
            return None
        try:
            return next(csv.reader([line]))
        except (csv.Error, StopIteration):
            return None

    def _start_block(self, report: str | None) -> str | None:
        self.pending = None
        if report:
            self.meta.reports.append(report)
        return report

    def _emit(self, report: str | None, cols: list[_Col], values: list[str], lineno: int) -> dict[str, Any]:
        row: dict[str, Any] = {"report": report, "line": lineno, "extra": {}}
        for col, value in zip(cols, values):
            value = value.strip()
            if col.field is None:
                row["extra"][col.label.strip()] = value
            elif col.field in ("name", "style"):
                row[col.field] = value
            else:
                num = _number(value)
                if num is not None:
                    num *= col.scale
                    if col.field not in ("time_pct",) and float(num).is_integer() and not col.field.startswith(
                            ("avg", "med", "stddev")):
                        num = int(num)
                row[col.field] = num
        return row

    def _finish_block(self, report: str | None, rows: list[dict[str, Any]], labels: Sequence[str],
                      start_line: int) -> None:
        if report is None:
            report = _guess_report(labels, [r.get("name") or "" for r in rows])
            if report:
                self.meta.guessed.append({"line": start_line, "report": report})
                self.meta.reports.append(report)
        for row in rows:
            row["report"] = report
            name = row.get("name")
            if report in ("nvtx_sum", "nvtx_pushpop_sum", "nvtx_startend_sum") and name and name.startswith(":"):
                row["name"] = name[1:]
            self._classify(row)
        self.rows.extend(rows)

    @staticmethod
    def _classify(row: dict[str, Any]) -> None:
        report, name = row.get("report"), row.get("name")
        if not name or report is None:
            return
        if report.startswith(("cuda_gpu_mem", "um_")) or name.startswith(("[CUDA memcpy", "[CUDA memset",
                                                                            "[CUDA Unified")):
            row["kind"] = "memory"
        elif report in ("cuda_gpu_kern_sum", "cuda_gpu_kern_gb_sum", "cuda_gpu_sum", "cuda_gpu_trace",
                        "cuda_kern_exec_sum", "cuda_kern_exec_trace"):
            row["kind"] = kernel_kind(name)
            info = nccl_kernel_info(name)
            row["collective"] = info.collective if info else None

    def _csv_block(self, i: int, labels: list[str]) -> int:
        guessed = None if self.pending else _size_report_from_labels(labels)
        report = self._start_block(self.pending or guessed)
        if guessed:
            self.meta.guessed.append({"line": i + 1, "report": guessed})
        cols = _columns_for(labels, report, self.size_unit)
        name_last = bool(cols) and cols[-1].field == "name"
        rows, j, start = [], i + 1, i + 1
        while j < len(self.lines):
            line = self.lines[j]
            if not line.strip() or _BANNER.match(line) or _PROCESSING.match(line) or _EXECUTING.match(line):
                break
            values = self._csv_fields(line)
            if values is None:
                break
            if len(values) > len(cols) and name_last:
                # An unquoted comma inside a demangled name splits it; the name is last, so rejoin it.
                values = values[:len(cols) - 1] + [",".join(values[len(cols) - 1:])]
            if len(values) != len(cols):
                if _known_count(values) >= 2 and _number(values[0]) is None:
                    break
                self.warnings.append(f"{self.name}: line {j + 1}: {len(values)} fields where the header at line "
                                     f"{start} has {len(cols)}; row skipped")
                j += 1
                continue
            rows.append(self._emit(report, cols, values, j + 1))
            j += 1
        self._finish_block(report, rows, labels, start)
        return j

    def _column_block(self, i: int) -> int:
        header, dashes = self.lines[i], self.lines[i + 1]
        spans = [m.span() for m in re.finditer(r"-+", dashes)]
        labels = [header[a:b].strip() for a, b in spans]
        if _known_count(labels) < 2:
            return i + 2
        report = self._start_block(self.pending)
        cols = _columns_for(labels, report, self.size_unit)
        rows, j = [], i + 2
        truncated_names = 0
        while j < len(self.lines):
            line = self.lines[j]
            if not line.strip() or _BANNER.match(line) or _PROCESSING.match(line) or _EXECUTING.match(line):
                break
            values = [line[a:b] if k < len(spans) - 1 else line[a:] for k, (a, b) in enumerate(spans)]
            row = self._emit(report, cols, values, j + 1)
            if (row.get("name") or "").endswith("…"):
                truncated_names += 1
            rows.append(row)
            j += 1
        if truncated_names:
            self.warnings.append(f"{self.name}: lines {i + 3}-{j}: {truncated_names} names were cut to fit by nsys "
                                 f"(ending in '…'); use --format csv for full names")
        self._finish_block(report, rows, labels, i + 1)
        return j


def parse_nsys_stats_csv(path_or_text: str | os.PathLike[str], *, source: str = "") -> Table:
    """Parse `nsys stats` output (a path or the text) into the `nsys_stats` table (STATS_COLUMNS).

    Several reports in one text are separated by their banners, `Processing [...]` or `Executing`
    lines, old-style titles, or blank lines; each row says which report it came from. `meta` (NsysStatsMeta) has
    `reports` (in order), `skipped` (reports nsys skipped, with its reason) and `guessed` (blocks whose
    report was inferred from the header). Damaged text gives the rows that could be read and
    warnings naming the file and line; it never raises.
    """
    text, name, warnings = read_source(path_or_text, source)
    return _StatsParser(text, name, warnings).run()
