"""Parse NCCL_DEBUG=INFO logs into one row per channel connection, and judge the transports.

A log may hold several ranks' output concatenated or interleaved, behind launcher prefixes
(`[1,0]<stdout>:`, `[0] `, timestamps). Every NCCL line carries `host:pid:tid [cudaDev]`; the
bracket is the *local* CUDA device of the logging thread, not the global rank. The global rank is
the number before `[` in a connection line (`3[4a000] -> 6[44000]`), whose own bracket is a bus id
(NCCL 2.5-2.11) or an NVML device index (2.12+); the `Init COMPLETE` lines tie ranks to hosts.

Formats handled (from NCCL's own printf strings, v2.3 to v2.30):
  Ring 00 : 0 -> 1 via NET/IB/0                                    (2.3-2.4)
  Ring 00 : 0[1b000] -> 7[41000] via direct shared memory          (2.4-2.6)
  Channel 00 : 3[4a000] -> 6[44000] [send] via NET/IB/0/GDRDMA     (2.7-2.11)
  Channel 03/0 : 5[5] -> 12[4] [send] via NET/IB/3                 (2.12+; /0 collectives, /1 p2p)
  Channel 00 : 3[3] -> 4[4] via SHM/direct/direct
  CollNet 00/0 : 3 [send] via COLLNET/SHARP/0/GDRDMA
  NVLS comm 0x... headRank 0 nHeads 8 ...                          (one row per rank, no peer)

NCCL prints a RoCE connection as NET/IB, like an InfiniBand one: the two differ only in the link layer its
device list names (`NET/IB : Using [0]mlx5_0:1/RoCE`), printed once per process; a NET/IB connection is NET/RoCE
when the device it names in that process's list is a RoCE one. Every fact a verdict cites as evidence (the devices,
the network chosen) is kept with the host that printed it, so that one host's lines never judge another's.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

from analysis.parsers._text import line_start_pattern, read_source, split_lines  # noqa: F401 (re-exported)
from analysis.table import Table

COLUMNS: dict[str, str] = {
    "host": "host of the logging process, from the `host:pid:tid` prefix; None where the prefix was stripped",
    "pid": "process id from the prefix (int); None where stripped",
    "rank": "rank (within its communicator) that printed the line: the sender for [send], P2P and SHM "
            "lines, the receiver for [receive] lines",
    "cuda_dev": "local CUDA device of the logging thread (the `[n]` after the prefix); not a rank",
    "comm": "communicator: NCCL's commId where the log prints it (2.18+), else the process-local comm "
            "pointer, else None; ranks are numbered within it",
    "channel": "channel id (int)",
    "conn_index": "connection index after the slash in `Channel 03/1` (0 collectives, 1 point-to-point); "
                  "None in formats without it",
    "peer_from": "sending rank (int); for CollNet/NVLS rows the rank itself",
    "peer_to": "receiving rank (int); None for CollNet and NVLS rows, which have no single peer",
    "peer_host": "host of the other end, looked up in the `Init COMPLETE` lines; None when not known",
    "direction": "'send' or 'receive' as printed for NET/CollNet lines; None for P2P/SHM lines",
    "transport": "normalised transport: P2P/IPC, P2P/CUMEM, P2P/direct pointer, P2P/indirect, SHM, "
                 "NET/IB, NET/IB/GDRDMA, NET/RoCE, NET/RoCE/GDRDMA (NET/IB on a device the process lists as "
                 "RoCE), NET/Socket, NET/<plugin>[/GDRDMA], CollNet, NVLS",
    "via_detail": "the text after `via`, verbatim (e.g. `NET/IBext_v8/3/GDRDMA`, `P2P/IPC/read`)",
    "kind": "'ring', 'tree', 'nvls', 'collnet' or 'p2p' when the log tells (the `Connected all rings/"
            "trees` marker that closes the block, `/1` for p2p, legacy `Ring` lines); else None",
    "line": "1-based line number in the source text",
}

# Numbers are read with at most 18 digits (64 bits): a longer one is no NCCL field, and int() of it could raise.
# `[1,0]<stdout>:` is Open MPI's --tag-output; other launchers' prefixes end before the host.
_MPI_TAG = re.compile(r"^\[\d+,\d+\]<(?:stdout|stderr)>:")
# WARN lines put the source position between the device and the level: `[1] net_ib.cc:512 NCCL WARN`.
_LEVEL = r"\[(?P<dev>\d{1,18})\](?: \S+:\d+(?: \([^)]*\))?)? NCCL (?P<level>INFO|WARN|TRACE|CALL)\b ?"
# The host, pid, tid and device before " NCCL " never take more than this.
MAX_PREFIX_CHARS = 512
_PREFIX = re.compile(r"(?P<host>[^\s:]+):(?P<pid>\d{1,18}):(?P<tid>\d{1,18}) " + _LEVEL)
# Users often paste logs with the host prefix cut away: ` [0] NCCL INFO ...`.
_BARE_PREFIX = re.compile(_LEVEL)
# NCCL's prefix where a log line starts (behind launcher prefixes), with a plausible host: how a log is
# recognised. find_log_line looks anywhere in a line, as nccl-tests output glues INFO lines into its
# rows, but a README or a script that quotes one does not start a line with it.
LOG_LINE_START = line_start_pattern(r"(?:[\w.-]+:\d+:\d+ )?" + _LEVEL)

_CONN = re.compile(
    r"^(?P<word>Channel|Ring) (?P<ch>\d{1,18})(?:/(?P<ci>\d{1,18}))? : (?P<src>\d{1,18})(?:\[[0-9a-fA-Fx]*\])? -> "
    r"(?P<dst>\d{1,18})(?:\[[0-9a-fA-Fx]*\])?(?: \[(?P<dir>send|receive)\])? via (?P<via>.*?)\s*$")
_COLLNET = re.compile(
    r"^(?:CollNet|Coll) (?P<ch>\d{1,18})(?:/(?P<ci>\d{1,18}))? : (?P<rank>\d{1,18}) \[(?P<dir>send|receive)\] "
    r"via (?P<via>.*?)\s*$")
_CONN_LIKE = re.compile(r"^(?:Channel|Ring|CollNet|Coll) \d+.* via ")
_RING_ORDER = re.compile(r"^(?:Channel|Ring) (?P<ch>\d{1,18})(?:/(?P<n>\d{1,18}))? :(?P<order>(?:\s+\d{1,18}(?!\d))+)\s*$")
_NVLS = re.compile(r"^NVLS comm (?P<ptr>0x[0-9a-fA-F]+|\(nil\)) headRank (?P<head>-?\d+) nHeads (?P<nheads>\d{1,18})")
_COMM_INFO = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d{1,18}) nRanks (?P<nranks>\d{1,18})"
    r"(?: nNodes (?P<nnodes>\d{1,18}))?")
_INIT = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d{1,18}) nranks (?P<nranks>\d{1,18}) cudaDev (?P<dev>\d{1,18})"
    r"(?: nvmlDev (?P<nvml>\d{1,18}))?(?: busId (?P<busid>[0-9a-fA-F]+))?.*?- Init (?P<phase>START|COMPLETE)")
_COMM_ID = re.compile(r"commId (0x[0-9a-fA-F]+)")
_VERSION = re.compile(
    r"\b(?P<lib>NCCL|RCCL) version (?P<ver>\d+\.\d+\.\d+)[^\s+]*(?:\+(?P<rt>cuda|hip)(?P<rtver>[\d.]+))?")
_DRIVER = re.compile(r"\bcudaDriverVersion (\d{1,18})(?!\d)")
_IB_USING = re.compile(r"^NET/IB\w* : Using(?P<rest>.*)$")
# `via NET/<name>/<dev>...`: <dev> indexes the process's own `NET/<name> : Using [<dev>]...` list.
_NET_DEV = re.compile(r"^NET/[^/]+/(?P<dev>\d{1,18})")
_IB_DEV = re.compile(r"\[(?P<idx>\d{1,18})\](?P<dev>[\w.-]+):(?P<port>\d{1,18})/(?P<link>[A-Za-z]+)")
_SOCKET_USING = re.compile(r"^NET/Socket : Using(?P<rest>.*)$")
_SOCKET_DEV = re.compile(r"\[(?P<idx>\d{1,18})\](?P<ifname>[^:\s]+):(?P<addr>\S+?)<\d+>")
_USING_NETWORK = re.compile(r"^Using network (?P<name>.+?)\s*$")
_ENV = re.compile(r"^(?P<name>NCCL_\w+) set (?:by environment )?to (?P<value>.*?)\.?\s*$")
_CHANNEL_COUNTS = re.compile(
    r"^(?P<coll>\d{1,18}) coll channels, (?:(?P<collnet>\d{1,18}) collnet channels, )?(?:(?P<nvls>\d{1,18}) nvls channels, )?"
    r"(?P<p2p>\d{1,18}) p2p channels, (?P<per_peer>\d{1,18}) p2p channels per peer")
_MARKERS = (
    (re.compile(r"^Connected all rings\b"), "ring"),
    (re.compile(r"^Connected all trees\b"), "tree"),
    (re.compile(r"^Connected NVLS\b"), "nvls"),
    (re.compile(r"^(?:Connected collnet|rank \d+ Connected CollNet)"), "collnet"),
)


@dataclass(frozen=True)
class LogLine:
    """An NCCL log line split into its prefix fields and the message after `NCCL INFO `."""

    host: str | None
    pid: int | None
    tid: int | None
    cuda_dev: int
    level: str
    message: str
    start: int  # offset of the prefix in the raw line, for callers that splice text around it


def strip_mpi_tag(raw: str) -> str:
    """`raw` without Open MPI's `[1,0]<stdout>:` output tag."""
    return _MPI_TAG.sub("", raw)


