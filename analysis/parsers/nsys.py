"""Parse Nsight Systems SQLite exports, and tell them and `nsys stats` text apart by content (`sniff`).

`parse_nsys_sqlite` reads `nsys export --type sqlite` files into one row per GPU activity (kernel,
memcpy, memset), CUDA runtime/driver call and NVTX range. What it relies on, and where that comes
from (tests/fixtures/nsys/README.md has the links):

- Tables exist only when something filled them ("tables are created lazily", exporter docs), and
  columns come and go between exporter versions (greenContextId and mangledName are recent,
  eventClass on CUPTI_ACTIVITY_KIND_RUNTIME is not in the 2019-2020 docs, NVTX text may be inline
  only), so every query is built from PRAGMA table_info, never from a fixed list.
- Kernel and API names are ids into StringIds. NVTX text is `coalesce(StringIds[textId], text)`,
  the order nsys's own nvtx_sum report uses; range event types are 59/60 (push-pop, start-end)
  and 70/71 (their NVTXT twins), 75 creates a domain.
- globalPid/globalTid pack 0xHHVVPPPPPPTTTTTT; correlation ids restart in every process, so a
  GPU activity is joined to its launching API call on (pid, correlationId), as nsys's
  nvtx_kern_sum does with `k.globalPid == (r.globalTid & 0xFFFFFFFFFF000000)`.
- A GPU activity's NVTX context (step, phase) is the range open on the launching thread when the
  launch call ran, again as nvtx_kern_sum does; GPU time lags the CPU, so using the kernel's own
  start would put late kernels into the next step.
- Device ids are TARGET_INFO_GPU.id (cuda_gpu_trace joins `gpu.id == deviceId`); 2020-era exports
  have TARGET_INFO_CUDA_GPU keyed by deviceId instead.
- Memcpy names follow cuda_gpu_trace: `[CUDA memcpy <ENUM_CUDA_MEMCPY_OPER.label>]`; exports
  before the ENUM_* tables existed get the same labels from a built-in copy.
- Runtime names lose their `_v7000`-style version suffix, as cuda_api_sum does. Rows of the
  'CUDA backtrace' event class are dropped: with --cudabacktrace nsys writes each sampled call
  twice (a real 2022.2 export has `cudaMemcpy_v3020` class 0 and `cudaMemcpy` class 67).
- A truncated file is opened with `PRAGMA writable_schema`, without which SQLite refuses any
  file shorter than its header says; tables are then read up to the first missing page.
- A row whose time makes no physical sense (launch/sense.py: a start that is no integer, an end
  before the start, longer than a week, a week away from the others) is dropped, counted in one
  warning, as the Kineto parser drops such events.

`nsys stats` text (CSV and the `column` format) is analysis.parsers.nsys_stats'; `sniff` tells the two apart.
"""
from __future__ import annotations

import bisect
import os
import re
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

from analysis.parsers import gpu_kernels
from analysis.parsers.gpu_kernels import COLLECTIVES, base_name, nccl_kernel_info
from analysis.table import Table
from launch import sense

