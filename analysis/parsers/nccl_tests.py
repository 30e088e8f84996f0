"""Parse nccl-tests / rccl-tests output into one table, and write that layout back.

The column layout is read from the file's own column header, because it changed over the years:
2017 (`bytes N type op time algbw busbw res`, time in ms), 2019-2022 (one header per collective:
all_gather has no redop, broadcast has root but no redop, `error` is a max abs deviation),
2022+ (`size count type redop root ... #wrong` for every collective), 2024+ rccl-tests (in-place
only tables, `N/A` in #wrong when validation is off), 2025+ (`# nccl-tests version`,
`# Collective test starting:`, optional per-iteration and timestamp columns). Lines from other
tools (NCCL INFO lines, mpirun `[1,0]<stdout>:` tags, shell prompts, prose) are skipped or
stripped, and a row that an NCCL INFO line was glued into is put back together. The NCCL lines themselves are
read as an NCCL_DEBUG log is (analysis.parsers.nccl_debug), so that the transports they name are not lost.

bus bandwidth: nccl-tests reports busbw = algbw × bus_factor(op, nranks) (doc/PERFORMANCE.md);
the parser checks every row against that and warns when they disagree by more than 2%.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from analysis.parsers._text import GARBLED, read_source, split_lines
from analysis.parsers.nccl_debug import (
    LogLine,
    LogReader,
    find_log_line,
    not_understood,
    strip_mpi_tag,
    version_facts,
)
from analysis.table import Table
from launch import sense

# The writer and the bus factors live with the sweep that writes this format (launch may not import analysis).
from launch.comm.nccl_format import BUS_FACTORS as _FACTORS
from launch.comm.nccl_format import OPS, bus_factor, format_nccl_tests

__all__ = ["COLUMNS", "OPS", "bus_factor", "format_nccl_tests", "large_message_busbw", "op_from_name",
           "parse_nccl_tests", "peak_busbw"]

COLUMNS: dict[str, str] = {
    "section": "index into meta.sections: which run in the file the row comes from (files often "
               "hold several runs concatenated)",
    "op": "collective: all_reduce, all_gather, reduce_scatter, alltoall, alltoallv, sendrecv, broadcast, "
          "reduce, gather, scatter, hypercube; from `# Collective test starting:`, a `*_perf` command "
          "line before the table, or the file name; else 'unknown'",
    "size_bytes": "message size in bytes as printed in the size column (for all_gather/reduce_scatter "
                  "the whole gathered buffer, i.e. count × ranks × dtype size)",
    "count": "element count as printed (per-rank count for all_gather/reduce_scatter/alltoall)",
    "dtype": "data type name as printed (float, half, bfloat16, int8, ...)",
    "redop": "reduction op as printed (sum, prod, min, max, avg, none); None when the table has no "
             "redop column (pre-2.13 all_gather, broadcast, sendrecv)",
    "root": "root rank; -1 for collectives without one; None when the table has no root column",
    "placement": "'out-of-place' or 'in-place'",
    "time_us": "average time per operation in microseconds (2017-era output printed ms; converted)",
    "algbw_GBps": "algorithm bandwidth, size / time, in GB/s (1e9 bytes per second)",
    "busbw_GBps": "bus bandwidth = algbw × bus_factor(op, nranks), in GB/s",
    "wrong": "number of wrong elements (#wrong, int); None when printed N/A (validation off, rccl-tests "
             "-c 0) or when the file has a pre-2.13 `error` column instead",
    "max_error": "pre-2.13 `error` column: maximum absolute deviation (float); None otherwise",
    "line": "1-based line number of the row in the source text",
}

_OP_ALIASES = (  # longest first, so that `reduce` does not win inside `reduce_scatter`
    ("reduce_scatter", r"reduce_?scatter"), ("all_reduce", r"all_?reduce"), ("all_gather", r"all_?gather"),
    ("alltoallv", r"all_?to_?allv"), ("alltoall", r"all_?to_?all"), ("sendrecv", r"send_?recv"),
    ("broadcast", r"broadcast"), ("hypercube", r"hypercube"), ("scatter", r"scatter"),
    ("gather", r"gather"), ("reduce", r"reduce"),
)
_OP_IN_NAME = re.compile("(?<![a-z])(?:" + "|".join(f"(?P<{op}>{rx})" for op, rx in _OP_ALIASES) + ")",
                         re.IGNORECASE)
_PERF_BINARY = re.compile(r"\b(" + "|".join(op for op, _ in _OP_ALIASES) + r")_perf\w*")

_DTYPES = sorted(["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
                  "bfloat16", "f8e4m3", "f8e5m2", "fp8_e4m3", "fp8_e5m2", "char", "int"], key=len, reverse=True)
_REDOPS = sorted(["sum", "prod", "max", "min", "avg", "none", "mulsum", "premulsum"], key=len, reverse=True)
_FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"  # printf prints -inf and -nan too
# What one field may look like, used to cut a field off the NCCL log text glued onto it.
_FIELD_TEXT = {
    "size": r"\d+", "count": r"\d+", "root": r"-1|\d+", "type": "|".join(_DTYPES), "redop": "|".join(_REDOPS),
    "time": _FLOAT, "algbw": _FLOAT, "busbw": _FLOAT, "wrong": r"N/A|\d+(?:\.\d+)?(?:e[-+]\d+)?",
    "error": _FLOAT, "extra": _FLOAT,
}
_HEADER_NAMES = {
    "size": "size", "bytes": "size", "count": "count", "N": "count", "type": "type", "redop": "redop",
    "op": "redop", "root": "root", "time": "time", "cputime": "time", "algbw": "algbw", "busbw": "busbw",
    "#wrong": "wrong", "error": "error", "res": "error",
}
_KEY_FIELDS = ("size", "count", "type", "redop", "root")

_NTHREAD = re.compile(r"nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+)")
_STEP = re.compile(r"step: (\d+)\((factor|bytes)\)")
_ITER_FACTS = {
    "warmup_iters": re.compile(r"warmup iters: (\d+)"),
    "iters": re.compile(r"(?<!warmup )(?<!agg )iters: (\d+)"),
    "agg_iters": re.compile(r"agg iters: (\d+)"),
    "validation": re.compile(r"validation: (\d+)"),
    "graph": re.compile(r"graph: (\d+)"),
    "unalign": re.compile(r"unalign: (\d+)"),
}
_DEVICE = re.compile(
    r"Rank\s+(?P<rank>\d+)\s+(?:Group\s+(?P<group>\d+)\s+)?(?:Pid\s+(?P<pid>\d+)\s+)?on\s+(?P<host>\S+)\s+"
    r"device\s+(?P<device>\d+)\s+\[(?P<busid>[^\]]*)\]\s*(?P<name>.*?)\s*$")
_TESTS_VERSION = re.compile(
    r"nccl-tests version (?P<ver>\S+)(?: nccl-headers=(?P<hdr>\d+))?(?: nccl-library=(?P<lib>\d+))?")
_RCCL_TESTS_VERSION = re.compile(r"^rccl-tests: Version (\S+)")
_COLLECTIVE_START = re.compile(r"Collective test starting: (\S+)")
_COLLECTIVE_END = re.compile(r"Collective test concluded: (\S+)")
_AVG_BUSBW = re.compile(r"Avg bus bandwidth\s*:\s*(" + _FLOAT + ")", re.IGNORECASE)
_OUT_OF_BOUNDS = re.compile(r"Out of bounds values\s*:\s*(\d+)")
_MAX_FACTOR_WARNINGS = 5


def op_from_name(name: str) -> str | None:
    """The collective a program or file name refers to (`all_reduce_perf`, `nccl_allreduce_...`)."""
    m = _OP_IN_NAME.search(os.path.basename(name))
    if not m:
        return None
    return next(op for op, value in m.groupdict().items() if value is not None)


class NcclTestsSection(NamedTuple):
    """The header and footer facts of one run (section) in an nccl-tests / rccl-tests output; None where the
    output does not print it. Also what `commbench_table` (analysis.parsers.commbench) knows of a sweep."""

    op: str  # the collective (COLUMNS["op"])
    nranks: int | None = None  # ranks, from the device lines (`#  Rank  0 Group ...`)
    nranks_inferred: int | None = None  # ranks implied by busbw/algbw when no device lines are printed
    devices: list[dict[str, Any]] | None = None  # [{rank, group, pid, host, device, busid, name}] as printed
    hosts: list[str] | None = None  # the devices' hosts, sorted
    avg_busbw_GBps: float | None = None  # the `Avg bus bandwidth` footer; None when the run was cut short
    avg_busbw_line: int | None = None  # the footer's line
    out_of_bounds: int | None = None  # the `Out of bounds values` footer
    nccl_version: str | None = None  # from `nccl-tests version ... nccl-library=` or an NCCL INFO line
    rccl_version: str | None = None  # from an RCCL INFO line
    cuda_runtime: str | None = None  # from an NCCL INFO version line (`+cuda12.4`)
    hip_runtime: str | None = None  # from an RCCL INFO version line (`+hip6.2`)
    cuda_driver: str | None = None  # from an NCCL INFO `cudaDriverVersion` line
    nccl_tests_version: str | None = None  # `# nccl-tests version X`
    rccl_tests_version: str | None = None  # `rccl-tests: Version X`
    nthreads: int | None = None  # `# nThread N`
    ngpus: int | None = None  # `nGpus N`
    min_bytes: int | None = None  # `minBytes N`
    max_bytes: int | None = None  # `maxBytes N`
    step_factor: int | None = None  # `step: N(factor)`
    step_bytes: int | None = None  # `step: N(bytes)`
    warmup_iters: int | None = None  # `warmup iters: N`
    iters: int | None = None  # `iters: N`
    agg_iters: int | None = None  # `agg iters: N`
    validation: int | None = None  # `validation: N` (0: #wrong is N/A)
    graph: int | None = None  # `graph: N`
    unalign: int | None = None  # `unalign: N` (2025+)
    # the NCCL log lines printed among the run's output (NCCL_DEBUG=INFO set for the test), read as
    # analysis.parsers.nccl_debug reads a log; None when it holds none
    nccl_debug: Table | None = None


# Table.meta of an `nccl_tests` table: the collectives of the rows (sorted), every section's facts (rows point into
# `sections` by their `section` column), then the facts of the first section that has rows, NcclTestsSection's own
# fields (the one place they are listed and documented), with the file's version lines filling in what that section
# leaves unknown; `op` is None when no section has rows.
NcclTestsMeta = NamedTuple("NcclTestsMeta", [  # noqa: UP014 - the fields are NcclTestsSection's, not typed again
    ("ops", list[str]), ("sections", list[NcclTestsSection]),
    *((name, NcclTestsSection.__annotations__[name]) for name in NcclTestsSection._fields)])
NcclTestsMeta.__new__.__defaults__ = (None, *NcclTestsSection.__new__.__defaults__)


@dataclass
class _Layout:
    keys: list[str]
    groups: list[tuple[str, list[str]]]  # (placement, field names)
    trailing: int = 0                    # tokens after the groups (a timestamp is two)
    time_scale: float = 1.0              # printed time unit -> microseconds

    @property
    def fields(self) -> list[str]:
        return self.keys + [f for _, names in self.groups for f in names]

    @property
    def width(self) -> int:
        return len(self.fields) + self.trailing


@dataclass
class _Section:
    index: int
    op: str
    op_fixed: bool = False  # set by `Collective test starting:`; prose mentions do not override it
    facts: dict[str, Any] = field(default_factory=dict)
    log_facts: dict[str, Any] = field(default_factory=dict)  # versions from interleaved NCCL lines
    devices: list[dict[str, Any]] = field(default_factory=list)
    nrows: int = 0
    bad_factor: list[str] = field(default_factory=list)
    log_lines: list[tuple[int, LogLine]] = field(default_factory=list)  # the NCCL lines, read once the rows are

    @property
    def nranks(self) -> int | None:
        return len({d["rank"] for d in self.devices}) or None


def _guess_layout(tokens: list[str]) -> _Layout | None:
    """Layout of a row seen before any column header (excerpts often lack one)."""
    n = len(tokens)
    group = ["time", "algbw", "busbw", "wrong"]
    legacy = ["time", "algbw", "busbw", "error"]
    if n == 13:
        return _Layout(list(_KEY_FIELDS), [("out-of-place", group), ("in-place", list(group))])
    if n == 9:
        return _Layout(list(_KEY_FIELDS), [("in-place", group)])
    if n == 12:
        fourth = "redop" if re.fullmatch(r"[A-Za-z]\w*", tokens[3]) else "root"
        return _Layout(["size", "count", "type", fourth], [("out-of-place", legacy), ("in-place", list(legacy))])
    if n == 11:
        return _Layout(["size", "count", "type"], [("out-of-place", legacy), ("in-place", list(legacy))])
    return None


def _layout_from_header(tokens: list[str], labels: list[str]) -> _Layout:
    names = [_HEADER_NAMES.get(t, "extra") for t in tokens]
    trailing = 0
    if tokens and tokens[-1] == "timestamp":
        names.pop()
        trailing = 2  # printed as `%Y-%m-%d %H:%M:%S`
    first_time = names.index("time")
    keys, rest = names[:first_time], names[first_time:]
    groups: list[list[str]] = []
    for name in rest:
        if name == "time":
            groups.append([])
        groups[-1].append(name)
    if len(labels) != len(groups):
        labels = ["out-of-place", "in-place"] if len(groups) == 2 else ["out-of-place"] * len(groups)
    legacy_ms = "error" in names and tokens[0] == "bytes"  # 2017: time in ms, no units line
    return _Layout(keys, list(zip(labels, groups)), trailing, 1000.0 if legacy_ms else 1.0)


def _is_row_start(tokens: list[str]) -> bool:
    return len(tokens) >= 2 and tokens[0].isdigit() and tokens[1].isdigit()


def _unglue(head: list[str], host: str, layout: _Layout) -> list[str]:
    """Take back the field that an NCCL log prefix swallowed (`-1` + `host:pid:tid` = `-1host:...`).

    nccl-tests prints a row as the key fields, then each placement's fields, with no trailing
    space; so a log line printed in between starts right after a field, and the prefix pattern
    reads that field as the start of the host name. A fragment one field short of such a
    boundary is missing exactly that field.
    """
    bounds, n = set(), len(layout.keys)
    bounds.add(n)
    for _, names in layout.groups:
        n += len(names)
        bounds.add(n)
    if len(head) in bounds or len(head) + 1 not in bounds or not host:
        return head
    m = re.match(_FIELD_TEXT[layout.fields[len(head)]], host)
    return head + [m[0]] if m else head


def _decimals_ulp(token: str) -> float:
    """Half of the last printed digit's value: how far rounding may have moved a printed number."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals) * 10.0 ** (int(exponent) if exponent.lstrip("+-").isdigit() else 0)


