"""Parse PyTorch profiler (Kineto) Chrome traces, `.json` or `.json.gz`, into one table of events.

The file is read as a stream, so the working memory is a few MiB whatever the trace size (a gzip file as the
profiler writes it, up to 32 MiB of JSON, is inflated whole first: kineto_source); only the
table itself grows with the number of events kept (about 200 bytes a row). Two paths give the same
table: the C scanner (_kscan.c scans well-formed events straight into the columns), built by
`pip install` where a compiler is, and the Python path it hands anything unusual to (and the only one
without the build, or with LAYOUTLAB_KINETO_PURE=1): chunks cut at event boundaries, each batch decoded
at once by msgspec into small typed structs holding only the fields used here (_kineto_structs.py). A trace
that a crashed run left half-written, a gzip stream cut short, or bytes that are not JSON give the
events read up to that point (and after it, where the scanner can find the next event again) plus
a warning naming the file and the byte offset in the decompressed JSON text.

One row per complete ("ph": "X") event, except the profiler's own "Trace" span. Instant events,
flow arrows, counters and metadata are counted in `meta.events_skipped`; thread names from the
metadata events are kept in `meta.thread_names`.

Three modules: this one (the scanner, the collector of columns, steps and kernel links), kineto_source (the
file's bytes, inflated) and kineto_args (what an event's args say about a collective). Kernel classification
(analysis.parsers.gpu_kernels) follows HTA (facebookresearch/HolisticTraceAnalysis hta/utils/utils.py, the
same in 0.5.0 and at f4d0062): a name matching `^nccl.*Kernel` is communication, one starting with
Memcpy/Memset/dma is memory, one that contains Memcpy, starts with Memset or contains Sync is
"other", anything else is computation.

Table.meta: a `KinetoMeta` (rank, world_size, backend, device_properties, pg_config, ts_first_us / ts_last_us /
span_us, events_total, events_skipped, ts_float, truncated, read_until_us, thread_names, trace, gzip; see the
class). `parse_kineto_ranks` gives a `KinetoRanksMeta`, which holds one `KinetoMeta` per rank under `ranks`.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from analysis.parsers.gpu_kernels import kernel_collective, kernel_kind
from analysis.parsers.kineto_args import (
    cpu_collective,
    group_of,
    int_or_none,
    message_of,
    seq_of,
)
from analysis.parsers.kineto_source import CHUNK_BYTES, PURE, Source
from analysis.table import Table
from launch import sense

# Why a "ph": "X" event was not taken (meta.events_skipped keys). DAMAGED: those that mean an event the table
# cannot hold, as opposed to what a trace holds besides complete events (other phases, the profiler's own span):
# warned about.
NO_CAT_TS_DUR, NOT_FINITE = "no cat, ts or dur", "ts or dur not finite"
NOT_AN_OBJECT, WRONG_TYPES = "not an object", "fields of the wrong type"
DAMAGED = (NO_CAT_TS_DUR, NOT_FINITE, NOT_AN_OBJECT, WRONG_TYPES)

# The C fast path (analysis/parsers/_kscan.c, built by `pip install`, optional): it takes the
# well-formed events and leaves everything else to the decoders here, so the tables are the same
# without it. LAYOUTLAB_KINETO_PURE=1 turns it off (the tests run both ways).
_kscan: Any = None
if not PURE:
    try:
        from analysis.parsers import _kscan
    except ImportError:
        _kscan = None

COLUMNS: dict[str, str] = {
    "rank": "trainer rank: distributedInfo.rank, else a rank number in the file name (rank-3, rank_3, "
            "rank3), else None",
    "pid": "event pid as written (process id for CPU events, device index for GPU events)",
    "tid": "event tid as written (thread id for CPU events, stream for GPU events)",
    "stream": "int(args.stream) when the event has one (GPU kernels, memcpy, memset), else None",
    "category": "event category: kernel, gpu_memcpy, gpu_memset, cpu_op, cuda_runtime, cuda_driver, "
                "user_annotation, gpu_user_annotation, python_function, ... (PyTorch 1.8's Kernel, "
                "Memcpy, Memset, Runtime, Operator are mapped to these)",
    "name": "event name as written",
    "ts_us": "start time in microseconds, as written in the trace (epoch- or boot-relative)",
    "dur_us": "duration in microseconds",
    "kind": "for GPU events (stream set): computation | communication | memory | other, by HTA's "
            "name rules; None for CPU events",
    "collective": "all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv, reduce, "
                  "gather, scatter, barrier, or 'unknown' for communication kernels whose name says "
                  "no more; from NCCL kernel names (ncclDevKernel_AllReduce_Sum_bf16_RING_LL, "
                  "ncclKernel_AllReduce_RING_LL_Sum_float), from CPU ops (c10d::allreduce_, "
                  "record_param_comms with args 'Collective name', nccl:all_reduce, gloo:all_reduce, "
                  "_c10d_functional::all_reduce); a communication kernel takes the collective of the "
                  "CPU op that launched it when that is known (NCCL runs all_to_all as SendRecv "
                  "kernels); None for events that are not collectives",
    "message_bytes": "collective buffer size in bytes in nccl-tests' convention (all_gather: the "
                     "gathered output, reduce_scatter: the full input, others: the input): "
                     "max(args 'In msg size', 'Out msg size'), else max('In msg nelems', 'Out msg "
                     "nelems') x size of args 'dtype', else the largest tensor in 'Input Dims' x "
                     "its 'Input type' size; None when unknown",
    "message_from": "where message_bytes came from: msg_size | msg_nelems | input_dims | launch "
                    "(copied from the CPU collective that launched the kernel); None when unknown",
    "group": "process group: args 'Process Group Name', else 'Process Group Ranks' as text; None "
             "when not recorded",
    "group_size": "ranks in the process group: args 'Group size', else the length of 'Process Group "
                  "Ranks', else the pg_size of the named group in distributedInfo.pg_config; None "
                  "when not recorded",
    "seq": "the call's sequence number in its process group, args 'Seq' (the same on every rank of the group for "
           "the same call; written by PyTorch's NCCL process groups since 2026); None when not recorded",
    "step": "N of the ProfilerStep#N span containing the event's start (CPU events) or the start of "
            "the CPU call that launched it, matched by correlation (GPU events); None outside steps",
    "correlation": "args.correlation (links a cuda_runtime launch to its GPU event); None when absent",
    "launch_ts_us": "GPU events: start of the (earliest) CPU event with the same correlation, i.e. the "
                    "launch; None for CPU events and for GPU events launched before the trace began",
}


class KinetoMeta(NamedTuple):
    """Table.meta of one trace file (parse_kineto); also each rank's entry of KinetoRanksMeta.ranks.

    The same on the C fast path and the Python path. A field the file does not state is None; an entry that
    analysis.parsers.nsys_adapter makes for an nsys process sets only rank, world_size, pg_config, ts_float,
    source and pid."""

    rank: int | None = None  # distributedInfo.rank, else the rank number in the file name
    world_size: int | None = None  # distributedInfo.world_size
    backend: Any = None  # distributedInfo.backend ("nccl", "gloo")
    device_properties: list[Any] | None = None  # the trace's deviceProperties as written ([] when absent)
    pg_config: list[Any] | None = None  # process groups as recorded in distributedInfo.pg_config ([] when absent)
    ts_first_us: float | None = None  # first start of the rows kept
    ts_last_us: float | None = None  # last end of the rows kept
    span_us: float | None = None  # ts_last_us - ts_first_us (0 without rows)
    events_total: int | None = None  # traceEvents read
    events_skipped: dict[str, int] | None = None  # events not taken as rows, by reason ("ph=M", DAMAGED, ...)
    ts_float: bool | None = None  # some event's ts is a non-integer number: HTA rounds GPU intervals inward
    truncated: bool | None = None  # the traceEvents array never closed: the file was cut short
    read_until_us: float | None = None  # start of the last event read from a truncated file, else None
    thread_names: dict[str, str] | None = None  # {"pid/tid": name} from the thread_name metadata events
    trace: dict[str, Any] | None = None  # the file's other top-level keys (schemaVersion, traceName, ...)
    gzip: bool | None = None  # the file was gzip-compressed
    source: str | None = None  # the file the rank was read from (set in KinetoRanksMeta.ranks entries)
    pid: Any = None  # the process the rank was (nsys_adapter entries only)


class KinetoRanksMeta(NamedTuple):
    """Table.meta of a `kineto` table stacked from one trace per rank (parse_kineto_ranks) or adapted from nsys
    exports (analysis.parsers.nsys_adapter.as_kineto)."""

    ranks: Mapping[Any, KinetoMeta]  # {rank: that rank's KinetoMeta, with source set}
    world_size: int | None = None  # the world size every rank states; None when they differ or none does
    rank_from: str | None = None  # nsys_adapter: how ranks were numbered
    adapted_from: str | None = None  # nsys_adapter: "nsys"


# Events one trace's table holds: past this a trace keeps its first MAX_EVENTS and says so (a partial result). A
# kept event costs ~210 bytes of table (bench/bench_trace_memory.py; bench/results/bench_trace_memory.txt):
# 10 million are ~2 GiB, on a machine that reads every rank's trace in turn. 2 million tiny events take 5.6 MB of
# gzip (the bench's), so the file's size bounds nothing.
MAX_EVENTS = 10_000_000
_SLOW_WINDOW = 1 << 16         # bytes the slow path decodes to text at a time (it is tried first)
_MAX_PENDING_BYTES = 64 << 20   # an "event" still unfinished after this many bytes is garbage
_MAX_WARNINGS_PER_KIND = 5

# Category names of the first Kineto releases (PyTorch 1.8) -> the ones written since.
_CATEGORY_ALIASES = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
                     "Runtime": "cuda_runtime", "Operator": "cpu_op"}
_CPU_COLLECTIVE_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
_SCALAR_TYPES = frozenset({int, float, str, type(None)})

_EVENT_SEP = re.compile(rb"\}\s*,\s*(?=\{\s*\")")
_EVENT_START_BYTES = re.compile(rb"\{\s*\"")
_LEADING_SEPARATORS = re.compile(rb"[\s,]*")
_SURROGATES = re.compile("[\udc80-\udcff]")
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
# At most 18 digits: a step number in 64 bits (a longer one is no step the profiler wrote).
PROFILER_STEP = re.compile(r"ProfilerStep\s*#\s*(\d{1,18})(?!\d)")


class _CArgs:
    """The args of a collective row as the C scanner gives them, under _Args' field names."""

    __slots__ = ("collective_name", "in_nelems", "out_nelems", "in_size", "out_size", "dtype", "group_size",
                 "pg_name", "pg_ranks", "seq", "input_dims", "input_types")

    def __init__(self, values: tuple) -> None:
        for attr, value in zip(self.__slots__, values):
            setattr(self, attr, value)


