"""Parse the lines DeepSpeed itself writes during training into one table, one row per record.

A record is one printed fact: a `step=` progress line, one `name: value` pair of a wall-clock
timer line, a ThroughputTimer line, a memory report, a pipeline-engine `steps:` line, a loss-scale
overflow, or one Flops Profiler summary block. Timer lines are split into one row per timer so
that any timer name (ZeRO's `optimizer_*`, the pipeline's `pipe_*`, swap timers, ...) fits
without a column per name; analyzers pivot on `name`.

Formats handled (from DeepSpeed's own format strings, v0.3 of 2020 to v0.18 of 2026):
  step=136005, skipped=0, lr=[2.0e-05, 2.0e-05], mom=[(0.9, 0.95), (0.9, 0.95)]   engine._report_progress
  time (ms) | fwd_microstep: 715.45 | bwd_microstep: ... | step_microstep: 160.78  SynchronizedWallClockTimer.log
  time (ms) | fwd: 715.40 | bwd: ... | step: 160.79                                 (`forward`/`backward` until mid-2023)
  rank=0 time (ms) | forward: ...                                                    (2021-2023 spelling)
  time (ms) | forward: 1.00 | ... | mem_allocated: 1.2345 GB | max_mem_allocated: ... GB | ...  (2020 memory_breakdown)
  epoch=0/micro_step=5/global_step=5, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...,
      MemAllocated=3.71GB, MaxMemAllocated=39.0GB                                    ThroughputTimer (2022-07+)
  0/40, SamplesPerSec=83.48, MemAllocated=0.26GB, MaxMemAllocated=9.02GB             (2021-2022)
  0/10, SamplesPerSec=83.48                                                          (2020-2021)
  MA 3.71 GB  Max_MA 3.71 GB  CA 3.72 GB  Max_CA 4 GB                                see_memory_usage
  steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 250.000                  PipelineEngine.train_batch
  [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
  -------------------------- DeepSpeed Flops Profiler --------------------------   print_model_profile
Lines may carry the logging prefix `[2024-04-04 09:09:53,313] [INFO] [logging.py:96:log_dist]`,
`[Rank 0]`, a pdsh `host: ` prefix, Markdown indentation, or a progress bar glued in front.

Which step a record belongs to: DeepSpeed prints, within one optimizer step, ZeRO's optimizer
timers, then `step=`, then the throughput line, the micro-step timers, and last the global timer
line (the one holding `step`), which closes the step. Records between two closing lines share the
step of the `step=` line among them; `step=` is only printed every `steps_per_print` steps, so
blocks without one count on from the nearest block that has one. The pipeline engine prints its
`steps:` line and `pipe_*` timers after the closing line; they join the step they follow. A
Megatron-DeepSpeed log also holds Megatron's own lines: those are left to `megatron_log`.

Where the log holds more than one run (a restarted job, runs appended to one file), `meta.run_starts` says where
each next one begins: a `step=` (or `steps:`) that does not exceed the rank's last, DeepSpeed's version line
(printed as the engine starts) after training records, or a timestamp that falls back by more than
TIME_FALLBACK_S. The table itself still holds the whole file; analysis.parsers.runs reads each run apart.
"""
from __future__ import annotations

import ast
import math
import os
import re
from datetime import datetime
from typing import Any, NamedTuple

from analysis.parsers._text import (
    LineParser,
    has_lines,
    head_and_tail,
    line_start_pattern,
    read_source,
)
from analysis.table import Table
from launch.sense import clean