COLUMNS: dict[str, str] = {
    "rank": "rank given by the caller (`rank=` int for the whole file, or a {pid: rank} mapping for a "
            "report that captured several processes); None when not given",
    "device": "GPU id of a kernel/memcpy/memset (CUPTI deviceId = TARGET_INFO_GPU.id; meta.devices "
              "names it); None for CPU rows",
    "stream": "CUDA stream id of a GPU row; None for CPU rows",
    "category": "'kernel', 'memcpy', 'memset', 'cuda_runtime' (runtime and driver API calls) or 'nvtx' "
                "(push-pop and start-end ranges; marks are not rows)",
    "name": "kernel: demangled name (shortName when that is missing); memcpy: '[CUDA memcpy Host-to-Device]'; "
            "memset: '[CUDA memset]'; cuda_runtime: API name without its '_vNNNN' suffix; nvtx: range text",
    "short_name": "kernel base name (StringIds[shortName]); None for other rows",
    "start_ns": "start timestamp in ns on the report's clock (ns since the session start unless the export "
                "shifted it)",
    "end_ns": "end timestamp in ns; None for an NVTX range still open when capture stopped",
    "dur_ns": "end_ns - start_ns; None when end_ns is missing",
    "bytes": "bytes copied (memcpy) or set (memset); None otherwise",
    "copy_kind": "memcpy direction label (Host-to-Device, Device-to-Host, Device-to-Device, Peer-to-Peer, ...); "
                 "None otherwise",
    "correlation": "CUPTI correlationId (unique only within one process)",
    "pid": "process id decoded from globalPid/globalTid",
    "tid": "thread id: the calling thread for cuda_runtime/nvtx rows, the launching thread for GPU rows "
           "(None when the launch call is not in the export)",
    "launch_api": "GPU rows: name of the runtime/driver call that launched it (joined on pid + correlation); "
                  "None when not found",
    "launch_start_ns": "GPU rows: start of that launch call in ns; None when not found",
    "kind": "GPU rows, as HTA classifies kernels (analysis.parsers.gpu_kernels.kernel_kind, the Kineto parser's "
            "rule, on the name without `void ` and arguments): 'communication' (^nccl.*Kernel), 'memory' (memcpy and "
            "memset operations, Memcpy*/Memset* kernels), 'other' (Sync kernels) or 'computation'; None for "
            "cuda_runtime and nvtx rows",
    "collective": "all_reduce, all_gather, reduce_scatter, broadcast, reduce, send_recv, all_to_all, gather, "
                  "scatter from an NCCL kernel name (all three NCCL naming schemes) or an NCCL NVTX range "
                  "('ncclAllReduce'); None otherwise. NCCL runs all-to-all as send/recv kernels, so a PyTorch "
                  "all_to_all shows up as send_recv",
    "nccl_algo": "NCCL algorithm in the kernel name (RING, TREE, NVLS, COLLNET_DIRECT, ...); None if absent",
    "nccl_proto": "NCCL protocol in the kernel name (LL, LL128, SIMPLE); None if absent",
    "step": "training step number from the innermost NVTX range named like 'step 3', 'step_3', "
            "'ProfilerStep#3', 'iteration 3' that was open on the launching thread at launch time (falling "
            "back to any thread of the process, then to the GPU start time when the launch is unknown); "
            "for NVTX and runtime rows, the range open at their own start. A process with no such ranges "
            "but with optimizer ranges gets steps counted from 0, each ending with an optimizer range "
            "(meta.step_source[pid] says 'named' or 'optimizer')",
    "phase": "'forward', 'backward' or 'optimizer' from the innermost NVTX range so named (also fwd/bwd/"
             "optim, 'forward-compute', 'DeepSpeedEngine.backward', ...) open at the same moment as for step",
    "nvtx_domain": "nvtx rows: name of the NVTX domain (None for the default domain)",
}

# --- shared name rules ------------------------------------------------------------------------

_NCCL_NVTX = re.compile(r"^nccl:?_?(?P<coll>[A-Za-z_]+)$")


def kernel_kind(name: str | None) -> str:
    """HTA's kernel classes (analysis.parsers.gpu_kernels) for the kernel name without nsys's `void ` and arguments; the
    memory operations `nsys stats` prints as `[CUDA memcpy ...]` / `[CUDA memset]` move memory."""
    if "[CUDA memcpy" in (name or "") or "[CUDA memset" in (name or ""):
        return "memory"
    return gpu_kernels.kernel_kind(base_name(name or ""))


def _nvtx_collective(text: str | None) -> str | None:
    m = _NCCL_NVTX.match(text or "")
    return COLLECTIVES.get(m["coll"].replace("_", "").lower()) if m else None


_STEP = re.compile(r"^\s*(?:ProfilerStep\s*#\s*|(?:train(?:ing)?[ _-]?)?(?:step|iteration|iter)[ _#:=-]*)(\d+)"
                   r"\s*(?:$|,)", re.IGNORECASE)
_PHASES = (
    ("forward", re.compile(r"(?:^|[^a-z])(?:forward|fwd)(?:[^a-z]|$)")),
    ("backward", re.compile(r"(?:^|[^a-z])(?:backward|bwd)(?:[^a-z]|$)")),
    ("optimizer", re.compile(r"(?:^|[^a-z])(?:optimizer|optim|opt_step)(?:[^a-z]|$)")),
)


def step_number(text: str | None) -> int | None:
    """The step an NVTX range name announces ('step 3', 'ProfilerStep#3', 'iteration_3'), else None."""
    m = _STEP.match(text or "")
    return int(m.group(1)) if m else None