def find_log_line(raw: str) -> LogLine | None:
    """Find an NCCL log prefix anywhere in `raw` (launcher prefixes and glued text are tolerated)."""
    line = strip_mpi_tag(raw)
    offset = len(raw) - len(line)
    at = line.find(" NCCL ")
    if at < 0:  # no NCCL line; and the host pattern, tried at every offset of a long line, is quadratic
        return None
    m = _PREFIX.search(line, max(0, at - MAX_PREFIX_CHARS))
    if m:
        return LogLine(m["host"], int(m["pid"]), int(m["tid"]), int(m["dev"]), m["level"],
                       line[m.end():].rstrip(), m.start() + offset)
    m = _BARE_PREFIX.search(line)
    if m:
        return LogLine(None, None, None, int(m["dev"]), m["level"], line[m.end():].rstrip(), m.start() + offset)
    return None


def version_facts(message: str) -> dict[str, str]:
    """nccl_version / rccl_version / cuda_runtime / hip_runtime / cuda_driver named in one message."""
    facts: dict[str, str] = {}
    m = _VERSION.search(message)
    if m:
        facts["nccl_version" if m["lib"] == "NCCL" else "rccl_version"] = m["ver"]
        if m["rt"]:
            facts[f"{m['rt']}_runtime"] = m["rtver"].rstrip(".")
    m = _DRIVER.search(message)
    if m:
        v = int(m[1])
        facts["cuda_driver"] = f"{v // 1000}.{(v % 1000) // 10}"
    return facts