COLUMNS: dict[str, str] = {
    "kind": "record kind: 'step' (`step=` line), 'timer' (one `name: value` pair of a `time (ms)` line), "
            "'throughput' (ThroughputTimer line), 'memory' (see_memory_usage, or the memory part of a 2020 "
            "timer line), 'pipe_step' (pipeline engine `steps:` line), 'overflow' (fp16 loss-scale overflow), "
            "'flops_profile' (one Flops Profiler summary block)",
    "step": "optimizer step the record belongs to: printed on 'step', 'pipe_step' and 'flops_profile' rows; "
            "inferred for the others (see the module docstring); None when the log never prints a step, and "
            "for memory reports printed before the first step (model build, engine set-up)",
    "name": "'timer' rows: timer name as printed (fwd, bwd_microstep, optimizer_allgather, forward, ...); "
            "'memory' rows: the see_memory_usage message printed just before (e.g. 'After Building Model') or "
            "'timer' for a 2020 memory_breakdown; None otherwise",
    "time_ms": "'timer' rows: elapsed time in milliseconds as printed (micro-step timers: since the last "
               "micro-step; global timers: over the whole optimizer step)",
    "skipped": "'step' rows: number of skipped (overflowed) steps so far, as printed",
    "lr": "'step' rows: learning rate of the first parameter group",
    "lr_groups": "'step' rows: list of the learning rates of all parameter groups",
    "mom": "'step' rows: list of per-group momentum as printed: a float, or a (beta1, beta2) tuple; None if "
           "it could not be read",
    "epoch": "'throughput' rows: ThroughputTimer's epoch count",
    "micro_step": "'throughput' rows: ThroughputTimer's micro-step count within the epoch",
    "tput_global_step": "'throughput' rows: ThroughputTimer's own global_step count (2022-07+); it restarts at 0 "
                        "when a job resumes from a checkpoint, so it can differ from `step`",
    "samples_per_s_avg": "'throughput' rows: RunningAvgSamplesPerSec (older: SamplesPerSec), samples per second "
                         "averaged since the timer's start step; None when DeepSpeed printed -inf (no steps yet)",
    "samples_per_s": "'throughput' rows: CurrSamplesPerSec, samples per second of the last step; 'pipe_step' and "
                     "'flops_profile' rows: samples/sec as printed",
    "allocated_bytes": "'throughput' and 'memory' rows: torch memory_allocated() in bytes (DeepSpeed prints GiB "
                       "rounded to 2 decimals, so this is exact only to about 10 MiB)",
    "max_allocated_bytes": "'throughput' and 'memory' rows: max_memory_allocated() in bytes (same rounding)",
    "reserved_bytes": "'memory' rows: memory_reserved() (CA / cache_allocated) in bytes",
    "max_reserved_bytes": "'memory' rows: max_memory_reserved() (Max_CA / max_cache_allocated) in bytes; "
                          "see_memory_usage rounds Max_CA to whole GiB",
    "loss": "'pipe_step' rows: the averaged training loss printed by the pipeline engine",
    "iter_time_s": "'pipe_step' rows: seconds per step averaged over steps_per_print steps",
    "loss_scale": "'overflow' rows: the loss scale that overflowed",
    "new_loss_scale": "'overflow' rows: the loss scale DeepSpeed reduced it to",
    "world_size": "'flops_profile' rows: world size",
    "dp": "'flops_profile' rows: data-parallel size",
    "mp": "'flops_profile' rows: model-parallel size as DeepSpeed prints it (mpu's model-parallel world size, "
          "i.e. tp × pp under Megatron)",
    "micro_batch_size": "'flops_profile' rows: batch size per GPU",
    "params_per_gpu": "'flops_profile' rows: parameters on one GPU (the profiler prints 3 significant figures)",
    "params_total": "'flops_profile' rows: parameters of the model (params per GPU × mp_size, or with experts)",
    "fwd_macs_per_gpu": "'flops_profile' rows: multiply-accumulates of one forward pass on one GPU",
    "fwd_flops_per_gpu": "'flops_profile' rows: floating-point operations of one forward pass on one GPU",
    "fwd_flops_total": "'flops_profile' rows: forward floating-point operations of the model (× mp_size)",
    "fwd_latency_ms": "'flops_profile' rows: forward latency in milliseconds",
    "bwd_latency_ms": "'flops_profile' rows: backward latency in milliseconds (only with wall_clock_breakdown)",
    "step_latency_ms": "'flops_profile' rows: optimizer step latency in milliseconds",
    "iter_latency_ms": "'flops_profile' rows: fwd + bwd + step latency in milliseconds",
    "fwd_flop_per_s_per_gpu": "'flops_profile' rows: forward FLOP/s on one GPU",
    "bwd_flop_per_s_per_gpu": "'flops_profile' rows: backward FLOP/s on one GPU (2 or 2+recompute × fwd flops "
                              "/ bwd latency, as the profiler computes it)",
    "fwd_bwd_flop_per_s_per_gpu": "'flops_profile' rows: forward+backward FLOP/s on one GPU",
    "flop_per_s_per_gpu": "'flops_profile' rows: whole-iteration FLOP/s on one GPU (`FLOPS per GPU = ... / iter "
                          "latency`; printed since 2023)",
    "rank": "rank from a `[Rank N]` or `rank=N` prefix (-1 when DeepSpeed printed before torch.distributed was "
            "initialised); None without one",
    "host": "host from a pdsh-style `host: ` line prefix (the multi-node deepspeed launcher); None without one",
    "timestamp": "logging timestamp as printed (`2024-04-04 09:09:53,313`, local time of the host); None for "
                 "lines printed without the logging prefix",
    "comm_op": "'comms' rows: the operation as DeepSpeed's comms logger names it (all_reduce, broadcast, "
               "all_gather_into_tensor, barrier, ...)",
    "message_bytes": "'comms' rows: message size, bytes (printed with 1024-based units, rounded to 2 decimals)",
    "count": "'comms' rows: calls of that size",
    "total_latency_ms": "'comms' rows: summed latency, ms (None where printed negative: the logger's overflow)",
    "avg_latency_ms": "'comms' rows: mean latency per call, ms",
    "algbw_gbps": "'comms' rows: `tput_avg (Gbps)`, algorithm bandwidth in gigabits per second",
    "busbw_gbps": "'comms' rows: `busbw_avg (Gbps)`, bus bandwidth in gigabits per second",
    "line": "1-based line number of the record in the source text (first line, for a Flops Profiler block)",
}

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"
GIB = 1024 ** 3