class _Parser:
    def __init__(self, text: str, name: str, warnings: list[str]) -> None:
        self.name = name
        self.warnings = warnings
        self.lines, self.last_cut = split_lines(text)
        self.file_op = op_from_name(name) if name != "<text>" else None
        self.sections: list[_Section] = [_Section(0, self.file_op or "unknown")]
        self.pending_op: str | None = None
        self.layout: _Layout | None = None
        self.labels: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.fragment: tuple[list[str], int, str] | None = None  # fields so far, line, host of the log line
        self.file_facts: dict[str, Any] = {}
        self.unlaid_rows = 0
        # An NCCL line glued into a row starts with that row's field, whose length is known only when the row is
        # put back together: line -> the host without it.
        self.hosts: dict[int, str | None] = {}

    @property
    def section(self) -> _Section:
        return self.sections[-1]

    def warn(self, lineno: int, message: str) -> None:
        self.warnings.append(f"{self.name}:{lineno}: {message}")

    def new_section(self) -> None:
        prev = self.section
        op = self.pending_op or (prev.op if prev.nrows == 0 else None) or self.file_op or "unknown"
        self.pending_op = None
        self.sections.append(_Section(len(self.sections), op))
        self.layout = None

    def run(self) -> None:
        for lineno, raw in enumerate(self.lines, start=1):
            cut = self.last_cut and lineno == len(self.lines)
            try:
                self.line(lineno, raw, cut)
            except GARBLED as exc:
                self.warn(lineno, f"line not understood ({type(exc).__name__}); skipped")
        self.flush_fragment()
        if self.unlaid_rows:
            self.warnings.append(f"{self.name}: {self.unlaid_rows} row(s) without a column header had a field "
                                 f"count no nccl-tests version prints; skipped")

    def line(self, lineno: int, raw: str, cut: bool) -> None:
        log = find_log_line(raw)
        if log is not None:
            if not cut:
                for key, value in version_facts(log.message).items():
                    self.section.log_facts.setdefault(key, value)
                    self.file_facts.setdefault(key, value)
                self.section.log_lines.append((lineno, log))
            before = strip_mpi_tag(raw[:log.start]).split()
            if _is_row_start(before):
                # nccl-tests prints a row in pieces; an NCCL line logged in between lands mid-row.
                self.flush_fragment()
                self.fragment = (before, lineno, log.host or "")
            return
        text = strip_mpi_tag(raw)
        body = text.lstrip()
        tokens = body.lstrip("#").split()
        if body.startswith("#") or not tokens:
            if not cut:
                self.header_line(lineno, body, tokens)
            return
        trusted = tokens[:-1] if cut and not text[-1:].isspace() else tokens  # last field may be short
        if self.fragment is not None and re.fullmatch(_FLOAT, tokens[0]) and self.join_fragment(lineno, trusted, cut):
            return
        if _is_row_start(tokens):
            self.data_row(lineno, trusted, cut)
        elif not cut:  # a cut header or prose line cannot be trusted
            self.header_line(lineno, body, tokens)

    def header_line(self, lineno: int, body: str, tokens: list[str]) -> None:
        if tokens and tokens[0] in ("size", "bytes") and ("algbw" in tokens or "busbw" in tokens):
            self.column_header(lineno, tokens)
            return
        self.labels = [t for t in tokens if t in ("out-of-place", "in-place")]
        if tokens[:1] == ["(B)"] and self.layout is not None:
            if "(ms)" in tokens:
                self.layout.time_scale = 1000.0
            elif "(us)" in tokens:
                self.layout.time_scale = 1.0
            return
        if not self.section_start(body):
            self.section_fact(lineno, body)

    def column_header(self, lineno: int, tokens: list[str]) -> None:
        """A column header line: the layout of the rows below it, placements named by the line before (labels)."""
        if self.section.nrows:
            self.new_section()
        try:
            self.layout = _layout_from_header(tokens, self.labels)
        except (ValueError, IndexError):
            self.warn(lineno, "column header not understood; rows until the next header are skipped")
            self.layout = None
        self.labels = []

    def section_start(self, body: str) -> bool:
        """Read a header line that opens a new section when the current one already holds what it says (a version,
        the collective, the nThread line, a device); whether `body` was one."""
        section = self.section
        m = _TESTS_VERSION.search(body)
        if m:
            if section.nrows or section.facts or section.devices or section.op_fixed:
                self.new_section()
            facts = {"nccl_tests_version": m["ver"]}
            if m["lib"] or m["hdr"]:
                facts["nccl_version"] = _version_from_code(int(m["lib"] or m["hdr"]))
            self.section.facts.update(facts)
            self.file_facts.update(facts)
            return True
        m = _COLLECTIVE_START.search(body)
        if m:
            if section.nrows or section.op_fixed or "nthreads" in section.facts or section.devices:
                self.new_section()
            self.section.op = op_from_name(m[1]) or "unknown"
            self.section.op_fixed = True
            self.pending_op = None
            return True
        m = _NTHREAD.search(body)
        if m:
            if section.nrows or "nthreads" in section.facts or section.devices:
                self.new_section()
            facts = self.section.facts
            facts.update(nthreads=int(m[1]), ngpus=int(m[2]), min_bytes=int(m[3]), max_bytes=int(m[4]))
            step = _STEP.search(body)
            if step:
                facts["step_factor" if step[2] == "factor" else "step_bytes"] = int(step[1])
            for key, rx in _ITER_FACTS.items():
                found = rx.search(body)
                if found:
                    facts[key] = int(found[1])
            return True
        m = _DEVICE.search(body)
        if m:
            if section.nrows:
                self.new_section()
            self.section.devices.append({
                "rank": int(m["rank"]), "group": _opt_int(m["group"]), "pid": _opt_int(m["pid"]),
                "host": m["host"], "device": int(m["device"]), "busid": m["busid"], "name": m["name"]})
            return True
        return False

    def section_fact(self, lineno: int, body: str) -> None:
        """Read a line that tells the current section a fact (a footer, the rccl-tests version, the program run)."""
        section = self.section
        m = _AVG_BUSBW.search(body)
        if m:
            section.facts.update(avg_busbw_GBps=float(m[1]), avg_busbw_line=lineno)
            return
        m = _OUT_OF_BOUNDS.search(body)
        if m:
            section.facts["out_of_bounds"] = int(m[1])
            return
        m = _RCCL_TESTS_VERSION.match(body)
        if m:
            section.facts["rccl_tests_version"] = m[1]
            self.file_facts["rccl_tests_version"] = m[1]
            return
        if _COLLECTIVE_END.search(body):
            return
        m = _PERF_BINARY.search(body)
        if m:
            op = m[1]
            if section.nrows == 0 and not section.op_fixed:
                section.op = op
            else:
                self.pending_op = op

    def data_row(self, lineno: int, tokens: list[str], cut: bool) -> None:
        self.flush_fragment()
        if cut and self.layout is None:
            self.warn(lineno, "last row is cut short and no column header says how to read it; skipped")
            return
        layout = self.layout_for(tokens)
        if layout is None:
            return
        if len(tokens) < layout.width:
            if cut:
                self.warn(lineno, "last row is cut short; kept only its complete placements")
                self.emit(lineno, tokens, layout)
            else:
                self.fragment = (tokens, lineno, "")
            return
        if len(tokens) > layout.width:
            self.warn(lineno, f"row has {len(tokens)} fields, the header promises {layout.width}; "
                              f"extra fields ignored")
        self.emit(lineno, tokens[:layout.width], layout)

    def layout_for(self, tokens: list[str]) -> _Layout | None:
        if self.layout is None:
            self.layout = _guess_layout(tokens)
            if self.layout is None:
                self.unlaid_rows += 1
        return self.layout

    def join_fragment(self, lineno: int, tokens: list[str], cut: bool) -> bool:
        """Complete the pending row with this line's fields, if they are what it lacks."""
        head, start, host = self.fragment
        layout = self.layout
        if layout is None and not cut:
            layout = _guess_layout(head + tokens) or _guess_layout(head + ["?"] + tokens)
        if layout is None:
            return False
        head = self.unglue(head, start, host, layout)
        missing = layout.width - len(head) - len(tokens)
        if missing < 0 or (missing > 0 and not cut):
            return False
        self.layout = layout
        self.fragment = None
        if missing:
            self.warn(start, "last row is cut short; kept only its complete placements")
        self.emit(start, head + tokens, layout)
        return True

    def flush_fragment(self) -> None:
        if self.fragment is None:
            return
        head, start, host = self.fragment
        self.fragment = None
        layout = self.layout
        if layout is None:  # a partial row says too little to guess the layout from
            self.warn(start, "incomplete row before any column header; skipped")
            return
        self.warn(start, f"row is incomplete ({len(head)} of {layout.width} fields); kept only its "
                         f"complete placements")
        self.emit(start, self.unglue(head, start, host, layout), layout)

    def unglue(self, head: list[str], lineno: int, host: str, layout: _Layout) -> list[str]:
        """_unglue, remembering the host of the log line without the field it took."""
        fields = _unglue(head, host, layout)
        if len(fields) > len(head):
            self.hosts[lineno] = host[len(fields[-1]):] or None
        return fields

    def emit(self, lineno: int, tokens: list[str], layout: _Layout) -> None:
        section = self.section
        key_values: dict[str, Any] = {"redop": None, "root": None}
        try:
            for name, token in zip(layout.keys, tokens):
                if name in ("size", "count", "root"):
                    key_values[name] = int(token)
                elif name in ("type", "redop"):
                    key_values[name] = token
        except ValueError:
            self.warn(lineno, f"row not understood: {' '.join(tokens)[:100]}")
            return
        if len(tokens) < len(layout.keys) or "size" not in key_values:
            return
        pos = len(layout.keys)
        for placement, names in layout.groups:
            values = tokens[pos:pos + len(names)]
            pos += len(names)
            if len(values) < len(names):
                return
            row = self.group_row(lineno, names, values, layout.time_scale)
            if row is None:
                return
            row.update(section=section.index, op=section.op, size_bytes=key_values["size"],
                       count=key_values.get("count"), dtype=key_values.get("type"), redop=key_values["redop"],
                       root=key_values["root"], placement=placement, line=lineno)
            self.rows.append(row)
            section.nrows += 1

    def group_row(self, lineno: int, names: list[str], values: list[str], scale: float) -> dict[str, Any] | None:
        row: dict[str, Any] = {"wrong": None, "max_error": None}
        printed: dict[str, str] = {}
        try:
            for name, token in zip(names, values):
                printed[name] = token
                if name == "time":
                    value = float(token)
                    row["time_us"] = value if scale == 1.0 else round(value * scale, 6)
                elif name in ("algbw", "busbw"):
                    row[f"{name}_GBps"] = float(token)
                elif name == "wrong":
                    row["wrong"] = None if token == "N/A" else int(float(token))
                elif name == "error":
                    row["max_error"] = None if token == "N/A" else float(token)
        except ValueError:
            self.warn(lineno, f"field not understood: {' '.join(values)[:100]}")
            return None
        self.check_factor(lineno, row, printed)
        return row

    def check_factor(self, lineno: int, row: Mapping[str, Any], printed: Mapping[str, str]) -> None:
        section = self.section
        n = section.nranks
        if n is None or section.op not in _FACTORS or "algbw" not in printed or "busbw" not in printed:
            return
        algbw, busbw = row["algbw_GBps"], row["busbw_GBps"]
        if not (math.isfinite(algbw) and math.isfinite(busbw)):
            return
        formula, fn = _FACTORS[section.op]
        factor = fn(n)
        expected = algbw * factor
        slack = 0.02 * max(abs(expected), abs(busbw)) + _decimals_ulp(printed["busbw"]) \
            + factor * _decimals_ulp(printed["algbw"])
        if abs(busbw - expected) > slack:
            section.bad_factor.append(
                f"{self.name}:{lineno}: busbw {printed['busbw']} GB/s is not algbw {printed['algbw']} × "
                f"{formula} = {expected:.2f} for {section.op} on {n} ranks (off by more than 2%)")

    def finish(self) -> Table:
        self.warnings.extend(sense.clean(self.rows, self.name, counts=("size_bytes", "count", "wrong"),
                                          durations_us=("time_us",), bandwidths_gbps=("algbw_GBps", "busbw_GBps")))
        self.rows = [r for r in self.rows if r["size_bytes"] is not None]  # a figure at no size is on no curve
        for s in self.sections:
            s.nrows = sum(r["section"] == s.index for r in self.rows)
        footers = [{"avg_busbw_GBps": s.facts.get("avg_busbw_GBps")} for s in self.sections]
        self.warnings.extend(sense.clean(footers, self.name, bandwidths_gbps=("avg_busbw_GBps",)))
        for s, footer in zip(self.sections, footers, strict=True):
            if "avg_busbw_GBps" in s.facts:
                s.facts["avg_busbw_GBps"] = footer["avg_busbw_GBps"]
        sections_meta = []
        for s in self.sections:
            if s.bad_factor:
                self.warnings.extend(s.bad_factor[:_MAX_FACTOR_WARNINGS])
                if len(s.bad_factor) > _MAX_FACTOR_WARNINGS:
                    self.warnings.append(f"{self.name}: … and {len(s.bad_factor) - _MAX_FACTOR_WARNINGS} more "
                                         f"rows of section {s.index} disagree with the bus factor")
            # no footer line at all: a footer whose figure was dropped (inf, negative) is warned of where it is dropped
            if s.nrows and s.facts.get("avg_busbw_GBps") is None and s.facts.get("avg_busbw_line") is None:
                sizes = [r["size_bytes"] for r in self.rows if r["section"] == s.index and r["size_bytes"] is not None]
                top, want = max(sizes, default=None), s.facts.get("max_bytes") or s.log_facts.get("max_bytes")
                self.warnings.append(
                    f"{self.name}: the {s.op} table ends without its `Avg bus bandwidth` footer: the run was cut short"
                    + (f", measured up to {top:,} B of the {want:,} B asked for" if top and want and top < want
                       else f" after {top:,} B" if top else "")
                    + "; its large-message figures cover only the sizes that finished")
            sections_meta.append(self.section_meta(s))
        if not self.rows:
            self.warnings.append(f"{self.name}: no nccl-tests result rows found")
        with_rows = [m for m, s in zip(sections_meta, self.sections) if s.nrows]
        facts = (with_rows or sections_meta)[0]._asdict()
        for key, value in self.file_facts.items():  # the file's version lines fill in what the section leaves unknown
            if facts[key] is None:
                facts[key] = value
        meta = NcclTestsMeta(ops=sorted({r["op"] for r in self.rows}), sections=sections_meta, **facts)
        return Table.from_rows("nccl_tests", COLUMNS, self.rows, source=self.name, warnings=self.warnings,
                               meta=meta)

    def nccl_debug(self, s: _Section) -> Table | None:
        """The NCCL lines of a section as an `nccl_debug` table; None without any."""
        if not s.log_lines:
            return None
        reader = LogReader()
        for lineno, log in s.log_lines:
            if lineno in self.hosts:
                log = dataclasses.replace(log, host=self.hosts[lineno])
            if not reader.line(log, lineno):
                self.warnings.append(not_understood(self.name, lineno, log))
        return reader.table(self.name, ())

    def section_meta(self, s: _Section) -> NcclTestsSection:
        rows = [r for r in self.rows if r["section"] == s.index]
        facts: dict[str, Any] = {"op": s.op, "nranks": s.nranks, "devices": list(s.devices),
                                 "hosts": sorted({d["host"] for d in s.devices}), "nccl_debug": self.nccl_debug(s)}
        facts.update(s.log_facts)
        facts.update(s.facts)
        if s.nranks is None and s.op in _FACTORS:
            facts["nranks_inferred"] = _infer_nranks(s.op, rows)
        return NcclTestsSection(**facts)