def normalise_transport(via: str) -> str:
    """Map the text after `via` onto one transport name (see COLUMNS['transport'])."""
    v = via.strip()
    parts = v.split("/")
    head = parts[0].upper()
    if head == "P2P" and len(parts) > 1:
        kind = parts[1]
        for name in ("direct pointer", "IPC", "CUMEM", "MNNVL", "indirect", "common device"):
            if kind.startswith(name):
                return f"P2P/{name}"
        return f"P2P/{kind}"
    if head == "SHM" or v.startswith("direct shared memory"):
        return "SHM"
    if head == "NET":
        m = re.match(r"NET/(?P<name>.+?)/\d+(?:\(\d+\))?(?P<rest>.*)$", v)
        name = m["name"] if m else (parts[1] if len(parts) > 1 else "?")
        # IBext / IBext_v8 is the SHARP plugin driving the same IB verbs: same fabric, same expectation.
        if re.match(r"IB(?:ext\w*)?$", name):
            name = "IB"
        gdr = bool(m) and "/GDRDMA" in m["rest"]
        return f"NET/{name}/GDRDMA" if gdr else f"NET/{name}"
    if head == "COLLNET":
        return "CollNet"
    if head == "NVLS":
        return "NVLS"
    return v


def _on_link(transport: str, via: str, links: Mapping[int, str]) -> str:
    """`transport` (normalise_transport) named by the link layer of its device: NET/IB over a device that the
    printing process listed as RoCE (`links`: its `NET/IB : Using` list, index -> link) is NET/RoCE."""
    m = _NET_DEV.match(via.strip())
    if transport in ("NET/IB", "NET/IB/GDRDMA") and m and links.get(int(m["dev"])) == "RoCE":
        return "NET/RoCE" + transport.removeprefix("NET/IB")
    return transport


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def parse_nccl_debug(path_or_text: str | os.PathLike[str], *, source: str = "") -> Table:
    """Parse an NCCL_DEBUG=INFO log (one rank or many, concatenated) into the `nccl_debug` table.

    Never raises on content: lines it cannot read are skipped, a line cut off at the end of the
    file is dropped with a warning, and an input without NCCL lines gives an empty table and a
    warning naming the file.
    """
    text, name, warnings = read_source(path_or_text, source)
    lines, last_cut = split_lines(text)
    reader = LogReader()
    seen_nccl = False
    for lineno, raw in enumerate(lines, start=1):
        cut = last_cut and lineno == len(lines)
        log = find_log_line(raw)
        if log is None:
            if not cut:  # VERSION-level lines come without a prefix
                reader.versions(raw)
            continue
        seen_nccl = True
        if cut:
            warnings.append(f"{name}:{lineno}: last line is cut short; ignored")
            break
        if not reader.line(log, lineno):
            warnings.append(not_understood(name, lineno, log))
    if not seen_nccl:
        warnings.append(f"{name}: no NCCL log lines found (was NCCL_DEBUG=INFO set?)")
    return reader.table(name, warnings)