_LOG_PREFIX = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[(?P<level>[A-Z]+)\] "
                         r"\[(?P<src>[\w.]+):\d+:(?P<func>\w+)\] ")
_RANK = re.compile(r"\[Rank (?P<rank>-?\d+)\]")
# pdsh prefixes every line with `host: `. What follows must look like DeepSpeed output, or the
# pipeline engine's own `steps: 10 loss: ...` would read as host `steps`.
_PDSH = re.compile(r"^\s*(?P<host>[A-Za-z0-9][\w.-]*): (?=\S*\[|step=|time \(ms\)|rank[=:]\d|epoch=|\d+/\d+, |"
                   r"steps: |MA |\s*\d+%\|)")
_STEP = re.compile(r"(?:\brank:(?P<rank>\d+) )?\bstep=(?P<step>\d+), skipped=(?P<skipped>\d+), "
                   r"lr=(?P<lr>\[[^\]]*\]|[^,]*), mom=(?P<mom>.*?)\s*$")
_TIMER = re.compile(r"(?:\brank=(?P<rank>\d+) )?time \(ms\)(?P<body>(?:\s*\|[^|]*)+)")
_PAIR = re.compile(r"^\s*(?P<name>[^:]+?)\s*:\s*(?P<value>" + _NUM + r")\s*(?P<unit>GB)?\s*$")
_TPUT_NEW = re.compile(r"epoch=(?P<epoch>\d+)/micro_step=(?P<micro>\d+)/global_step=(?P<gstep>\d+),")
_TPUT_OLD = re.compile(r"(?<![\w/=.])(?P<epoch>\d+)/(?P<micro>\d+), (?=(?:RunningAvg)?SamplesPerSec=)")
_KV = re.compile(r"(?P<key>\w+)=(?P<value>" + _NUM + r")(?P<unit>GB)?(?=[,\s]|$)")
_SEE_MEMORY = re.compile(r"\bMA (?P<ma>" + _NUM + r") GB\s+Max_MA (?P<max_ma>" + _NUM + r") GB\s+CA (?P<ca>" + _NUM +
                         r") GB\s+Max_CA (?P<max_ca>" + _NUM + r") GB")
_PIPE = re.compile(r"\bsteps: (?P<step>\d+) loss: (?P<loss>" + _NUM + r") (?:.*?)iter time \(s\): (?P<iter>" + _NUM +
                   r") samples/sec: (?P<sps>" + _NUM + r")")
_OVERFLOW = re.compile(r"OVERFLOW!(?:.*?Attempted loss scale: (?P<old>" + _NUM + r")(?:, reducing to (?P<new>" + _NUM +
                       r"))?)?")
_VERSION = re.compile(r"DeepSpeed info: version=(?P<ver>[^,\s]+)")
# DeepSpeed's comms logger summary (deepspeed.comm.log_summary): a header, then an operation name on a line of its
# own followed by one row per message size. Sizes use 1024-based units (utils/comms_logging.convert_size).
_COMMS_HEADER = re.compile(r"Comm\. Op\s+Message Size\s+Count\s+Total Latency\(ms\)\s+Avg Latency\(ms\)\s+"
                           r"tput_avg \(Gbps\)\s+busbw_avg \(Gbps\)")
_COMMS_OP = re.compile(r"^\s*(?P<op>[A-Za-z_][\w.]*)\s*$")
_COMMS_ROW = re.compile(r"^\s*(?P<size>[\d.]+)\s*(?P<unit>[KMGTPEZY]?B)\s+(?P<count>\d+)\s+(?P<total>" + _NUM
                        + r")\s+(?P<avg>" + _NUM + r")\s+(?P<tput>" + _NUM + r")\s+(?P<busbw>" + _NUM + r")\s*$")