def _structs() -> Any:
    """The msgspec decoders and structs (analysis.parsers._kineto_structs), imported when first
    needed: the C fast path reads well-formed traces without msgspec (20% of a small trace's time
    is start-up)."""
    from analysis.parsers import _kineto_structs

    return _kineto_structs


_UNDECODABLE = object()  # _decode_json's answer where msgspec refuses the value


def _decode_json(data: bytes) -> Any:
    """A JSON value (the C scanner's rare escaped strings and array / object args), by msgspec as the
    typed path would; _UNDECODABLE where msgspec refuses it (e.g. 1e400): the scanner then leaves
    that event to the Python path."""
    msgspec = _structs().msgspec
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return _UNDECODABLE


# Columns the C scanner leaves for scan_fast to pad (rank is one value; the others are filled later).
_PADDED = ("collective", "message_bytes", "message_from", "group", "group_size", "seq", "step", "launch_ts_us")
_UNWANTED = object()  # a category the caller did not ask for


class _Collector:
    """Turns decoded events into column lists; the hot loop of the parser.

    Typed batches (nearly all) need no per-event type checks. Loose batches are checked event by
    event as before, and their valid events converted to typed ones. Rows are built as tuples and
    turned into columns once per batch: one append per event instead of one per column, and the
    tuples live only as long as the batch.
    """

    def __init__(self, rank: int | None, wanted: frozenset[str] | None):
        self.rank = rank
        self.wanted = wanted
        self.cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
        self.skipped: Counter[str] = Counter()
        self.total = 0
        self.thread_names: dict[str, str] = {}
        self.pg_sizes: dict[str, int] = {}
        # Repeated values share one object (categories, names, durations, pids, tids): the table of
        # a large trace is mostly these columns.
        self._names: dict[str, str] = {}
        self._categories: dict[Any, Any] = {}
        self._durs: dict[Any, Any] = {}
        self._ids: dict[Any, Any] = {}
        self._kind: dict[str, str] = {}
        self._kernel_coll: dict[str, str] = {}
        self._cpu_coll: dict[str, str | None] = {}

    def take(self, events: list[Any]) -> None:
        """A typed batch: the fields have Kineto's types, so no event needs a type check."""
        rows: list[tuple] = []
        add = rows.append
        names, durs, ids, kinds, cpu_coll = self._names, self._durs, self._ids, self._kind, self._cpu_coll
        categories, cpu_cats, rank = self._categories, _CPU_COLLECTIVE_CATEGORIES, self.rank
        phases: Counter[Any] = Counter()
        bad: Counter[str] = Counter()
        for e in events:
            ph = e.ph
            if ph != "X":
                phases[ph] += 1
                if ph == "M":
                    self._metadata(e)
                continue
            cat = e.cat
            ts = e.ts
            dur = e.dur
            if cat is None or ts is None or dur is None:
                bad[NO_CAT_TS_DUR] += 1
                continue
            if cat == "Trace":
                bad["profiler span"] += 1
                continue
            cat = categories.get(cat) or self._category(cat)
            if cat is _UNWANTED:
                bad["category not wanted"] += 1
                continue
            name = e.name
            name = names.setdefault(name, name)
            pid = e.pid
            tid = e.tid
            pid = ids.setdefault(pid, pid)
            tid = ids.setdefault(tid, tid)
            args = e.args
            stream = args.stream
            corr = args.correlation
            kind = coll = None
            if stream is not None and stream != -1:
                kind = kinds.get(name)
                if kind is None:
                    kind = kinds[name] = kernel_kind(name)
                if kind == "communication":
                    coll = self._collective(name, kind, cat, args)
            elif cat in cpu_cats:
                coll = cpu_coll[name] if name in cpu_coll else self._cpu_collective(name)
                if coll is not None or name == "record_param_comms":
                    coll = self._collective(name, kind, cat, args)
            if coll is None:
                add((rank, pid, tid, stream, cat, name, ts, durs.setdefault(dur, dur), kind,
                     None, None, None, None, None, None, None, corr, None))
            else:
                add((rank, pid, tid, stream, cat, name, ts, durs.setdefault(dur, dur), kind, *coll, None, corr, None))
        self.total += len(events)
        for ph, count in phases.items():
            self.skipped[f"ph={ph}"] += count
        self.skipped.update(bad)
        if rows:
            for column, values in zip(self.cols.values(), zip(*rows)):
                column.extend(values)

    def take_loose(self, events: list[Any]) -> None:
        """A batch of _LooseEvent (or markers of values that are not objects), checked one by one."""
        structs = _structs()
        complete: list[Any] = []
        add = complete.append
        scalar = _SCALAR_TYPES
        phases: Counter[Any] = Counter()
        bad: Counter[str] = Counter()
        for e in events:
            try:
                ph = e.ph
                if ph != "X":
                    phases[ph] += 1
                    if ph == "M":
                        self._metadata(e)
                    continue
                cat = e.cat
                ts = e.ts
                dur = e.dur
                if cat is None or ts is None or dur is None:
                    bad[NO_CAT_TS_DUR] += 1
                    continue
                if cat == "Trace":
                    bad["profiler span"] += 1
                    continue
                if ts - ts or dur - dur:
                    bad[NOT_FINITE] += 1
                    continue
                hash(cat)  # take() looks categories up in dicts
                name, pid, tid = e.name, e.pid, e.tid
                if name.__class__ is not str:
                    name = "" if name is None else str(name)
                if pid.__class__ not in scalar:
                    pid = str(pid)
                if tid.__class__ not in scalar:
                    tid = str(tid)
                args = e.args
                if args is None:
                    args = structs.EMPTY_ARGS
                else:
                    fields = structs.msgspec.structs.asdict(args)
                    fields["stream"] = int_or_none(args.stream) if args.stream is not None else None
                    fields["correlation"] = int_or_none(args.correlation) if args.correlation is not None else None
                    args = structs.Args(**fields)
                add(structs.Event("X", cat, name, pid, tid, ts, dur, args))
            except AttributeError:
                bad[NOT_AN_OBJECT] += 1
            except (TypeError, ValueError):
                bad[WRONG_TYPES] += 1
        self.total += len(events) - len(complete)
        for ph, count in phases.items():
            self.skipped[f"ph={ph}"] += count
        self.skipped.update(bad)
        self.take(complete)

    def _collective(self, name: str, kind: str | None, cat: str, args: Any) -> tuple | None:
        """(collective, message_bytes, message_from, group, group_size, seq) of a row that may be a
        collective: a communication kernel, or a CPU op of a collective category whose name (or
        record_param_comms' args) says so; None when it is not one."""
        if kind == "communication":
            coll = self._kernel_coll.get(name)
            if coll is None:
                coll = self._kernel_coll[name] = kernel_collective(name)
            if args.collective_name is not None:
                coll = cpu_collective("record_param_comms", args.collective_name) or coll
        elif kind is None and cat in _CPU_COLLECTIVE_CATEGORIES:
            if name == "record_param_comms":
                coll = cpu_collective(name, args.collective_name)
            else:
                coll = self._cpu_coll[name] if name in self._cpu_coll else self._cpu_collective(name)
        else:
            return None
        if coll is None:
            return None
        return (coll, *message_of(args), *group_of(args, self.pg_sizes), seq_of(args))

    def scan_fast(self, buf: bytes) -> tuple[int, int]:
        """Rows of the complete events at the start of `buf`, through the C scanner (_kscan).

        Returns (bytes taken, why it stopped: 0 the buffer ends inside an event, 1 no event starts
        there, 2 an event the C scanner leaves to the decoders here)."""
        ctx = self.scan_context()
        cols = self.cols
        before = len(cols["name"])
        end, why, events, specials, metadata, phases, no_cat, trace_span, unwanted = _kscan.scan(buf, 0, ctx)
        added = len(cols["name"]) - before
        if added:
            cols["rank"].extend([self.rank] * added)
            padding = [None] * added
            for column in _PADDED:
                cols[column].extend(padding)
        self.total += events
        skipped = self.skipped
        for ph, count in phases.items():
            skipped[f"ph={ph}"] += count
        for reason, count in ((NO_CAT_TS_DUR, no_cat), ("profiler span", trace_span),
                              ("category not wanted", unwanted)):
            if count:
                skipped[reason] += count
        for event in metadata:
            self._thread_name(*event)
        if specials:
            names, kinds, cats = cols["name"], cols["kind"], cols["category"]
            targets = [cols[c] for c in ("collective", "message_bytes", "message_from", "group", "group_size", "seq")]
            for row, args in specials:
                values = self._collective(names[row], kinds[row], cats[row], _CArgs(args))
                if values is not None:
                    for column, value in zip(targets, values):
                        column[row] = value
        return end, why

    def scan_context(self) -> tuple:
        """The `ctx` argument of _kscan.scan (see its source)."""
        return (list(self.cols.values()), self._category_pair, self._names, self._ids, self._durs,
                self._kind, kernel_kind, self._cpu_coll, self._cpu_collective, _decode_json, _UNDECODABLE)

    def _category_pair(self, cat: str) -> tuple[str | None, bool]:
        """For the C scanner: (the category `cat` stands for, or None when not wanted; whether CPU
        collectives are looked for in it)."""
        name = self._categories.get(cat) or self._category(cat)
        if name is _UNWANTED:
            return None, False
        return name, name in _CPU_COLLECTIVE_CATEGORIES

    def _category(self, cat: Any) -> Any:
        """The category a trace's `cat` stands for (alias resolved, one shared object), or
        _UNWANTED; remembered in self._categories."""
        name = _CATEGORY_ALIASES.get(cat, cat)
        name = self._names.setdefault(name, name)
        if self.wanted is not None and name not in self.wanted:
            name = _UNWANTED
        self._categories[cat] = name
        return name

    def _cpu_collective(self, name: str) -> str | None:
        coll = self._cpu_coll[name] = cpu_collective(name)
        return coll

    def header(self, top: dict[str, Any]) -> None:
        """Take rank and process-group sizes from the keys before traceEvents, so rows get them directly."""
        dist = top.get("distributedInfo")
        if not isinstance(dist, dict):
            return
        self.rank = int_or_none(dist.get("rank"))
        pgs = dist.get("pg_config")
        for pg in pgs if isinstance(pgs, list) else []:
            if isinstance(pg, dict) and int_or_none(pg.get("pg_size")) is not None:
                self.pg_sizes[str(pg.get("pg_name"))] = int_or_none(pg.get("pg_size"))

    def _metadata(self, e: Any) -> None:
        self._thread_name(e.name, e.pid, e.tid, e.args.name if e.args is not None else None)

    def _thread_name(self, name: Any, pid: Any, tid: Any, thread: Any) -> None:
        if name == "thread_name" and isinstance(thread, str):
            self.thread_names[f"{pid}/{tid}"] = thread