def not_understood(name: str, lineno: int, log: LogLine) -> str:
    """The warning for a line that LogReader.line could not read."""
    return f"{name}:{lineno}: connection line not understood: {log.message[:120]}"


def _row(log: LogLine, lineno: int, **fields: Any) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS)
    row.update(host=log.host, pid=log.pid, cuda_dev=log.cuda_dev, line=lineno, **fields)
    return row


def _connection_row(m: re.Match, log: LogLine, comm: str | None, lineno: int,
                    links: Mapping[int, str]) -> dict[str, Any]:
    src, dst, direction, via = int(m["src"]), int(m["dst"]), m["dir"], m["via"]
    transport = _on_link(normalise_transport(via), via, links)
    # NET receive lines are printed by the receiver; NCCL 2.3 printed NET lines only on receive,
    # without the [receive] tag.
    receiver_prints = direction == "receive" or (
        direction is None and m["word"] == "Ring" and transport.startswith("NET/"))
    ci = _int(m["ci"])
    kind = "ring" if m["word"] == "Ring" else ("p2p" if ci == 1 else None)
    return _row(log, lineno, rank=dst if receiver_prints else src, comm=comm, channel=int(m["ch"]),
                conn_index=ci, peer_from=src, peer_to=dst, direction=direction, transport=transport,
                via_detail=via, kind=kind)


class NcclDebugMeta(NamedTuple):
    """Table.meta of an `nccl_debug` table (parse_nccl_debug): what the log says besides connections."""

    nccl_version: str | None = None  # `NCCL version X` (VERSION or INFO line)
    rccl_version: str | None = None  # `RCCL version X`
    cuda_runtime: str | None = None  # `+cudaX` after the NCCL version
    hip_runtime: str | None = None  # `+hipX` after the RCCL version
    cuda_driver: str | None = None  # `cudaDriverVersion N` as X.Y
    nranks: int | None = None  # ranks of the largest communicator (Init COMPLETE lines)
    ranks: dict[int, dict[str, Any]] | None = None  # {rank: {host, pid, cuda_dev, nvml_dev, busid, nranks}} of it
    comms: dict[str, dict[int, dict[str, Any]]] | None = None  # the same for every communicator, by commId
    ranks_ambiguous: bool | None = None  # one rank of a communicator announced by two processes
    hosts: list[str] | None = None  # the hosts that logged, sorted
    nnodes: int | None = None  # the largest `nNodes N` printed
    # [{host, device, port, link, line}] from `NET/IB : Using`, once per host (link: IB or RoCE; line: the first
    # that listed it there)
    ib_devices: list[dict[str, Any]] | None = None
    ib_no_device: list[str | None] | None = None  # the hosts that printed `NET/IB : No device found`
    # [{host, interface, address}] from `NET/Socket : Using`, once per host
    socket_interfaces: list[dict[str, Any]] | None = None
    net_plugins: list[dict[str, Any]] | None = None  # [{host, name}] of `Using network X`, in order, once per host
    env: Mapping[str, str] | None = None  # {variable: value} of the NCCL environment variables the log echoes
    algo_proto: dict[str, str] | None = None  # NCCL_ALGO / NCCL_PROTO among them
    rings: list[dict[str, Any]] | None = None  # [{channel, order, line}] of the `Ring NN : a b c` lines
    channel_counts: dict[str, int] | None = None  # the first `N coll channels, ...` line's counts
    nccl_warnings: list[str] | None = None  # the NCCL WARN lines, "line N: message"