_COMMS_UNIT = {u: 1024 ** i for i, u in enumerate(("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"))}
# The block's own header line (dashes on both sides): prose that mentions the profiler opens nothing.
_FLOPS_HEADER = re.compile(r"-{3,}\s*DeepSpeed Flops Profiler\s*-{3,}")
_FLOPS_STEP = re.compile(r"Profile Summary at step (?P<step>\d+)")
_FLOPS_END = re.compile(r"Aggregated Profile per|Detailed Profile per|Top \d* ?modules in terms")
_FLOPS_VALUE = re.compile(r"^\s*(?P<num>" + _NUM + r")\s*(?P<prefix>[TGMKkmuB]?)(?P<unit>MACs|FLOPS|s)?\s*$")
_PREFIX_SCALE = {"": 1.0, "T": 1e12, "G": 1e9, "B": 1e9, "M": 1e6, "K": 1e3, "k": 1e3, "m": 1e-3, "u": 1e-6}
# Label (as printed, whitespace collapsed; `per device` in the standalone package) -> column. Count
# (`fwd flops per GPU`) and rate (`fwd FLOPS per GPU = ... / fwd latency`) differ only in case, and
# not in every version, so a rate is told apart by the division in its formula.
_FLOPS_LABELS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p, re.IGNORECASE), c) for p, c in (
    (r"^world size$", "world_size"),
    (r"^data parallel size$", "dp"),
    (r"^model parallel size$", "mp"),
    (r"^batch size per (?:gpu|device)$", "micro_batch_size"),
    (r"^params per (?:gpu|device)$", "params_per_gpu"),
    (r"^params of model\b", "params_total"),
    (r"^fwd MACs per (?:gpu|device)$", "fwd_macs_per_gpu"),
    (r"^fwd flops per (?:gpu|device)(?: = [^/]*)?$", "fwd_flops_per_gpu"),  # 2021: `= 2 * fwd MACs per GPU`
    (r"^fwd flops of model\b", "fwd_flops_total"),
    (r"^fwd latency$", "fwd_latency_ms"),
    (r"^bwd latency$", "bwd_latency_ms"),
    (r"^step latency$", "step_latency_ms"),
    (r"^iter latency$", "iter_latency_ms"),
    (r"^fwd flops per (?:gpu|device) = .*/", "fwd_flop_per_s_per_gpu"),
    (r"^bwd flops per (?:gpu|device) =", "bwd_flop_per_s_per_gpu"),
    (r"^fwd\+bwd flops per (?:gpu|device) =", "fwd_bwd_flop_per_s_per_gpu"),
    (r"^flops per (?:gpu|device) =", "flop_per_s_per_gpu"),
    (r"^samples/second$", "samples_per_s"),
))
_FLOPS_INT = {"world_size", "dp", "mp", "micro_batch_size"}
_FLOPS_MAX_LINES = 60  # the summary is ~30 lines; an unclosed block must not swallow the log
# DeepSpeed names its timers in snake_case; Megatron's use hyphens or spaces (`forward-compute`,
# `batch generator`), which is how a bare `time (ms) |` line is told apart.
_DS_TIMER_NAME = re.compile(r"[a-z0-9_]+")
_MEMORY_BREAKDOWN = {"mem_allocated": "allocated_bytes", "max_mem_allocated": "max_allocated_bytes",
                     "cache_allocated": "reserved_bytes", "max_cache_allocated": "max_reserved_bytes"}
# Lines only DeepSpeed starts this way (behind launcher and logging prefixes): `step=`, the ThroughputTimer,
# the Flops Profiler banner and summary line, the version line, its logging prefix, and a timer line.
_SNIFF = line_start_pattern(
    r"(?:rank:\d+ )?step=\d+, skipped=\d+, lr=|"
    r"(?:epoch=\d+/micro_step=\d+/global_step=\d+|\d+/\d+), (?:RunningAvg)?SamplesPerSec=|"
    r"-* ?DeepSpeed Flops Profiler\b|Profile Summary at step \d+|DeepSpeed info: version=|"
    r"\[(?:INFO|WARNING)\] \[(?:logging|engine|config|timer|utils|real_accelerator|stage_1_and_2|stage3)\.py:\d+:|"
    r"(?:rank=\d+ )?time \(ms\) \| (?:fwd|forward)(?:_microstep)?: (?:" + _NUM + ")")
_MAX_WARNINGS_PER_KIND = 10
# A bracketed timestamp near the start of a line, read to the second: DeepSpeed's logging prefix, Megatron's
# `[2024-04-06 02:59:36] iteration`, other loggers' `[2025-11-10 09:56:51,975268][I]`. Farther along the line a
# bracketed date is part of a message.
_LINE_TIME = re.compile(r"\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)[.,\]]")
_LINE_TIME_REACH = 100
# A line this many seconds older than the timestamped line before it belongs to another run: one job's ranks and
# hosts reorder lines by seconds (buffered output, clock skew between hosts), not by minutes.
TIME_FALLBACK_S = 300


def sniff(path: str | os.PathLike[str]) -> str | None:
    """'deepspeed_log' if at least two lines of the file's first or last 64 KiB start (behind launcher
    and logging prefixes) the way DeepSpeed's own lines do, else None.

    A Megatron-DeepSpeed log sniffs as both this and `megatron_log`; each parser takes its own lines.
    """
    return "deepspeed_log" if has_lines(_SNIFF, head_and_tail(path)) else None