def phase_of(text: str | None) -> str | None:
    """'forward', 'backward' or 'optimizer' when a range name names exactly one of them."""
    low = (text or "").lower()
    found = [phase for phase, rx in _PHASES if rx.search(low)]
    return found[0] if len(found) == 1 else None


def split_global_id(gid: int | None) -> tuple[int | None, int | None]:
    """(pid, tid) of an nsys serialized GlobalId 0xHHVVPPPPPPTTTTTT; tid is 0 in a globalPid."""
    if gid is None:
        return None, None
    try:
        gid = int(gid)
    except (TypeError, ValueError):
        return None, None
    return (gid >> 24) & 0xFFFFFF, gid & 0xFFFFFF


# --- SQLite -----------------------------------------------------------------------------------

_SQLITE_MAGIC = b"SQLite format 3\x00"
_NSYS_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_MEMCPY",
                "CUPTI_ACTIVITY_KIND_MEMSET", "NVTX_EVENTS", "TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU",
                "META_DATA_EXPORT", "EXPORT_META_DATA", "ANALYSIS_DETAILS", "TARGET_INFO_SESSION_START_TIME",
                "ThreadNames")
_NVTX_RANGE_TYPES = frozenset({59, 60, 70, 71})       # push-pop, start-end, and their NVTXT twins
_NVTX_DOMAIN_CREATE = 75
# ENUM_CUDA_MEMCPY_OPER labels (CUpti_ActivityMemcpyKind), for exports older than the enum tables.
_MEMCPY_LABELS = {
    0: "Unknown", 1: "Host-to-Device", 2: "Device-to-Host", 3: "Host-to-Array", 4: "Array-to-Host",
    5: "Array-to-Array", 6: "Array-to-Device", 7: "Device-to-Array", 8: "Device-to-Device", 9: "Host-to-Host",
    10: "Peer-to-Peer", 11: "Unified Host-to-Device", 12: "Unified Device-to-Host", 13: "Unified Device-to-Device",
}
_API_VERSION = re.compile(r"_v\d+$")
# ENUM_NSYS_EVENT_CLASS: 67 CUDA backtrace, 68/69 its start/finish (labels from a real 2024.5 export).
_BACKTRACE_CLASSES = (67, 68, 69)
_MAX_WARNINGS_PER_KIND = 5


def _connect(path: Path) -> sqlite3.Connection:
    # immutable=1: a report is only read and may sit on a read-only share, so skip locks and journals.
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    # SQLite refuses a file shorter than the page count in its header ("malformed") unless
    # writable_schema is on; then it reads what is there, which is what a truncated export needs.
    con.execute("PRAGMA writable_schema = ON")
    return con


class NsysMeta(NamedTuple):
    """Table.meta of an `nsys` table (parse_nsys_sqlite). A field is None when the export does not hold it (a file
    that SQLite cannot open has none but, maybe, tables)."""

    tables: list[str] | None = None  # the export's tables and views, sorted
    nsys_version: Any = None  # META_DATA_EXPORT / EXPORT_META_DATA EXPORT_PRODUCT_VERSION
    schema_version: Any = None  # EXPORT_SCHEMA_VERSION
    session_start_utc_ns: int | None = None  # TARGET_INFO_SESSION_START_TIME.utcEpochNs
    duration_ns: int | None = None  # ANALYSIS_DETAILS.duration
    devices: dict[int, Any] | None = None  # {GPU id: name} (TARGET_INFO_GPU, else TARGET_INFO_CUDA_GPU)
    cuda_devices: list[dict[str, Any]] | None = None  # [{pid, cuda_id, gpu_id}] (TARGET_INFO_CUDA_DEVICE)
    processes: dict[int, Any] | None = None  # {pid: name} (PROCESSES)
    threads: dict[int, str | None] | None = None  # {tid: name} (ThreadNames)
    backtrace_rows_skipped: int | None = None  # 'CUDA backtrace' copies of runtime calls dropped; None: none
    step_source: dict[Any, str] | None = None  # {pid: 'named' | 'optimizer'}: how the process's steps were found
    counts: dict[str, int] | None = None  # rows per category
    missing_tables: list[str] | None = None  # the activity / NVTX tables the export lacks