class LogReader:
    """NCCL log lines read one at a time (`line`, and `versions` for prefix-less lines), then `table`: the loop of
    parse_nccl_debug, and of nccl-tests outputs that hold NCCL lines among their rows (analysis.parsers.nccl_tests)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {  # NcclDebugMeta's fields, filled while reading
            "nccl_version": None, "cuda_runtime": None, "cuda_driver": None, "nranks": None, "ranks": {},
            "comms": {}, "ranks_ambiguous": False, "hosts": [], "nnodes": None, "ib_devices": [],
            "ib_no_device": [], "socket_interfaces": [], "net_plugins": [], "env": {}, "algo_proto": {},
            "rings": [], "channel_counts": None, "nccl_warnings": [],
        }
        # Per logging thread: rows, closing markers and communicator starts in order, so that a
        # connection line gets the kind of the `Connected all ...` marker that ends its block.
        self.events: dict[tuple, list[tuple[str, Any]]] = defaultdict(list)
        self.thread_comm: dict[tuple, str] = {}       # last comm pointer announced on a thread
        self.pointer_comm_id: dict[tuple, str] = {}   # (host, pid, pointer) -> commId
        self.pointer_rank: dict[tuple, int] = {}      # (host, pid, pointer) -> rank
        self.inits: list[dict[str, Any]] = []         # Init COMPLETE lines
        self.links: dict[tuple, dict[int, str]] = defaultdict(dict)  # (host, pid) -> its NET/IB list: index -> link

    def versions(self, text: str) -> None:
        for key, value in version_facts(text).items():
            self.facts[key] = self.facts.get(key) or value

    def line(self, log: LogLine, lineno: int) -> bool:
        """Take one NCCL line; False when it looks like a connection line but cannot be read."""
        msg, facts = log.message, self.facts
        thread = (log.host, log.pid, log.tid) if log.host is not None else (None, None, log.cuda_dev)
        if log.level == "WARN":
            facts["nccl_warnings"].append(f"line {lineno}: {msg}")
            return True
        self.versions(msg)
        m = _CONN.match(msg)
        if m:
            self.rows.append(_connection_row(m, log, self.thread_comm.get(thread), lineno,
                                             self.links.get((log.host, log.pid), {})))
            self.events[thread].append(("row", len(self.rows) - 1))
            return True
        m = _COLLNET.match(msg)
        if m:
            rank = int(m["rank"])
            self.rows.append(_row(log, lineno, rank=rank, comm=self.thread_comm.get(thread), channel=int(m["ch"]),
                                  conn_index=_int(m["ci"]), peer_from=rank, direction=m["dir"],
                                  transport="CollNet", via_detail=m["via"], kind="collnet"))
            return True
        m = _NVLS.match(msg)
        if m:
            rank = self.pointer_rank.get((log.host, log.pid, m["ptr"]))
            self.rows.append(_row(log, lineno, rank=rank, peer_from=rank, comm=m["ptr"], transport="NVLS",
                                  via_detail=msg, kind="nvls"))
            return True
        m = _RING_ORDER.match(msg)
        if m:
            facts["rings"].append({"channel": int(m["ch"]), "order": [int(x) for x in m["order"].split()],
                                   "line": lineno})
            return True
        if _CONN_LIKE.match(msg):
            return False
        for pattern, kind in _MARKERS:
            if pattern.match(msg):
                self.events[thread].append(("marker", kind))
                return True
        self.fact(msg, log, lineno, thread)
        return True

    def announce(self, log: LogLine, ptr: str, rank: int, msg: str) -> None:
        comm_id = _COMM_ID.search(msg)
        if comm_id:
            self.pointer_comm_id[(log.host, log.pid, ptr)] = comm_id[1]
        self.pointer_rank[(log.host, log.pid, ptr)] = rank

    def fact(self, msg: str, log: LogLine, lineno: int, thread: tuple) -> None:
        facts = self.facts
        m = _INIT.search(msg)
        if m:
            self.announce(log, m["ptr"], int(m["rank"]), msg)
            if m["phase"] == "START":
                self.thread_comm[thread] = m["ptr"]
                self.events[thread].append(("reset", None))
            else:
                self.inits.append({"host": log.host, "pid": log.pid, "ptr": m["ptr"], "rank": int(m["rank"]),
                                   "nranks": int(m["nranks"]), "cuda_dev": int(m["dev"]),
                                   "nvml_dev": _int(m["nvml"]), "busid": m["busid"], "line": lineno})
            return
        m = _COMM_INFO.search(msg)
        if m:
            self.announce(log, m["ptr"], int(m["rank"]), msg)
            self.thread_comm[thread] = m["ptr"]
            self.events[thread].append(("reset", None))
            if m["nnodes"]:
                facts["nnodes"] = max(facts["nnodes"] or 0, int(m["nnodes"]))
            return
        m = _IB_USING.match(msg)
        if m:
            for d in _IB_DEV.finditer(m["rest"]):
                self.links[(log.host, log.pid)][int(d["idx"])] = d["link"]
                dev = {"host": log.host, "device": d["dev"], "port": int(d["port"]), "link": d["link"]}
                if not any(dev.items() <= known.items() for known in facts["ib_devices"]):
                    facts["ib_devices"].append({**dev, "line": lineno})
            return
        if msg.startswith("NET/IB : No device found"):
            if log.host not in facts["ib_no_device"]:
                facts["ib_no_device"].append(log.host)
            return
        m = _SOCKET_USING.match(msg)
        if m:
            for d in _SOCKET_DEV.finditer(m["rest"]):
                iface = {"host": log.host, "interface": d["ifname"], "address": d["addr"]}
                if iface not in facts["socket_interfaces"]:
                    facts["socket_interfaces"].append(iface)
            return
        m = _USING_NETWORK.match(msg)
        if m:
            net = {"host": log.host, "name": m["name"]}
            if net not in facts["net_plugins"]:
                facts["net_plugins"].append(net)
            return
        m = _ENV.match(msg)
        if m:
            facts["env"][m["name"]] = m["value"]
            if m["name"] in ("NCCL_ALGO", "NCCL_PROTO"):
                facts["algo_proto"][m["name"]] = m["value"]
            return
        m = _CHANNEL_COUNTS.match(msg)
        if m and facts["channel_counts"] is None:
            facts["channel_counts"] = {k: int(v) for k, v in m.groupdict().items() if v is not None}

    def table(self, name: str, warnings: Iterable[str]) -> Table:
        """The `nccl_debug` table of the lines read (once, after the last line): what needs the whole log is
        derived here."""
        _assign_kinds(self.rows, self.events)
        _resolve_comms(self.rows, self.inits, self.pointer_comm_id, self.pointer_rank, self.facts)
        self.facts["hosts"] = sorted({r["host"] for r in self.rows if r["host"]} |
                                    {i["host"] for i in self.inits if i["host"]})
        return Table.from_rows("nccl_debug", COLUMNS, self.rows, source=name, warnings=warnings,
                               meta=NcclDebugMeta(**self.facts))


def _assign_kinds(rows: list[dict[str, Any]], events: Mapping[tuple, list[tuple[str, Any]]]) -> None:
    # Walk each thread's events backwards: a row belongs to the next marker after it unless a new
    # communicator starts in between. Rows no marker closes keep what the line itself told.
    for seq in events.values():
        closing: str | None = None
        for what, value in reversed(seq):
            if what == "marker":
                closing = value
            elif what == "reset":
                closing = None
            else:
                row = rows[value]
                if row["kind"] is None and closing is not None and closing != "collnet":
                    row["kind"] = closing
                elif row["conn_index"] == 1 and closing == "collnet":
                    row["kind"] = "collnet"


def _resolve_comms(rows: list[dict[str, Any]], inits: list[dict[str, Any]], pointer_comm_id: Mapping[tuple, str],
                   pointer_rank: Mapping[tuple, int], facts: dict[str, Any]) -> None:
    """Name each row's communicator and fill peer_host and the ranks, nranks and comms facts from the Init lines."""
    comms: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    comm_of_pointer: dict[tuple, str] = {}
    ambiguous = False
    for init in inits:
        pointer = (init["host"], init["pid"], init["ptr"])
        # Without a commId (before 2.18) processes cannot be matched to one communicator, so
        # communicators are told apart by size; same-size groups then share one map.
        key = comm_of_pointer[pointer] = pointer_comm_id.get(pointer) or f"nranks={init['nranks']}"
        entry = {k: init[k] for k in ("host", "pid", "cuda_dev", "nvml_dev", "busid", "nranks")}
        previous = comms[key].get(init["rank"])
        if previous is not None and (previous["host"], previous["pid"], previous["cuda_dev"]) != (
                entry["host"], entry["pid"], entry["cuda_dev"]):
            ambiguous = True
        comms[key].setdefault(init["rank"], entry)
    pointers_of_process: dict[tuple, set[str]] = defaultdict(set)
    for host, pid, ptr in pointer_rank:
        pointers_of_process[(host, pid)].add(ptr)
    comm_of_row: list[str | None] = [None] * len(rows)
    for index, row in enumerate(rows):
        ptr = row["comm"]
        if ptr is None and row["host"] is not None:
            # Connections made later from another thread (point-to-point, runtime connect) belong to
            # the process's communicator when it has only one.
            candidates = pointers_of_process.get((row["host"], row["pid"]), set())
            ptr = next(iter(candidates)) if len(candidates) == 1 else None
        if ptr is None:
            continue
        pointer = (row["host"], row["pid"], ptr)
        row["comm"] = pointer_comm_id.get(pointer, ptr)
        comm_of_row[index] = comm_of_pointer.get(pointer)
        if row["rank"] is None:  # NVLS lines name the comm, not the rank
            row["rank"] = row["peer_from"] = pointer_rank.get(pointer)
    if comms:
        world = max(comms, key=lambda k: (next(iter(comms[k].values()))["nranks"], len(comms[k])))
        facts["ranks"] = dict(sorted(comms[world].items()))
        facts["nranks"] = next(iter(comms[world].values()))["nranks"]
        facts["comms"] = {k: dict(sorted(v.items())) for k, v in comms.items()}
    facts["ranks_ambiguous"] = ambiguous
    only = next(iter(comms.values())) if len(comms) == 1 else None
    for row, key in zip(rows, comm_of_row):
        ranks = comms.get(key) or only
        if row["peer_to"] is None or ranks is None:
            continue
        other = row["peer_to"] if row["rank"] == row["peer_from"] else row["peer_from"]
        peer = ranks.get(other)
        row["peer_host"] = peer["host"] if peer else None