def is_deepspeed_timer_line(line: str) -> bool:
    """Whether a `time (ms) |` line was written by DeepSpeed (not by Megatron's old timers)."""
    m = _TIMER.search(line)
    if not m:
        return False
    before = line[:m.start()]
    if m["rank"] is not None or _RANK.search(before) or _LOG_PREFIX.search(before):
        return True
    names = [p["name"] for p in (_PAIR.match(f) for f in m["body"].split("|")[1:]) if p]
    return bool(names) and all(_DS_TIMER_NAME.fullmatch(n) for n in names)


class RunStart(NamedTuple):
    """Where the next run of a log begins, as one parser sees it (DeepSpeedLogMeta and MegatronLogMeta.run_starts).

    Each parser reads only its own lines, so a Megatron-DeepSpeed log gets a start from each for the same run (its
    `step=1` comes before its `iteration 1` line): starts whose ranges (after, line] overlap are one."""

    line: int  # the run's first line: the line that tells, or the first record of the step or set-up it opens
    after: int  # the line of the last record before it (0: none)
    why: str  # what tells, naming the lines compared


class LineClock:
    """The time of the last timestamped line, to tell a line whose time falls back to another run."""

    def __init__(self) -> None:
        self.stamp = ""  # `YYYY-MM-DD HH:MM:SS` of the last timestamped line: such strings sort as times do
        self.line = 0

    def falls_back(self, lineno: int, text: str) -> str | None:
        """Why `text` belongs to another run than the timestamped line before it (TIME_FALLBACK_S), or None."""
        m = _LINE_TIME.search(text, 0, _LINE_TIME_REACH)
        if not m:
            return None
        stamp, before, at = m[1], self.stamp, self.line
        self.stamp, self.line = stamp, lineno
        if stamp >= before:  # the common case, without parsing a date (a `T` sorts after a blank: parsed below)
            return None
        try:
            back = (datetime.fromisoformat(before) - datetime.fromisoformat(stamp)).total_seconds()
        except ValueError:  # an impossible date (month 13): no time to compare
            return None
        if back <= TIME_FALLBACK_S:
            return None
        return f"the time falls back from {before} (line {at}) to {stamp}"


class DeepSpeedLogMeta(NamedTuple):
    """Table.meta of a `deepspeed_log` table (parse_deepspeed_log)."""

    deepspeed_version: str | None = None  # the version DeepSpeed printed; None when it printed none
    steps_from: str | None = None  # how step numbers were assigned when the log has no step= lines; else None
    run_starts: tuple[RunStart, ...] = ()  # where each run after the first begins, when the log holds several


def parse_deepspeed_log(path_or_text: str | os.PathLike[str], *, source: str = "", first_line: int = 1) -> Table:
    """Parse DeepSpeed's training-log lines from a file path or the text itself into `deepspeed_log`.

    Never raises on content: unreadable lines are skipped with a warning naming the file and line,
    a last line cut off mid-record loses its final field, and an input without DeepSpeed lines
    gives an empty table and a warning. `meta` (DeepSpeedLogMeta) holds `deepspeed_version` when printed.
    """
    text, name, warnings = read_source(path_or_text, source)
    parser = _Parser(name, warnings)
    parser.run(text, first_line)
    warnings += clean(parser.rows, name, counts=("step", "epoch", "micro_step", "world_size", "dp", "mp",
                                                 "micro_batch_size", "rank", "count", "message_bytes"),
                      durations_ms=("time_ms", "fwd_latency_ms", "bwd_latency_ms", "step_latency_ms",
                                    "iter_latency_ms", "total_latency_ms", "avg_latency_ms"),
                      durations_s=("iter_time_s",), bandwidths_gbit_s=("algbw_gbps", "busbw_gbps"),
                      flop_per_s=("fwd_flop_per_s_per_gpu", "bwd_flop_per_s_per_gpu", "fwd_bwd_flop_per_s_per_gpu",
                                  "flop_per_s_per_gpu"),
                      rates_per_s=("samples_per_s", "samples_per_s_avg"), loss_scales=("loss_scale", "new_loss_scale"),
                      figures=("loss", "lr"))
    return Table.from_rows("deepspeed_log", COLUMNS, parser.rows, source=name, warnings=warnings,
                           meta=DeepSpeedLogMeta(deepspeed_version=parser.deepspeed_version,
                                                 steps_from=parser.steps_from,
                                                 run_starts=tuple(parser.run_starts)))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _gib(text: str) -> int | None:
    value = float(text)
    return round(value * GIB) if math.isfinite(value) else None


def _cut_last_field(text: str, separators: str = "|,") -> str:
    """Drop what follows the last separator: at a cut end of file the last value may be short."""
    cut = max(text.rfind(s) for s in separators)
    return text[:cut] if cut >= 0 else ""