class _Scanner:
    """Streams the top-level JSON value, handing batches of traceEvents to the collector.

    Fast path: cut the buffered text after the last `}, {"` and decode `[` + text + `]` in one call;
    that succeeds only when the cut lies between two events of the array (a cut inside a string or a
    nested object leaves a bracket or a quote open), so a wrong cut just fails and the slow path
    takes over. Slow path: decode one value at a time with json.JSONDecoder.raw_decode, which also
    tells an event that goes on in the next chunk from bytes that are not JSON.
    """

    def __init__(self, name: str, collector: _Collector, warn: Callable[[str], None],
                 on_events: Callable[[dict[str, Any]], None]):
        self.name, self.collector, self.warn, self.on_events = name, collector, warn, on_events
        self.buf = b""
        self.offset = 0            # decompressed byte offset of buf[0]
        self.state = "start"       # start, key, colon, value, events, after, done
        self.root_array = False
        self.key = ""
        self.top: dict[str, Any] = {}
        self.events_seen = False
        self.decoder: Any = None  # json.JSONDecoder, made when the slow path first needs it
        self.warned: Counter[str] = Counter()
        self.ignored_tail = 0

    def feed(self, chunk: bytes) -> None:
        if self.state == "done":
            self.ignored_tail += len(chunk.strip())
            return
        self.buf = self.buf + chunk if self.buf else chunk
        if len(self.buf) >= CHUNK_BYTES // 2:
            self._run(final=False)

    def finish(self) -> None:
        self._run(final=True)
        end = self.offset + len(self.buf)
        self.ignored_tail += len(self.buf.strip()) if self.state == "done" else 0
        if self.ignored_tail:
            self.warn(f"{self.name}: {self.ignored_tail} bytes after the end of the JSON document were ignored")
        if self.state == "events":
            self.warn(f"{self.name}: the traceEvents array is not closed at byte {end} (the writer did "
                      f"not finish); {self.collector.total} events read")
        elif not self.events_seen:
            self.warn(f"{self.name}: empty file" if end == 0 else
                      f"{self.name}: no traceEvents array found in {end} bytes")
        elif self.state not in ("done", "after"):
            self.warn(f"{self.name}: the JSON document ends early at byte {end} (after the events)")

    def _warn_limited(self, kind: str, text: str) -> None:
        self.warned[kind] += 1
        if self.warned[kind] <= _MAX_WARNINGS_PER_KIND:
            self.warn(text)
        elif self.warned[kind] == _MAX_WARNINGS_PER_KIND + 1:
            self.warn(f"{self.name}: more problems of this kind ({kind}) are not reported one by one")

    def _consume(self, nbytes: int) -> None:
        self.buf = self.buf[nbytes:]
        self.offset += nbytes

    def _run(self, final: bool) -> None:
        while self.buf and self.state != "done":
            if self.state == "events":
                progress = self._fast()
                if progress:
                    continue
                if progress is None and not final and len(self.buf) < _MAX_PENDING_BYTES:
                    return  # the buffer ends inside an event: wait for the next chunk
            mark = (self.offset, self.state)
            self._slow(final, _SLOW_WINDOW)
            if (self.offset, self.state) == mark and not final and len(self.buf) > _SLOW_WINDOW:
                self._slow(final)  # a value longer than the window
            if (self.offset, self.state) == mark:
                return

    def _fast(self) -> bool | None:
        """Take the complete events at the start of the buffer: True when some were taken, None
        when the buffer ends inside the first one (the C scanner says so), else False."""
        buf = self.buf
        if _kscan is not None:
            end, why = self.collector.scan_fast(buf)
            if end:
                self._consume(end)
                return True
            if why == 0:
                return None
            if why == 1:  # not an event (the closing bracket, garbage): the slow path decides
                return False
        lead = _LEADING_SEPARATORS.match(buf).end()
        if buf[lead:lead + 1] != b"{":
            return False
        tail_from = max(lead, len(buf) - (1 << 16))
        seps = list(_EVENT_SEP.finditer(buf, tail_from)) or list(_EVENT_SEP.finditer(buf, lead))
        view = memoryview(buf)
        structs = _structs()
        for m in reversed(seps[-2:]):
            text = b"".join((b"[", view[lead:m.start() + 1], b"]"))
            try:
                self.collector.take(structs.BATCH.decode(text))
            except structs.msgspec.ValidationError:  # some event breaks Kineto's types: decode it loosely
                try:
                    self.collector.take_loose(structs.LOOSE_BATCH.decode(text))
                except (structs.msgspec.DecodeError, RecursionError):
                    continue
            # the cut is not between two events, or junk nests deeper than msgspec recurses: the slow path decides
            except (structs.msgspec.DecodeError, RecursionError):
                continue
            self._consume(m.end())
            return True
        return False

    def _slow(self, final: bool, window: int | None = None) -> None:
        """Decode values one at a time from the buffer (its first `window` bytes when given and not
        final: the header before traceEvents needs no more), consuming what was decoded."""
        data = self.buf if window is None or final or len(self.buf) <= window else self.buf[:window]
        raw = data.decode("utf-8", "surrogateescape")
        # Bytes that are not UTF-8 become lone surrogates; decode a copy where each is U+FFFD (same
        # length, so indices still map back to byte offsets through `raw`).
        text = _SURROGATES.sub("\ufffd", raw)
        i, n = 0, len(text)
        batch: list[Any] = []
        bad: str | None = None
        while self.state != "done":
            i = _WHITESPACE.match(text, i).end()
            if i >= n:
                break
            ch = text[i]
            state = self.state
            if state == "start":
                if ch == "{":
                    self.state = "key"
                elif ch == "[":
                    self.state, self.root_array = "events", True
                    self._enter_events()
                    i += 1
                    break  # the events go to the fast path
                else:
                    bad = "the file does not start with a JSON object or array"
                    break
                i += 1
            elif state in ("key", "after"):
                if ch == "," and state == "after":
                    self.state = "key"
                    i += 1
                elif ch == "}":
                    self.state = "done"
                    i += 1
                elif ch == '"' and state == "key":
                    key, end, bad = self._decode(text, i, final)
                    if end is None:
                        break
                    self.key, self.state, i = str(key), "colon", end
                else:
                    bad = "expected a key or the end of the top-level object"
                    break
            elif state == "colon":
                if ch != ":":
                    bad = "expected ':' after a top-level key"
                    break
                self.state, i = "value", i + 1
            elif state == "value":
                if self.key == "traceEvents" and ch == "[":
                    self.state = "events"
                    self._enter_events()
                    i += 1
                    break  # the events go to the fast path
                value, end, bad = self._decode(text, i, final)
                if end is None:
                    break
                self.top[self.key] = value
                self.state, i = "after", end
            else:  # events
                if ch == ",":
                    i += 1
                elif ch == "]":
                    self.state = "done" if self.root_array else "after"
                    i += 1
                else:
                    value, end, bad = self._decode(text, i, final)
                    if end is None:
                        break
                    batch.append(_structs().event_from_dict(value))
                    i = end
                    if len(batch) >= 4096:
                        self.collector.take_loose(batch)
                        batch = []
        if batch:
            self.collector.take_loose(batch)
        self._consume(len(raw[:i].encode("utf-8", "surrogateescape")) if i < n else len(data))
        if bad is not None:
            self._resync(bad, final)

    def _enter_events(self) -> None:
        self.events_seen = True
        self.on_events(self.top)

    def _decode(self, text: str, i: int, final: bool) -> tuple[Any, int | None, str | None]:
        """(value, end, None) for the JSON value at text[i]; (None, None, None) when it goes on in
        the next chunk; (None, None, reason) when the bytes there are not JSON."""
        import json  # only here: the fast path needs no json module (start-up time)

        if self.decoder is None:
            self.decoder = json.JSONDecoder()
        try:
            value, end = self.decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            # Within the last few characters the value may just be cut (a `tru` of `true`, a `1.5e`).
            at_end = exc.pos >= len(text) - 9 or exc.msg.startswith("Unterminated string")
            if at_end and not final and len(text) - i < _MAX_PENDING_BYTES:
                return None, None, None
            return None, None, ("truncated" if at_end and final else f"not JSON ({exc.msg})")
        except (ValueError, RecursionError) as exc:
            return None, None, f"not JSON ({exc})"
        if end >= len(text) and not final:
            return None, None, None  # a number at the very end may go on in the next chunk
        return value, end, None

    def _resync(self, reason: str, final: bool) -> None:
        """Skip to the next place an event can start; give up on the file where there is none.

        `reason` is "truncated" when the input ends inside a value, else what is wrong."""
        at = self.offset
        in_events = self.state == "events"
        if reason == "truncated":
            if in_events:
                self._warn_limited("truncated", f"{self.name}: the trace ends inside an event at byte {at} "
                                                f"(file cut short or half-written); {self.collector.total} "
                                                f"events read before it")
            else:
                self._warn_limited("truncated", f"{self.name}: the file ends inside a JSON value at byte {at}")
                self.state = "done"
            self._consume(len(self.buf))
            return
        if not in_events:
            self._warn_limited("garbage", f"{self.name}: {reason} at byte {at}; the rest of the file is ignored")
            self.state = "done"
            self._consume(len(self.buf))
            return
        m = _EVENT_START_BYTES.search(self.buf, 1)
        if m is not None:
            self._warn_limited("garbage", f"{self.name}: {reason} at byte {at}; skipped to the next "
                                          f"event at byte {at + m.start()}")
            self._consume(m.start())
        elif not final:
            keep = 16  # an event start split across chunks
            self._warn_limited("garbage", f"{self.name}: {reason} at byte {at}; skipped "
                                          f"{max(0, len(self.buf) - keep)} bytes looking for the next event")
            self._consume(max(0, len(self.buf) - keep))
        else:
            self._warn_limited("garbage", f"{self.name}: {reason} at byte {at}; nothing after it could be read")
            self._consume(len(self.buf))