@dataclass(frozen=True)
class Finding:
    """One judgement about a log: severity 'warn' or 'info', a sentence, and the lines behind it."""

    severity: str
    message: str
    evidence: tuple[str, ...] = ()


def _who(ranks: Iterable[int | None], host: str | None) -> tuple[str, bool]:
    """('ranks 0–7, 12 on host A', plural?) for a message; unknown ranks are left out."""
    values = sorted({r for r in ranks if r is not None})
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in spans) or "?"
    plural = len(values) != 1
    return ("ranks " if plural else "rank ") + text + (f" on host {host}" if host else ""), plural


def _evidence(rows: list[dict[str, Any]], limit: int = 3) -> tuple[str, ...]:
    return tuple(f"line {r['line']}: {r['peer_from']} -> {r['peer_to']} via {r['via_detail']}"
                 for r in rows[:limit])


def _grouped(rows: Iterable[dict[str, Any]], key) -> list[tuple[Any, list[dict[str, Any]]]]:
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    return sorted(groups.items(), key=lambda kv: str(kv[0]))


def _is_inter_node(row: Mapping[str, Any]) -> bool:
    # NET is NCCL's inter-node transport; it is only used inside a node when P2P and SHM are
    # both unavailable, which the peer's host (when known) reveals.
    if row["peer_host"] is not None and row["host"] is not None:
        return row["peer_host"] != row["host"]
    return True