class _Export:
    """One pass over an nsys export; collects rows, meta and warnings, never raises on content."""

    def __init__(self, path: str | os.PathLike[str], name: str, rank: int | Mapping[int, int] | None) -> None:
        self.path = Path(path)
        self.name = name
        self.rank = rank
        self.warnings: list[str] = []
        self.facts: dict[str, Any] = {}  # NsysMeta's fields, as found
        self.con: sqlite3.Connection | None = None
        self.tables: set[str] = set()
        self.strings: dict[int, str] = {}
        self._warned: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        count = self._warned.get(key, 0)
        self._warned[key] = count + 1
        if count < _MAX_WARNINGS_PER_KIND:
            self.warnings.append(f"{self.name}: {message}")
        elif count == _MAX_WARNINGS_PER_KIND:
            self.warnings.append(f"{self.name}: further '{key}' warnings suppressed")

    # opening ------------------------------------------------------------------------------

    def open(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                header = fh.read(100)
            size = self.path.stat().st_size
        except OSError as exc:
            self.warn("open", f"cannot read ({exc.strerror or exc})")
            return False
        if not header.startswith(_SQLITE_MAGIC):
            self.warn("open", "not an SQLite database (no 'SQLite format 3' header); expected an "
                              "`nsys export --type sqlite` file")
            return False
        self._check_length(header, size)
        try:
            self.con = _connect(self.path)
            self.tables = {r[0] for r in self.con.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        except sqlite3.Error as exc:
            self.warn("open", f"SQLite cannot read the schema ({exc}); the file is corrupt or truncated")
            return False
        self.facts["tables"] = sorted(self.tables)
        if not self.tables & set(_NSYS_TABLES):
            self.warn("open", "no Nsight Systems tables (CUPTI_ACTIVITY_KIND_*, NVTX_EVENTS, ...) in this "
                              "SQLite file")
        return True

    def _check_length(self, header: bytes, size: int) -> None:
        if len(header) < 100:
            self.warn("truncated", f"only {size} bytes, shorter than an SQLite header")
            return
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        # The in-header page count is valid only when it was written by the same change (SQLite file format §1.3.7).
        if header[24:28] == header[92:96] and pages and page_size and size < pages * page_size:
            self.warn("truncated", f"file is {size} bytes but its header says {pages * page_size}: truncated; "
                                   f"rows in the missing pages are lost")

    def columns(self, table: str) -> set[str]:
        if table not in self.tables or self.con is None:
            return set()
        try:
            return {r[1] for r in self.con.execute(f'PRAGMA table_info("{table}")')}
        except sqlite3.Error as exc:
            self.warn(f"read {table}", f"cannot read the columns of {table} ({exc})")
            return set()

    def select(self, table: str, wanted: Sequence[str]) -> Iterator[dict[str, Any]]:
        """Rows of `table` as dicts with every wanted key (None where the column does not exist)."""
        present = self.columns(table)
        if not present or self.con is None:
            return
        exprs = [f'"{c}"' if c in present else f'NULL AS "{c}"' for c in wanted]
        n = 0
        try:
            cur = self.con.execute(f'SELECT {", ".join(exprs)} FROM "{table}"')
            for values in cur:
                n += 1
                yield dict(zip(wanted, values))
        except sqlite3.Error as exc:
            self.warn(f"read {table}", f"table {table} stopped after {n} rows ({exc}); the file is corrupt "
                                       f"or truncated, the rows before were kept")
            # After a corruption error SQLite may drop its parsed schema; the next table needs a fresh handle.
            self.con.close()
            try:
                self.con = _connect(self.path)
            except sqlite3.Error:
                self.con = None

    # lookups ------------------------------------------------------------------------------

    def load_strings(self) -> None:
        for row in self.select("StringIds", ["id", "value"]):
            if row["id"] is not None:
                self.strings[row["id"]] = row["value"]

    def text(self, value: Any) -> str | None:
        """A StringIds reference resolved; a value that is already text is returned as it is."""
        if value is None:
            return None
        if isinstance(value, str):
            return value
        found = self.strings.get(value)
        if found is None:
            self.warn("string id", f"string id {value} is not in StringIds")
        return found

    def load_meta(self) -> None:
        for table in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
            for row in self.select(table, ["name", "value"]):
                if row["name"] == "EXPORT_PRODUCT_VERSION":
                    self.facts["nsys_version"] = row["value"]
                elif row["name"] == "EXPORT_SCHEMA_VERSION":
                    self.facts["schema_version"] = row["value"]
        for row in self.select("TARGET_INFO_SESSION_START_TIME", ["utcEpochNs"]):
            self.facts["session_start_utc_ns"] = row["utcEpochNs"]
        for row in self.select("ANALYSIS_DETAILS", ["duration"]):
            self.facts["duration_ns"] = row["duration"]
        devices: dict[int, str] = {}
        for row in self.select("TARGET_INFO_GPU", ["id", "name"]):
            if row["id"] is not None:
                devices[row["id"]] = row["name"]
        if "TARGET_INFO_CUDA_GPU" in self.tables:
            key = "deviceId" if "deviceId" in self.columns("TARGET_INFO_CUDA_GPU") else "id"
            for row in self.select("TARGET_INFO_CUDA_GPU", [key, "name"]):
                if row[key] is not None:
                    devices.setdefault(row[key], row["name"])
        self.facts["devices"] = devices
        self.facts["cuda_devices"] = [
            {"pid": r["pid"], "cuda_id": r["cudaId"], "gpu_id": r["gpuId"]}
            for r in self.select("TARGET_INFO_CUDA_DEVICE", ["pid", "cudaId", "gpuId"])]
        self.facts["processes"] = {r["pid"]: r["name"] for r in self.select("PROCESSES", ["pid", "name"])
                                  if r["pid"] is not None}
        threads: dict[int, str | None] = {}
        for row in self.select("ThreadNames", ["nameId", "globalTid"]):
            tid = split_global_id(row["globalTid"])[1]
            if tid is not None:
                threads[tid] = self.text(row["nameId"])
        self.facts["threads"] = threads

    def memcpy_labels(self) -> dict[int, str]:
        labels = dict(_MEMCPY_LABELS)
        for row in self.select("ENUM_CUDA_MEMCPY_OPER", ["id", "label"]):
            if row["id"] is not None and row["label"]:
                labels[row["id"]] = row["label"]
        return labels

    def rank_of(self, pid: int | None) -> int | None:
        if isinstance(self.rank, Mapping):
            return self.rank.get(pid) if pid is not None else None
        return self.rank

    # rows ---------------------------------------------------------------------------------

    def backtrace_classes(self) -> set[int]:
        """eventClass ids of the rows nsys adds to the runtime table to hang a CUDA backtrace on.

        With --cudabacktrace every sampled call appears twice (e.g. `cudaMemcpy_v3020` with class 0
        and `cudaMemcpy` with class 67 'CUDA backtrace' in pipit's 2022.2 export); the copy is no call.
        """
        classes = {r["id"] for r in self.select("ENUM_NSYS_EVENT_CLASS", ["id", "name"])
                   if r["id"] is not None and "BACKTRACE" in (r["name"] or "").upper()}
        return classes or set(_BACKTRACE_CLASSES)

    def runtime_rows(self) -> list[dict[str, Any]]:
        rows, skipped = [], 0
        backtrace = self.backtrace_classes()
        for r in self.select("CUPTI_ACTIVITY_KIND_RUNTIME",
                             ["start", "end", "eventClass", "globalTid", "correlationId", "nameId"]):
            if r["eventClass"] in backtrace:
                skipped += 1
                continue
            pid, tid = split_global_id(r["globalTid"])
            name = self.text(r["nameId"])
            rows.append(self._row("cuda_runtime", r, name=_API_VERSION.sub("", name) if name else name,
                                  pid=pid, tid=tid))
        if skipped:
            self.facts["backtrace_rows_skipped"] = skipped
        return rows

    def kernel_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.select("CUPTI_ACTIVITY_KIND_KERNEL",
                             ["start", "end", "deviceId", "streamId", "correlationId", "globalPid",
                              "demangledName", "shortName"]):
            short = self.text(r["shortName"])
            name = self.text(r["demangledName"]) or short
            info = nccl_kernel_info(short or name)
            rows.append(self._row("kernel", r, name=name, short_name=short, pid=split_global_id(r["globalPid"])[0],
                                  kind=kernel_kind(short or name),
                                  collective=info.collective if info else None,
                                  nccl_algo=info.algo if info else None, nccl_proto=info.proto if info else None))
        return rows

    def memcpy_rows(self) -> list[dict[str, Any]]:
        labels = self.memcpy_labels() if "CUPTI_ACTIVITY_KIND_MEMCPY" in self.tables else {}
        rows = []
        for r in self.select("CUPTI_ACTIVITY_KIND_MEMCPY",
                             ["start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes",
                              "copyKind"]):
            label = labels.get(r["copyKind"], f"kind {r['copyKind']}")
            rows.append(self._row("memcpy", r, name=f"[CUDA memcpy {label}]", bytes=r["bytes"], copy_kind=label,
                                  pid=split_global_id(r["globalPid"])[0], kind="memory"))
        for r in self.select("CUPTI_ACTIVITY_KIND_MEMSET",
                             ["start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes"]):
            rows.append(self._row("memset", r, name="[CUDA memset]", bytes=r["bytes"],
                                  pid=split_global_id(r["globalPid"])[0], kind="memory"))
        return rows

    def nvtx_rows(self) -> list[dict[str, Any]]:
        events = list(self.select("NVTX_EVENTS", ["start", "end", "eventType", "text", "textId", "globalTid",
                                                  "domainId"]))
        domains: dict[tuple[int | None, Any], str | None] = {}
        for e in events:
            if e["eventType"] == _NVTX_DOMAIN_CREATE:
                domains[(split_global_id(e["globalTid"])[0], e["domainId"])] = (
                    self.text(e["textId"]) or e["text"])
        rows, open_ranges = [], 0
        for e in events:
            if e["eventType"] not in _NVTX_RANGE_TYPES:
                continue
            pid, tid = split_global_id(e["globalTid"])
            text = (self.text(e["textId"]) if e["textId"] is not None else None) or e["text"]
            if e["end"] is None:
                open_ranges += 1
            rows.append(self._row("nvtx", e, name=text, pid=pid, tid=tid, collective=_nvtx_collective(text),
                                  nvtx_domain=domains.get((pid, e["domainId"])) if e["domainId"] else None))
        if open_ranges:
            self.warn("open nvtx", f"{open_ranges} NVTX range(s) never ended (still open when capture stopped); "
                                   f"their end_ns and dur_ns are None")
        return rows

    def _row(self, category: str, r: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
        start, end = r.get("start"), r.get("end")
        dur = end - start if _is_time(start) and _is_time(end) else None
        row = {"category": category, "start_ns": start, "end_ns": end, "dur_ns": dur,
               "correlation": r.get("correlationId"), "device": r.get("deviceId"), "stream": r.get("streamId")}
        row.update(fields)
        row["rank"] = self.rank_of(row.get("pid"))
        return row

    def sensible(self, *groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Each group of rows without those whose time makes no physical sense (launch/sense.py), with one counted
        warning: a start, or an end, that is not an integer timestamp (a damaged export: text there cannot even be
        sorted against the others); an end before the start; a duration longer than a week; a start more than a
        week from the median of the others (one stray timestamp would stretch the measured span by years). An NVTX
        range still open when capture stopped has no end, and stays."""
        starts = sorted(r["start_ns"] for rows in groups for r in rows if _is_time(r["start_ns"]))
        mid = starts[len(starts) // 2] if starts else 0

        def why(r: dict[str, Any]) -> str | None:
            start, end, dur = r["start_ns"], r["end_ns"], r["dur_ns"]
            if not _is_time(start) or not (end is None or _is_time(end)):
                return _NOT_A_TIME
            if abs(start - mid) > _MAX_EVENT_NS:
                return _FAR
            if dur is not None and dur < 0:
                return _BACKWARDS
            if dur is not None and dur > _MAX_EVENT_NS:
                return _TOO_LONG
            return None

        dropped: Counter[str] = Counter()
        kept: list[list[dict[str, Any]]] = []
        for rows in groups:
            kept.append([])
            for r in rows:
                reason = why(r)
                if reason:
                    dropped[reason] += 1
                else:
                    kept[-1].append(r)
        if dropped:
            self.warnings.append(f"{self.name}: {sum(dropped.values())} row(s) dropped whose time makes no physical "
                                 f"sense (" + ", ".join(f"{dropped[reason]} {reason}" for reason in
                                                        (_NOT_A_TIME, _FAR, _BACKWARDS, _TOO_LONG) if dropped[reason])
                                 + ")")
        return kept

    # joins --------------------------------------------------------------------------------

    def join_launches(self, gpu: list[dict[str, Any]], runtime: list[dict[str, Any]]) -> None:
        launches = {(r["pid"], r["correlation"]): r for r in runtime if r["correlation"] is not None}
        missing = 0
        for row in gpu:
            call = launches.get((row["pid"], row["correlation"]))
            if call is None:
                missing += 1
                continue
            row["launch_api"] = call["name"]
            row["launch_start_ns"] = call["start_ns"]
            row["tid"] = call["tid"]
        if missing and runtime:
            self.warn("no launch", f"{missing} GPU activities have no CUDA runtime/driver call with their "
                                   f"correlation id in this process; launch_api is None for them")

    def assign_context(self, rows: list[dict[str, Any]], nvtx: list[dict[str, Any]]) -> None:
        named = [(r["pid"], r["tid"], r["start_ns"], r["end_ns"], step_number(r["name"])) for r in nvtx]
        step_source = {pid: "named" for pid, _, _, _, step in named if step is not None}
        derived = _steps_from_optimizer(nvtx, exclude=set(step_source))
        step_source.update({pid: "optimizer" for pid, *_ in derived})
        self.facts["step_source"] = step_source
        steps = _RangeIndex(named + derived)
        phases = _RangeIndex((r["pid"], r["tid"], r["start_ns"], r["end_ns"], phase_of(r["name"])) for r in nvtx)
        for row in rows:
            if row["category"] in ("kernel", "memcpy", "memset"):
                t, tid = (row.get("launch_start_ns"), row.get("tid"))
                if t is None:
                    t, tid = row["start_ns"], None
            else:
                t, tid = row["start_ns"], row["tid"]
            if t is None:
                continue
            row["step"] = steps.find(row["pid"], tid, t)
            row["phase"] = phases.find(row["pid"], tid, t)

    def run(self) -> Table:
        rows: list[dict[str, Any]] = []
        if self.open():
            self.load_strings()
            self.load_meta()
            runtime, gpu, nvtx = self.sensible(self.runtime_rows(), self.kernel_rows() + self.memcpy_rows(),
                                               self.nvtx_rows())
            self.join_launches(gpu, runtime)
            rows = runtime + gpu + nvtx
            self.assign_context(rows, nvtx)
            order = {"nvtx": 0, "cuda_runtime": 1, "kernel": 2, "memcpy": 2, "memset": 2}
            rows.sort(key=lambda r: (r["start_ns"] is None, r["start_ns"] or 0, order[r["category"]]))
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["category"]] = counts.get(r["category"], 0) + 1
            self.facts["counts"] = counts
            self.facts["missing_tables"] = [t for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME",
                                                       "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
                                                       "NVTX_EVENTS") if t not in self.tables]
        if self.con is not None:
            self.con.close()
        return Table.from_rows("nsys", COLUMNS, rows, source=self.name, warnings=self.warnings,
                               meta=NsysMeta(**self.facts))


# Physical sense for one row (launch/sense.py): no activity, call or range lasts a week; timestamps are integer
# nanoseconds (SQLite INTEGER): text, a float or a bool there is damage.
_MAX_EVENT_NS = sense.MAX_DURATION_S * 10**9
_NOT_A_TIME = "with a start or end that is not a timestamp"
_FAR = "starting more than a week from the others"
_BACKWARDS = "ending before it starts"
_TOO_LONG = "lasting longer than a week"


def _is_time(v: Any) -> bool:
    return type(v) is int


def _steps_from_optimizer(nvtx: list[dict[str, Any]], exclude: set[Any]) -> list[tuple[Any, None, int, int, int]]:
    """Step ranges for processes that mark phases but not steps: step k ends with the k-th optimizer range.

    One optimizer step closes one training step however many forward/backward micro-batches it took,
    so the optimizer ranges are the boundaries; step 0 starts at the process's first phase range.
    """
    by_pid: dict[Any, list[dict[str, Any]]] = {}
    for r in nvtx:
        if r["pid"] not in exclude and r["start_ns"] is not None and r["end_ns"] is not None and phase_of(r["name"]):
            by_pid.setdefault(r["pid"], []).append(r)
    steps = []
    for pid, ranges in by_pid.items():
        ranges.sort(key=lambda r: (r["start_ns"], -r["end_ns"]))
        start, reach, number = ranges[0]["start_ns"], None, 0
        for r in ranges:
            if phase_of(r["name"]) != "optimizer" or (reach is not None and r["end_ns"] <= reach):
                continue            # nested inside the previous optimizer range (e.g. a per-group step)
            steps.append((pid, None, start, r["end_ns"], number))
            start = reach = r["end_ns"]
            number += 1
    return steps


class _RangeIndex:
    """Labelled NVTX ranges per (pid, tid) and per pid, answering 'innermost labelled range open at t'."""

    def __init__(self, ranges: Iterable[tuple[Any, Any, Any, Any, Any]]) -> None:
        groups: dict[tuple, list[tuple[int, int, Any]]] = {}
        for pid, tid, start, end, label in ranges:
            if label is None or start is None or end is None:
                continue
            groups.setdefault((pid, tid), []).append((start, end, label))
            if tid is not None:
                groups.setdefault((pid, None), []).append((start, end, label))
        self.index = {key: _Sorted(items) for key, items in groups.items()}

    def find(self, pid: Any, tid: Any, t: int) -> Any:
        if tid is not None and (pid, tid) in self.index:
            label = self.index[(pid, tid)].innermost(t)
            if label is not None:
                return label
        found = self.index.get((pid, None))
        return found.innermost(t) if found else None


class _Sorted:
    def __init__(self, items: list[tuple[int, int, Any]]) -> None:
        items.sort(key=lambda x: (x[0], -x[1]))
        self.starts = [s for s, _, _ in items]
        self.ends = [e for _, e, _ in items]
        self.labels = [label for _, _, label in items]
        # Running maximum of ends lets a backwards scan stop once nothing earlier can still be open.
        self.reach: list[int] = []
        for e in self.ends:
            self.reach.append(max(e, self.reach[-1]) if self.reach else e)

    def innermost(self, t: int) -> Any:
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.reach[i] > t:
            if self.ends[i] > t:
                return self.labels[i]
            i -= 1
        return None


def parse_nsys_sqlite(path: str | os.PathLike[str], *, source: str = "",
                      rank: int | Mapping[int, int] | None = None) -> Table:
    """Read an `nsys export --type sqlite` file into the `nsys` table (columns in COLUMNS).

    `rank` labels the rows: an int for a one-process report, or {pid: rank} for a report that
    captured several ranks. `meta` (NsysMeta) holds nsys_version, schema_version, devices {id: name},
    cuda_devices, processes {pid: name}, threads {tid: name}, session_start_utc_ns, duration_ns,
    tables, missing_tables and counts per category. A file that is not SQLite, is corrupt or is
    truncated gives the rows that could be read (possibly none) and warnings naming the file.
    """
    return _Export(path, source or os.fspath(path), rank).run()


# --- sniffing -----------------------------------------------------------------------------------

SNIFF_BYTES = 1 << 20
_STATS_SIGNS = re.compile(
    r"(?m)^\s*\*\*\s.*\((?:cuda|nvtx|osrt|um|mpi|openmp|vulkan|dx1[12]|opengl|nvvideo|syscall)\w*\)\s*:?\s*$"
    r"|^\s*Processing \[[^\]]*\] with \[[^\]]*(?:reports|\.py)[^\]]*\]"
    r"|^\s*(?:\[\d+/\d+\]\s*)?Executing '\w+' stats report"
    r"|^\s*\"?Time ?(?:\(%\)|:ratio_%)\"?\s*[, ]\s*\"?Total Time"
    r"|^\"?Start(?: \(\w+\)|:ts_ns)\"?,.*\b(?:CorrId|GrdX|Reg/Trd|DurChild|RangeStack|NameTree|T-Pri)\b")


def sniff(path: str | os.PathLike[str]) -> str | None:
    """'nsys_sqlite' for an nsys SQLite export, 'nsys_stats_csv' for `nsys stats` output, else None.

    Decided by content: the SQLite header plus nsys table names (found through SQLite, or in the raw
    schema bytes when the file is too damaged to open), or the banners and headers of nsys stats text.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return None
    if head.startswith(_SQLITE_MAGIC):
        try:
            con = _connect(Path(path))
            try:
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                con.close()
            if tables & set(_NSYS_TABLES) and ("StringIds" in tables or tables & {"NVTX_EVENTS"}):
                return "nsys_sqlite"
            return None
        except sqlite3.Error:
            raw = head
            return "nsys_sqlite" if b"StringIds" in raw and any(t.encode() in raw for t in _NSYS_TABLES) else None
    text = head.decode("utf-8", errors="replace")
    return "nsys_stats_csv" if _STATS_SIGNS.search(text) else None