def _rank_from_name(path: str) -> int | None:
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector: building a table allocates millions of objects,
    none of them in a cycle, and each allocation burst would otherwise trigger collections that
    walk every container still alive (a third of the parse time of a large trace)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_kineto(path: str | os.PathLike[str], *, source: str = "",
                 categories: Iterable[str] | None = None) -> Table:
    """Parse one Kineto trace into a table (COLUMNS); never raises on bad input.

    `categories`, when given, keeps only events of those categories (after the aliases above), which
    bounds the table of a very large trace; ProfilerStep annotations and the CPU calls that link GPU
    events to steps are then missing unless user_annotation and cuda_runtime are among them.
    """
    with gc_paused():
        return _parse_kineto(path, source, categories)


def _parse_kineto(path: str | os.PathLike[str], source: str, categories: Iterable[str] | None) -> Table:
    name = source or os.fspath(path)
    warnings: list[str] = []
    wanted = frozenset(categories) if categories is not None else None
    collector = _Collector(None, wanted)
    scanner = _Scanner(name, collector, warnings.append, collector.header)
    reader = Source(path, name, warnings.append)
    capped = False
    for chunk in reader.chunks():
        scanner.feed(chunk)
        if len(collector.cols["ts_us"]) >= MAX_EVENTS:
            capped = True
            break
    if not reader.failed and not capped:
        scanner.finish()
    top = scanner.top
    dist = top.get("distributedInfo") if isinstance(top.get("distributedInfo"), dict) else {}
    cols = collector.cols
    if collector.rank is None:
        rank = int_or_none(dist.get("rank"))
        rank = rank if rank is not None else _rank_from_name(name)
        cols["rank"] = [rank] * len(cols["category"])
        collector.rank = rank
    bounds = time_bounds(cols["ts_us"], cols["dur_us"])
    dropped = _drop_senseless(cols, bounds)
    if dropped:
        warnings.append(f"{name}: {dropped} event(s) dropped whose time makes no physical sense (a negative "
                        f"duration or one longer than a week, a timestamp beyond ±{MAX_TS_US:g} us or more than a week "
                        f"from the trace's other events)")
    damaged = {why: n for why, n in collector.skipped.items() if why in DAMAGED}
    if damaged:
        warnings.append(f"{name}: {sum(damaged.values())} complete event(s) left out that cannot be read as one ("
                        + ", ".join(f"{n}: {why}" for why, n in damaged.items()) + ")")
    _assign_steps(cols)
    _link_kernels_to_collectives(cols)
    ts, dur = cols["ts_us"], cols["dur_us"]
    if dropped:
        bounds = time_bounds(ts, dur)
    first, last = (bounds.first_start, bounds.last_end) if bounds else (None, None)
    ts_float = bounds.ts_float if bounds else False
    # The traceEvents array never closed: the file was cut short. Kineto writes each thread's events in
    # start order, so every event that starts before the last one read is there and none after it.
    truncated = scanner.state == "events"
    read_until = ts[-1] if truncated and ts else None
    if read_until is not None:
        late = sorted(int(m.group(1)) for i, n in enumerate(cols["name"]) if n.startswith("ProfilerStep")
                      and (m := PROFILER_STEP.match(n)) and ts[i] + dur[i] > read_until)
        if capped:
            warnings.append(f"{name}: more than {MAX_EVENTS:,} events (analysis.parsers.kineto.MAX_EVENTS, ~2 GiB of "
                            f"table); the first {len(ts):,} are kept, up to ts {read_until} us, and the rest of the file "
                            "is left out: profile fewer steps (torch.profiler's schedule) to read it whole")
        if late:
            warnings.append(f"{name}: the trace is {'read up to' if capped else 'cut short at'} ts {read_until} us "
                            f"(the last event read); steps that end after it (ProfilerStep {', '.join(f'#{n}' for n in late)}) "
                            "have incomplete events and are left out of the measured window")
    meta = KinetoMeta(
        rank=collector.rank,
        world_size=int_or_none(dist.get("world_size")),
        backend=dist.get("backend"),
        device_properties=top.get("deviceProperties") or [],
        pg_config=dist.get("pg_config") or [],
        ts_first_us=first,
        ts_last_us=last,
        span_us=(last - first) if ts else 0,
        events_total=collector.total,
        events_skipped=dict(collector.skipped),
        ts_float=ts_float,
        truncated=truncated,
        read_until_us=read_until,
        thread_names=collector.thread_names,
        trace={k: v for k, v in top.items() if k not in ("distributedInfo", "deviceProperties")},
        gzip=reader.gzip,
    )
    _untrack(cols)
    return Table("kineto", cols, dict(COLUMNS), name, tuple(warnings), meta)