def verdict(table: Table, *, expect_net: str | None = None) -> list[Finding]:
    """Judge the transports in a `parse_nccl_debug` table.

    `expect_net` is what the hardware profile promises between nodes ("IB" for InfiniBand or RoCE);
    without it, the IB / RoCE devices a host lists are that host's expectation, and a host that lists none while
    others of the log do is named with them.
    """
    rows = list(table.rows())
    if not rows:
        return [Finding("info", "no connection lines found: set NCCL_DEBUG=INFO (and keep INIT in "
                                "NCCL_DEBUG_SUBSYS) to see which transports NCCL chose")]
    return _socket_findings(rows, table.meta, expect_net) + _shm_findings(rows, table.meta) + _gdr_findings(rows)


def _place(host: str | None) -> str:
    return f"host {host}" if host else "the lines without a host"


def _listing(host: str | None, devices: list[dict[str, Any]]) -> str:
    """'mlx5_0:1/RoCE, mlx5_1:1/RoCE listed by host a at line 2': a host's devices as NCCL printed them."""
    names = ", ".join(f"{d['device']}:{d['port']}/{d['link']}" for d in devices)
    return f"{names} listed by {_place(host)} at line {devices[0]['line']}"


def _socket_findings(rows: list[dict[str, Any]], meta: NcclDebugMeta, expect_net: str | None) -> list[Finding]:
    expected = (expect_net or "").upper().removeprefix("NET/") in ("IB", "ROCE")
    listed = dict(_grouped(meta.ib_devices, lambda d: d["host"]))
    sockets = [r for r in rows if r["transport"] == "NET/Socket" and _is_inter_node(r)]
    findings = []
    for (host, peer_host), group in _grouped(sockets, lambda r: (r["host"], r["peer_host"])):
        who, plural = _who((r["rank"] for r in group), host)
        talks = f"{who} {'talk' if plural else 'talks'} to {f'host {peer_host}' if peer_host else 'other nodes'}"
        own, others = listed.get(host), {h: d for h, d in listed.items() if h != host}
        if own or expected:
            links = {d["link"] for d in own or ()}
            net = "NET/RoCE" if links == {"RoCE"} else "NET/IB"
            why = _listing(host, own) if own else f"the profile expects {expect_net}"
            if {"host": host, "name": "Socket"} in meta.net_plugins:
                why += "; 'Using network Socket' (NCCL_NET, NCCL_IB_DISABLE or a missing plugin?)"
            findings.append(Finding("warn", f"{talks} over NET/Socket: expected {net} ({why})", _evidence(group)))
            continue
        why = (f"NET/IB found no device on {_place(host)}" if host in meta.ib_no_device
               else f"no IB or RoCE device listed by {_place(host)}")
        if others:
            # Another host of the job has the fabric: this one lacks it (a driver, a container's devices).
            findings.append(Finding("warn", f"{talks} over NET/Socket: {why}, while the log has "
                                            f"{'; '.join(_listing(h, d) for h, d in others.items())}",
                                    _evidence(group)))
        else:
            findings.append(Finding("info", f"{talks} over NET/Socket ({why}); TCP is far slower than IB/RoCE "
                                            f"for inter-node collectives", _evidence(group)))
    return findings