class _Parser(LineParser):
    max_warnings_per_kind = _MAX_WARNINGS_PER_KIND

    def __init__(self, name: str, warnings: list[str]) -> None:
        super().__init__(name, warnings)
        self.rows: list[dict[str, Any]] = []
        self.deepspeed_version: str | None = None  # DeepSpeedLogMeta's fields
        self.steps_from: str | None = None
        self.row_block: list[int | None] = []   # block of each row; None: kept out of step inference
        self.block = 0
        self.block_rows = 0                        # rows placed in the current block so far
        self.block_step: dict[int, int] = {}
        self.flops: dict[str, Any] | None = None
        self.comms_op: str | None = None  # inside a comms logger summary: the operation of the rows below ('' first)
        self.training = False                     # set by the first per-step record
        self.last_message: tuple[int, str] | None = None  # for see_memory_usage's label line
        self.block_lines: dict[int, int] = {}     # first line of each block
        # Where runs start, and what the current run has shown: each rank's last step (step, line), the line of its
        # last training record (0: none).
        self.run_starts: list[RunStart] = []
        self.run_steps: dict[Any, tuple[int, int]] = {}
        self.run_trained = 0
        self.clock = LineClock()

    def run(self, text: str, first_line: int = 1) -> None:
        last_line = self.feed(text, first_line)
        self.close_flops(last_line)
        self.assign_steps()
        if not self.rows:
            self.warn("empty", None, "no DeepSpeed training-log lines found (is this a DeepSpeed log?)")

    def add(self, kind: str, lineno: int, ctx: dict[str, Any], *, block: bool = True, late: bool = False,
            **fields: Any) -> None:
        row = dict.fromkeys(COLUMNS)
        row.update(kind=kind, line=lineno, **ctx)
        row.update(fields)
        self.rows.append(row)
        self.training = self.training or kind not in ("memory", "flops_profile")
        if kind not in ("memory", "flops_profile", "comms"):
            self.run_trained = lineno
        # Memory reports before the first step are set-up (model build, engine init), no step's.
        if not block or not self.training:
            self.row_block.append(None)
            return
        # Pipeline-engine lines printed just after a step closed belong to that step.
        target = self.block - 1 if late and self.block_rows == 0 and self.block > 0 else self.block
        self.row_block.append(target)
        self.block_lines.setdefault(target, lineno)
        if target == self.block:
            self.block_rows += 1

    def line(self, lineno: int, raw: str, cut: bool) -> None:
        text = raw
        if cut:
            text = _cut_last_field(raw)
            if not text.strip():
                return
            self.warn("cut", lineno, "last line is cut short; its final field was dropped")
        back = self.clock.falls_back(lineno, text)
        if back:
            self.start_run(lineno, back)
        if self.comms_op is not None and self.comms_line(lineno, text):
            return
        if _COMMS_HEADER.search(text):
            self.comms_op = ""
            return
        if self.flops is not None and self.flops_line(lineno, text):
            return
        if _FLOPS_HEADER.search(text):
            self.close_flops(lineno)
            self.flops = {"line": lineno, "fields": {}}
            return
        ctx = self.context(text)
        if "time (ms)" in text:
            self.timer_line(lineno, text, ctx)
        elif "skipped=" in text and "step=" in text:
            self.step_line(lineno, text, ctx)
        elif "SamplesPerSec=" in text:
            self.throughput_line(lineno, text, ctx)
        elif "Max_MA" in text:
            self.memory_line(lineno, text, ctx)
        elif "iter time (s):" in text:
            self.pipe_line(lineno, text, ctx)
        elif "OVERFLOW!" in text:
            m = _OVERFLOW.search(text)
            self.add("overflow", lineno, ctx, loss_scale=float(m["old"]) if m["old"] else None,
                     new_loss_scale=float(m["new"]) if m["new"] else None)
        elif "DeepSpeed info:" in text:
            m = _VERSION.search(text)
            if m and self.deepspeed_version is None:
                self.deepspeed_version = m["ver"]
            if m and self.run_trained:
                # The engine starts again: the records since the last training record (memory reports of the model
                # build) are its set-up.
                self.start_run(self.first_since(self.run_trained, lineno),
                               f"DeepSpeed starts again (its version line, line {lineno}) after training records (the "
                               f"last at line {self.run_trained})")
        if text.strip():
            self.last_message = (lineno, text)

    def context(self, text: str) -> dict[str, Any]:
        ctx: dict[str, Any] = {}
        m = _PDSH.match(text)
        if m:
            ctx["host"] = m["host"]
        m = _LOG_PREFIX.search(text)
        if m:
            ctx["timestamp"] = m["ts"]
        m = _RANK.search(text)
        if m:
            ctx["rank"] = int(m["rank"])
        return ctx

    def step_line(self, lineno: int, text: str, ctx: dict[str, Any]) -> None:
        m = _STEP.search(text)
        if not m:
            self.warn("step", lineno, "`step=` line not understood; skipped")
            return
        lrs = [float(x) for x in re.findall(_NUM, m["lr"])]
        try:
            mom = ast.literal_eval(m["mom"]) if len(m["mom"]) < 10_000 else None
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            mom = None
            self.warn("mom", lineno, f"mom={m['mom'][:60]!r} is not a Python literal; kept as None")
        if m["rank"] is not None:
            ctx = dict(ctx, rank=int(m["rank"]))  # 2020: `rank:0 step=...`
        step = int(m["step"])
        if self.block in self.block_step:
            # A second `step=` with no closing timer line between: timers are off, so the
            # `step=` lines themselves delimit the steps.
            self.block += 1
            self.block_rows = 0
        self.block_step[self.block] = step
        self.count_step(ctx.get("rank"), step, lineno, self.block_lines.get(self.block, lineno))
        self.add("step", lineno, ctx, step=step, skipped=int(m["skipped"]), lr=lrs[0] if lrs else None,
                 lr_groups=lrs, mom=mom if isinstance(mom, (list, tuple)) else None)

    def timer_line(self, lineno: int, text: str, ctx: dict[str, Any]) -> None:
        if not is_deepspeed_timer_line(text):
            return
        m = _TIMER.search(text)
        if m["rank"] is not None:
            ctx = dict(ctx, rank=int(m["rank"]))
        pairs: list[tuple[str, float]] = []
        memory: dict[str, int | None] = {}
        for field in m["body"].split("|")[1:]:
            if not field.strip():
                continue
            p = _PAIR.match(field)
            if not p:
                self.warn("timer", lineno, f"timer field {field.strip()[:60]!r} not understood; skipped")
                continue
            if p["unit"] == "GB" or p["name"] in _MEMORY_BREAKDOWN:
                if p["name"] in _MEMORY_BREAKDOWN:
                    memory[_MEMORY_BREAKDOWN[p["name"]]] = _gib(p["value"])
                continue
            pairs.append((p["name"], float(p["value"])))
        late = bool(pairs) and all(n.startswith("pipe_") for n, _ in pairs)
        for timer, value in pairs:
            self.add("timer", lineno, ctx, late=late, name=timer, time_ms=value)
        if memory:
            self.add("memory", lineno, ctx, name="timer", **memory)
        if any(n == "step" for n, _ in pairs):
            self.block += 1
            self.block_rows = 0

    def throughput_line(self, lineno: int, text: str, ctx: dict[str, Any]) -> None:
        m = _TPUT_NEW.search(text) or _TPUT_OLD.search(text)
        if not m:
            self.warn("throughput", lineno, "ThroughputTimer line not understood; skipped")
            return
        kv = {k["key"]: k["value"] for k in _KV.finditer(text, m.end())}
        avg = kv.get("RunningAvgSamplesPerSec", kv.get("SamplesPerSec"))
        fields = dict(
            epoch=int(m["epoch"]), micro_step=int(m["micro"]),
            tput_global_step=int(m["gstep"]) if "gstep" in m.groupdict() else None,
            samples_per_s_avg=_finite(float(avg)) if avg is not None else None,
            samples_per_s=_finite(float(kv["CurrSamplesPerSec"])) if "CurrSamplesPerSec" in kv else None,
            allocated_bytes=_gib(kv["MemAllocated"]) if "MemAllocated" in kv else None,
            max_allocated_bytes=_gib(kv["MaxMemAllocated"]) if "MaxMemAllocated" in kv else None)
        self.add("throughput", lineno, ctx, **fields)

    def memory_line(self, lineno: int, text: str, ctx: dict[str, Any]) -> None:
        m = _SEE_MEMORY.search(text)
        if not m:
            return
        label = None
        if self.last_message and self.last_message[0] == lineno - 1:
            # see_memory_usage prints its message on the line before; anything else there is no label.
            prev = self.last_message[1]
            p = _LOG_PREFIX.search(prev)
            if (p and p["func"] == "see_memory_usage") or (not p and "|" not in prev and "=" not in prev):
                label = (prev[p.end():] if p else prev).strip() or None
        self.add("memory", lineno, ctx, name=label, allocated_bytes=_gib(m["ma"]),
                 max_allocated_bytes=_gib(m["max_ma"]), reserved_bytes=_gib(m["ca"]),
                 max_reserved_bytes=_gib(m["max_ca"]))

    def pipe_line(self, lineno: int, text: str, ctx: dict[str, Any]) -> None:
        m = _PIPE.search(text)
        if not m:
            return
        step = int(m["step"])
        self.add("pipe_step", lineno, ctx, late=True, step=step, loss=float(m["loss"]),
                 iter_time_s=float(m["iter"]), samples_per_s=float(m["sps"]))
        self.block_step.setdefault(self.row_block[-1], step)
        self.count_step(("pipe", ctx.get("rank")), step, lineno, self.block_lines[self.row_block[-1]])

    def count_step(self, key: Any, step: int, lineno: int, first: int) -> None:
        """Note a rank's step; one that does not exceed the rank's last starts another run at `first`, the first line
        of its step."""
        last = self.run_steps.get(key)
        if last is not None and step <= last[0]:
            self.start_run(first, f"DeepSpeed's step={step} (line {lineno}) after step={last[0]} (line {last[1]})")
        self.run_steps[key] = (step, lineno)

    def first_since(self, line: int, default: int) -> int:
        """The line of the first record after `line`, or `default` when none follows it."""
        first = default
        for r in reversed(self.rows):
            if r["line"] <= line:
                break
            first = r["line"]
        return first

    def start_run(self, line: int, why: str) -> None:
        after = next((r["line"] for r in reversed(self.rows) if r["line"] < line), 0)
        self.run_starts.append(RunStart(line, after, why))
        self.run_steps = {}
        self.run_trained = 0

    def comms_line(self, lineno: int, text: str) -> bool:
        """Read one line of a comms logger summary; False (and the summary is over) for any other line."""
        # The multi-node launcher puts `host: ` in front of every line.
        body = text if _COMMS_ROW.match(text) or _COMMS_OP.match(text) else text.partition(": ")[2]
        m = _COMMS_ROW.match(body)
        if m and self.comms_op:
            total = float(m["total"])
            if not (math.isfinite(total) and total >= 0):
                self.warn("comms", lineno, f"comms logger total latency {m['total']} ms for {self.comms_op} is "
                                           "impossible (its counter overflowed); left out")
                total = None
            self.add("comms", lineno, {}, block=False, comm_op=self.comms_op,
                     message_bytes=float(m["size"]) * _COMMS_UNIT[m["unit"]], count=int(m["count"]),
                     total_latency_ms=total, avg_latency_ms=_finite(float(m["avg"])),
                     algbw_gbps=_finite(float(m["tput"])), busbw_gbps=_finite(float(m["busbw"])))
            return True
        op = _COMMS_OP.match(body)
        if op:
            self.comms_op = op["op"]
            return True
        self.comms_op = None
        return False

    def flops_line(self, lineno: int, text: str) -> bool:
        """Read one line inside a Flops Profiler block; False once the block is over."""
        flops = self.flops
        m = _FLOPS_STEP.search(text)
        if m:
            flops["step"] = int(m["step"])
            return True
        ds_record = "time (ms)" in text or "step=" in text or _LOG_PREFIX.search(text)
        if (_FLOPS_END.search(text) or ds_record or lineno - flops["line"] > _FLOPS_MAX_LINES
                or _FLOPS_HEADER.search(text)):
            self.close_flops(lineno)
            return bool(_FLOPS_END.search(text))
        label, colon, value = text.rpartition(":")
        if not colon:
            return True
        label = " ".join(label.split())
        # A pdsh `host: ` prefix stays in front of the label; try again without it.
        for candidate in (label, label.partition(": ")[2]):
            for pattern, column in _FLOPS_LABELS:
                if candidate and pattern.search(candidate):
                    self.flops_value(lineno, column, value)
                    return True
        return True

    def flops_value(self, lineno: int, column: str, value: str) -> None:
        v = _FLOPS_VALUE.match(value)
        if not v:
            self.warn("flops", lineno, f"Flops Profiler value {value.strip()[:40]!r} not understood; skipped")
            return
        number = float(v["num"]) * _PREFIX_SCALE[v["prefix"]]
        if column.endswith("_ms"):
            number *= 1000.0  # printed in seconds with an SI prefix
        self.flops["fields"][column] = int(round(number)) if column in _FLOPS_INT and math.isfinite(number) \
            else number

    def close_flops(self, lineno: int) -> None:
        flops, self.flops = self.flops, None
        if flops is None:
            return
        if not flops["fields"]:
            self.warn("flops", flops["line"], "Flops Profiler block without summary values; skipped")
            return
        self.add("flops_profile", flops["line"], {}, block=False, step=flops.get("step"), **flops["fields"])

    def assign_steps(self) -> None:
        if not self.block_step:
            # No `step=` line (steps_per_print beyond the run): the timer blocks, in order, are the only clock.
            timed = sorted({b for row, b in zip(self.rows, self.row_block) if b is not None and row["kind"] == "timer"})
            if timed:
                self.block_step = {b: i for i, b in enumerate(timed, start=1)}
                self.steps_from = "timer block order (the log has no step= lines)"
                self.warn("steps", None, f"no step= lines: the {len(timed)} timer blocks are numbered 1..{len(timed)} "
                                         "in the order they appear")
        known = sorted(self.block_step)
        for row, block in zip(self.rows, self.row_block):
            if block is None or row["step"] is not None:
                continue
            if block in self.block_step:
                row["step"] = self.block_step[block]
                continue
            before = [b for b in known if b < block]
            after = [b for b in known if b > block]
            if before:
                row["step"] = self.block_step[before[-1]] + (block - before[-1])
            elif after:
                row["step"] = self.block_step[after[0]] - (after[0] - block)