# Physical sense for one event (launch/sense.py): no profiled event lasts longer than a week (a ProfilerStep of a
# slow job may take hours); timestamps are microseconds since an epoch or a boot, far below 1e18.
MAX_EVENT_US = sense.MAX_DURATION_S * 1e6
MAX_TS_US = 1e18


def _drop_senseless(cols: dict[str, list[Any]], bounds: TimeBounds | None) -> int:
    """Remove the rows whose ts or dur makes no physical sense (see MAX_EVENT_US, MAX_TS_US; a start far from the
    median of the others, e.g. one kernel at ts=0, would stretch the span by years); the number removed. `bounds`:
    time_bounds of the columns, which the caller keeps when nothing is removed; rows are rebuilt only when
    something is wrong."""
    ts, dur = cols["ts_us"], cols["dur_us"]
    if not ts:
        return 0
    sample = sorted(ts[:: max(1, len(ts) // 1001)])
    mid = sample[len(sample) // 2]
    if not -MAX_TS_US <= mid <= MAX_TS_US:
        mid = 0.0
    lo, hi = mid - MAX_EVENT_US, mid + MAX_EVENT_US
    b = bounds  # not None: ts has rows
    if lo <= b.first_start and b.last_start <= hi and 0 <= b.min_dur and b.max_dur <= MAX_EVENT_US:
        return 0
    keep = [i for i, (t, d) in enumerate(zip(ts, dur, strict=True)) if lo <= t <= hi and 0 <= d <= MAX_EVENT_US]
    for k, col in cols.items():
        if isinstance(col, list) and len(col) == len(ts):
            cols[k] = [col[i] for i in keep]
    return len(ts) - len(keep)


# Row selections over a table's columns, which every analysis makes on ~10^5-10^6 rows: one C loop each where
# _kscan is built (a few ns a row), else itertools.compress over map (C speed too, ~50 ns a row here).
def rows_not(column: list[Any], value: Any) -> list[int]:
    """Row numbers whose item `is not` value."""
    if _kscan is not None and type(column) is list:
        return _kscan.rows_where(column, 0, value)
    return list(itertools.compress(itertools.count(), map(operator.is_not, column, itertools.repeat(value))))


def rows_equal(column: list[Any], value: Any) -> list[int]:
    """Row numbers whose item == value."""
    if _kscan is not None and type(column) is list:
        return _kscan.rows_where(column, 1, value)
    return list(itertools.compress(itertools.count(), map(operator.eq, column, itertools.repeat(value))))


def rows_in(column: list[Any], container: dict[Any, Any] | set[Any] | frozenset[Any]) -> list[int]:
    """Row numbers whose item is a key of the dict or a member of the set."""
    # C only for a plain dict: set.__contains__ retries an unhashable set item as a frozenset, and a subclass may
    # answer `in` its own way, neither of which PyDict_Contains / PySet_Contains do.
    if _kscan is not None and type(column) is list and type(container) is dict:
        return _kscan.rows_where(column, 2, container)
    return list(itertools.compress(itertools.count(), map(container.__contains__, column)))


@dataclass(frozen=True)
class TimeBounds:
    """The extremes of a table's event times, as the original objects (int or float, as written)."""

    first_start: Any
    last_start: Any
    min_dur: Any
    max_dur: Any
    last_end: Any  # the largest ts + dur
    ts_float: bool  # some start is a float (written with a fraction or exponent, 1.0 included)


def time_bounds(ts: list[Any], dur: list[Any]) -> TimeBounds | None:
    """TimeBounds of the rows, None when there are none; one C pass where _kscan is built and every value is an
    exact double (else min(), max() and any(), six passes). `last_end` is None when some start is an int too large
    for a float to be added to (a garbled trace's, which _drop_senseless drops before the bounds are used again)."""
    if not ts:
        return None
    k = _kscan.time_bounds(ts, dur) if _kscan is not None and type(ts) is list and type(dur) is list else None
    if k is not None:
        return TimeBounds(ts[k[0]], ts[k[1]], dur[k[2]], dur[k[3]], ts[k[4]] + dur[k[4]], k[5])
    try:
        last_end = max(map(operator.add, ts, dur))
    except OverflowError:
        last_end = None
    return TimeBounds(min(ts), max(ts), min(dur), max(dur), last_end, any(map(float.__instancecheck__, ts)))


def _untrack(cols: dict[str, list[Any]]) -> None:
    """Take the column lists out of the cyclic garbage collector (see _kscan.untrack_scalar_lists):
    they hold only scalars, and each collection would otherwise walk every value of the table."""
    if _kscan is not None:
        _kscan.untrack_scalar_lists(cols.values())


def _assign_steps(cols: dict[str, list[Any]]) -> None:
    """Fill `step` the way HTA's add_iteration does (CPU by time, GPU through the launch), and
    `launch_ts_us` of GPU events."""
    names, ts, dur, stream, corr = cols["name"], cols["ts_us"], cols["dur_us"], cols["stream"], cols["correlation"]
    steps, launch_ts = cols["step"], cols["launch_ts_us"]
    numbers = {}
    for name in set(names):
        m = PROFILER_STEP.match(name) if name.startswith("ProfilerStep") else None
        if m:
            numbers[name] = int(m.group(1))
    spans = [(ts[i], ts[i] + dur[i], numbers[names[i]]) for i in rows_in(names, numbers)]
    spans.sort()
    starts = [s[0] for s in spans]
    reach = []  # reach[k]: the latest end among spans[0..k], to stop the walk back early
    for s in spans:
        reach.append(max(reach[-1], s[1]) if reach else s[1])
    disjoint = all(reach[k - 1] <= spans[k][0] for k in range(1, len(spans)))
    if _kscan is not None and _kscan.assign_steps(ts, stream, corr, steps, launch_ts, spans, reach, disjoint):
        return
    launch_step: dict[int, int | None] = {}
    launch_at: dict[int, Any] = {}
    gpu_rows = []
    lo = hi = current = None  # the step the previous row fell in: events come in runs
    for i, t in enumerate(ts):
        st = stream[i]
        if st is not None and st != -1:
            gpu_rows.append(i)
            continue
        if lo is not None and lo <= t < hi:
            step = current
        else:
            step = None
            k = bisect.bisect_right(starts, t) - 1
            # HTA lets the last containing step win; steps rarely overlap, so this walk is one step long.
            while k >= 0 and reach[k] > t:
                if t < spans[k][1]:
                    step = spans[k][2]
                    if disjoint:
                        lo, hi, current = spans[k]
                    break
                k -= 1
        steps[i] = step
        c = corr[i]
        if c is not None:
            launch_step[c] = step
            if c not in launch_at or t < launch_at[c]:
                launch_at[c] = t
    for i in gpu_rows:
        c = corr[i]
        if c is not None:
            steps[i] = launch_step.get(c)
            launch_ts[i] = launch_at.get(c)


def _link_kernels_to_collectives(cols: dict[str, list[Any]]) -> None:
    """Give communication kernels the collective, size, group and sequence number of the CPU call that launched them.

    Old traces record sizes only on the CPU side (nccl:all_reduce with Input Dims); the launch
    (cudaLaunchKernel, same correlation as the kernel) lies inside that call on the same thread.
    """
    kind, corr, coll = cols["kind"], cols["correlation"], cols["collective"]
    # The row scans run in C: a table has ~10^5 rows, a few collectives.
    want = {corr[i]: i for i in rows_equal(kind, "communication") if corr[i] is not None}
    if not want:
        return
    ts, dur, pid, tid = cols["ts_us"], cols["dur_us"], cols["pid"], cols["tid"]
    stream, msg = cols["stream"], cols["message_bytes"]
    ops: dict[tuple[Any, Any], list[int]] = {}
    for i in rows_not(coll, None):
        if stream[i] is None or stream[i] == -1:
            ops.setdefault((pid[i], tid[i]), []).append(i)
    if not ops:
        return
    for rows in ops.values():
        rows.sort(key=lambda r: ts[r])
    starts = {k: [ts[r] for r in rows] for k, rows in ops.items()}
    for i in rows_in(corr, want):
        c = corr[i]
        if stream[i] is not None and stream[i] != -1:
            continue
        key = (pid[i], tid[i])
        rows = ops.get(key)
        if not rows:
            continue
        k = bisect.bisect_right(starts[key], ts[i]) - 1
        # Calls nest (c10d::* > record_param_comms > nccl:*), so a short walk back over earlier
        # starts finds every enclosing one. The innermost names the collective; the largest size
        # recorded among them is nccl-tests' convention (c10d::_allgather_base_ records the
        # gathered output, nccl:_all_gather_base only the input shard).
        launcher = sized = None
        for r in reversed(rows[max(0, k - 8):k + 1]):
            if ts[r] <= ts[i] <= ts[r] + dur[r]:
                if launcher is None:
                    launcher = r
                if msg[r] is not None and (sized is None or msg[r] > msg[sized]):
                    sized = r
        if launcher is None:
            continue
        g = want[c]
        if coll[launcher] not in (None, "barrier"):
            coll[g] = coll[launcher]
        if msg[g] is None and sized is not None:
            msg[g] = msg[sized]
            cols["message_from"][g] = "launch"
        if cols["group"][g] is None:
            cols["group"][g] = cols["group"][launcher]
        if cols["group_size"][g] is None:
            cols["group_size"][g] = cols["group_size"][launcher]
        if cols["seq"][g] is None:
            cols["seq"][g] = cols["seq"][launcher]


def parse_kineto_ranks(paths: Iterable[str | os.PathLike[str]], *,
                       categories: Iterable[str] | None = None) -> Table:
    """Parse one trace per rank and stack them into one table; meta.ranks holds each file's meta (KinetoRanksMeta)."""
    paths = list(paths)
    cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    warnings: list[str] = []
    ranks: dict[Any, KinetoMeta] = {}
    sources = []
    for p in paths:
        t = parse_kineto(p, categories=categories)
        sources.append(t.source)
        warnings.extend(t.warnings)
        rank = t.meta.rank
        if rank in ranks:
            warnings.append(f"{t.source}: rank {rank} was already read from {ranks[rank].source}; "
                            f"their events are pooled under one rank")
        ranks[rank] = t.meta._replace(source=t.source)
        if len(paths) == 1:  # one rank: its columns as they are, not copied (nor walked again for the GC)
            cols = t.columns
        else:
            for c in COLUMNS:
                cols[c].extend(t.columns[c])
        del t
    worlds = {m.world_size for m in ranks.values()} - {None}
    meta = KinetoRanksMeta(ranks=ranks, world_size=worlds.pop() if len(worlds) == 1 else None)
    if len(paths) > 1:
        _untrack(cols)
    return Table("kineto", cols, dict(COLUMNS), ", ".join(sources), tuple(warnings), meta)