def _opt_int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _version_from_code(code: int) -> str:
    # NCCL_VERSION(X,Y,Z) is X*1000+Y*100+Z before 2.9 and X*10000+Y*100+Z since.
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _infer_nranks(op: str, rows: list[Mapping[str, Any]]) -> int | None:
    """Rank count implied by busbw/algbw on rows precise enough to tell (algbw >= 1 GB/s)."""
    if _FACTORS[op][0] == "1":
        return None
    ratios = [r["busbw_GBps"] / r["algbw_GBps"] for r in rows
              if r.get("algbw_GBps") and r["algbw_GBps"] >= 1.0 and math.isfinite(r["busbw_GBps"])]
    if not ratios:
        return None
    ratio = statistics.median(ratios)
    scale = 2.0 if op == "all_reduce" else 1.0
    if ratio >= scale * 0.99:
        return None
    n = round(scale / (scale - ratio))
    return n if n >= 2 and abs(bus_factor(op, n) - ratio) <= 0.02 * ratio else None


def parse_nccl_tests(path_or_text: str | os.PathLike[str], *, source: str = "") -> Table:
    """Parse nccl-tests or rccl-tests output (a path or the text) into the `nccl_tests` table.

    One row per message size per placement. `meta` (NcclTestsMeta) holds the header facts of the first run that has
    rows (nranks, devices, hosts, nthreads, ngpus, min_bytes, max_bytes, step_factor|step_bytes,
    warmup_iters, iters, agg_iters, validation, graph, avg_busbw_GBps, out_of_bounds, nccl_version,
    cuda_runtime, cuda_driver, nccl_tests_version, rccl_tests_version, nranks_inferred, nccl_debug), plus `ops`
    and `sections` (the same facts for every run in the file; rows point into it by `section`).
    Never raises on content: damaged input gives the rows that could be read and warnings naming
    the file and line.
    """
    text, name, warnings = read_source(path_or_text, source)
    parser = _Parser(text, name, warnings)
    parser.run()
    return parser.finish()