def _shm_findings(rows: list[dict[str, Any]], meta: NcclDebugMeta) -> list[Finding]:
    intra = [r for r in rows if r["peer_to"] is not None and not r["transport"].startswith("NET/")]
    p2p_disabled = meta.env.get("NCCL_P2P_DISABLE") == "1"
    findings = []
    for host, group in _grouped(intra, lambda r: r["host"]):
        shm = [r for r in group if r["transport"] == "SHM"]
        if not shm:
            continue
        who, plural = _who((r["rank"] for r in shm), host)
        if any(r["transport"].startswith("P2P/") for r in group):
            findings.append(Finding("info", f"{who} {'use' if plural else 'uses'} SHM for some GPU pairs while "
                                            f"others use P2P: those pairs cross the CPU interconnect (typical of "
                                            f"PCIe servers)", _evidence(shm)))
            continue
        cause = "NCCL_P2P_DISABLE=1 is set" if p2p_disabled else (
            "P2P is disabled or unavailable (NCCL_P2P_DISABLE, PCIe ACS/IOMMU, containers without shared IPC)")
        findings.append(Finding("warn", f"{who} {'exchange' if plural else 'exchanges'} data over SHM instead of "
                                        f"P2P: {cause}; expected P2P/IPC, P2P/CUMEM or P2P/direct pointer",
                                _evidence(shm)))
    return findings


def _gdr_findings(rows: list[dict[str, Any]]) -> list[Finding]:
    staged = [r for r in rows if r["transport"] in ("NET/IB", "NET/RoCE")]
    findings = []
    for (host, transport), group in _grouped(staged, lambda r: (r["host"], r["transport"])):
        who, plural = _who((r["rank"] for r in group), host)
        findings.append(Finding("info", f"{who} {'use' if plural else 'uses'} {transport} without GPUDirect RDMA: "
                                        f"data is staged through host memory (nvidia-peermem not loaded, or GPU "
                                        f"and NIC too far apart in PCIe)", _evidence(group)))
    return findings