def _rows_of(table: Table, op: str | None, placement: str | None) -> list[dict[str, Any]]:
    rows = list(table.rows())
    if op is None:
        ops = sorted({r["op"] for r in rows})
        if len(ops) > 1:
            raise ValueError(f"table {table.source or table.name} holds several collectives {ops}; pass op=")
    return [r for r in rows if (op is None or r["op"] == op) and (placement is None or r["placement"] == placement)
            and r["busbw_GBps"] is not None and math.isfinite(r["busbw_GBps"])]


def peak_busbw(table: Table, op: str | None = None, *, placement: str | None = None) -> float | None:
    """Highest bus bandwidth (GB/s) over all sizes and placements of `op`; None without rows."""
    rows = _rows_of(table, op, placement)
    return max((r["busbw_GBps"] for r in rows), default=None)


def large_message_busbw(table: Table, op: str | None = None, min_bytes: int | None = None, *,
                        placement: str | None = None) -> float | None:
    """Median bus bandwidth (GB/s) over messages of at least `min_bytes`.

    The default threshold is the top quartile of the distinct sizes measured: the bandwidth-bound
    end of the sweep, which is what a link's speed should be compared with (the footer average
    mixes in latency-bound small sizes).
    """
    rows = [r for r in _rows_of(table, op, placement) if r["size_bytes"] > 0]
    if not rows:
        return None
    if min_bytes is None:
        sizes = sorted({r["size_bytes"] for r in rows})
        min_bytes = sizes[min(len(sizes) - 1, math.ceil(0.75 * (len(sizes) - 1)))]
    chosen = [r["busbw_GBps"] for r in rows if r["size_bytes"] >= min_bytes]
    return statistics.median(chosen) if chosen else None
