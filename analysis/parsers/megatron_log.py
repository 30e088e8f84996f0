"""Parse a Megatron-LM (or Megatron-DeepSpeed) training log into one table, one row per record.

Records are iteration lines, timer values, memory reports and validation results; `kind` says
which, and each kind fills its own columns. The arguments dump, the world-size line, the
theoretical-memory line and the per-rank parameter counts go to `Table.meta` (MegatronLogMeta).

Formats handled (from the format strings in megatron/training/training.py, megatron/core/timers.py
and megatron/training/utils of NVIDIA/Megatron-LM 2020-2026, Megatron-DeepSpeed's training.py, and
argonne-lcf/Megatron-DeepSpeed's megatron/training_log.py):
   iteration       10/    1000 | consumed samples:  40 | elapsed time per iteration (ms): 3171.3 | ...   (2020-2023)
   [2024-04-06 02:59:36] iteration 43/ 100 | ... | throughput per GPU (TFLOP/s/GPU): 239.8 | ...      (2023+)
   iteration 1/ 317892 | ... | consumed tokens: ... | actual seqlen: 4096 | ... | TFLOPs: 38.61 |   (Megatron-DeepSpeed)
   iteration=  136004/  136100 | consumed_samples= ... | lm loss=12.3 | ... | TFLOPs=53.66 |           (ALCF key=value)
   time (ms) | forward-compute: 265.42 | backward-compute: 462.83 | ...                              (timers, -2022)
   (min, max) time across ranks (ms):  /  max time across ranks (ms):  /  times across ranks (ms):   (timers, 2022+)
       forward-backward ..........: (3198.27, 3199.53)
   [Rank 0] (after 20 iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ... | max reserved: ...
   validation loss at iteration 100 | lm loss value: 8.095942E+00 | lm loss PPL: 3.281128E+03 |
Several ranks' memory reports glued onto one line are split apart. DeepSpeed's own lines in a
Megatron-DeepSpeed log (its `time (ms)` timers among them) are left to `deepspeed_log`.

Timers are Megatron's per-iteration averages over the logging interval (`timers.log(...,
normalizer=log_interval)`); Megatron prints them right after the iteration line of the same
interval, so a timer row carries the iteration of the iteration line before it.

Where the log holds more than one run (a restarted job, runs appended to one file), `meta.run_starts` says where
each next one begins: an arguments dump or `using world size` line after iteration or validation lines, an iteration
that does not exceed the one before, another total of iterations (the M of `N/M`), a validation past that total, a
global batch size that falls (or changes where the arguments declare no ramp-up), another W&B run name, or a
timestamp that falls back (deepspeed_log.TIME_FALLBACK_S). The table itself still holds the whole file;
analysis.parsers.runs reads each run apart.
"""
from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

from analysis.parsers._text import (
    LineParser,
    has_lines,
    head_and_tail,
    line_start_pattern,
    read_source,
)
from analysis.parsers.deepspeed_log import LineClock, RunStart, is_deepspeed_timer_line
from analysis.table import Table
from launch.sense import clean, is_count

COLUMNS: dict[str, str] = {
    "kind": "record kind: 'iteration' (one training-log line), 'timer' (one timer value), 'memory' (one rank's "
            "memory report), 'validation' (one validation/test loss line)",
    "iteration": "'iteration' rows: the iteration printed; 'timer' rows: the iteration of the iteration line "
                 "before (None for set-up timers printed before training); 'memory' rows: the N of `(after N "
                 "iterations)` or `for iteration N`, else the last iteration seen; 'validation' rows: as printed",
    "train_iters": "'iteration' rows: total iterations of the run (the M of `N/M`)",
    "consumed_samples": "'iteration' rows: samples consumed so far",
    "consumed_tokens": "'iteration' rows: tokens consumed so far (Megatron-DeepSpeed)",
    "skipped_samples": "'iteration' rows: samples skipped so far (printed only when non-zero)",
    "elapsed_ms_per_iteration": "'iteration' rows: wall time per iteration in ms, averaged over the logging interval",
    "throughput_tflops_per_gpu": "'iteration' rows: model TFLOP/s per GPU as the framework computes it "
                                 "(`throughput per GPU (TFLOP/s/GPU)`; Megatron-DeepSpeed's `TFLOPs`)",
    "ds_tflops_per_gpu": "'iteration' rows: `[DS]-TFLOPs`, DeepSpeed's flops-profiler count per GPU that "
                         "Megatron-DeepSpeed forks print beside `[LM]-TFLOPs` (Megatron-LM's formula, which goes "
                         "to throughput_tflops_per_gpu)",
    "learning_rate": "'iteration' rows: learning rate",
    "global_batch_size": "'iteration' rows: global batch size in samples",
    "lm_loss": "'iteration' and 'validation' rows: the `lm loss` value (validation: `lm loss value`)",
    "losses": "'iteration' and 'validation' rows: dict of every loss printed, name as printed -> value "
              "(`lm loss`, `mtp_1 loss`, `load_balancing_loss`, `sop loss`, ...)",
    "loss_scale": "'iteration' rows: loss scale",
    "grad_norm": "'iteration' rows: gradient norm (absent while steps are skipped)",
    "num_zeros": "'iteration' rows: number of zeros in the gradient",
    "params_norm": "'iteration' rows: parameter norm",
    "skipped_iterations": "'iteration' rows: iterations skipped in the logging interval",
    "nan_iterations": "'iteration' rows: iterations with NaN loss in the logging interval",
    "seq_length": "'iteration' rows: actual sequence length (Megatron-DeepSpeed `actual seqlen`)",
    "samples_per_s": "'iteration' rows: samples per second (Megatron-DeepSpeed)",
    "tokens_per_s_per_gpu": "'iteration' rows: tokens per second per GPU (Megatron-DeepSpeed `tgs`)",
    "extra": "'iteration' and 'validation' rows: dict of every other `name: value` field, name as printed -> "
             "float (or the text when it is not a number), e.g. `energy per GPU (J/iter/GPU)`, `lm loss PPL`",
    "name": "'timer' rows: timer name (forward-backward, forward-compute, optimizer, ...); 'memory' rows: the "
            "report's label, e.g. '(after 20 iterations)'; 'validation' rows: what follows the iteration, "
            "e.g. 'on validation set'",
    "time_ms": "'timer' rows: the time in ms Megatron reports: the printing rank's own value in the old "
               "`time (ms) |` format, the max across ranks in the (min, max) and max formats, the rank's value "
               "in the all-ranks format",
    "time_min_ms": "'timer' rows: minimum across ranks in ms ((min, max) format only)",
    "time_max_ms": "'timer' rows: maximum across ranks in ms ((min, max) and max formats)",
    "rank": "'memory' rows: the `[Rank N]` that printed; 'timer' rows of the all-ranks format: the rank",
    "allocated_bytes": "'memory' rows: torch.cuda.memory_allocated() in bytes (printed in MiB)",
    "max_allocated_bytes": "'memory' rows: max_memory_allocated() in bytes",
    "reserved_bytes": "'memory' rows: memory_reserved() in bytes",
    "max_reserved_bytes": "'memory' rows: max_memory_reserved() in bytes",
    "timestamp": "'iteration' rows: the timestamp printed before `iteration` (2023+ Megatron-LM, or a logging "
                 "prefix), as printed; None otherwise",
    "line": "1-based line number of the record in the source text",
}

MIB = 1024 ** 2
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"
_ITERATION = re.compile(r"\biteration\s*[=:]?\s*(?P<it>\d+)\s*/\s*(?P<total>\d+)\s*\|")
_TIMESTAMP = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]")
# A name starts with a letter, or with a bracketed tag: Megatron-DeepSpeed's `[LM]-TFLOPs` and `[DS]-TFLOPs`.
_FIELD = re.compile(r"(?P<name>(?:\[[A-Za-z]+\]-?)?[A-Za-z_][^|:=]*?)\s*[:=]\s*(?P<value>" + _NUM + r")")
_FIELD_TEXT = re.compile(r"^\s*(?P<name>(?:\[[A-Za-z]+\]-?)?[A-Za-z_][^|:=]*?)\s*[:=]\s*(?P<value>\S.*?)\s*$")
_VALIDATION = re.compile(r"\bvalidation(?P<suffix>\S*) loss at (?P<what>[^|]*?)\s*\|")
_VALIDATION_ITERATION = re.compile(r"iteration (?P<it>\d+)")
_OLD_TIMER = re.compile(r"time \(ms\)(?P<body>(?:\s*\|[^|]*)+)")
_TIMER_PAIR = re.compile(r"^\s*(?P<name>[^:]+?)\s*:\s*(?P<value>" + _NUM + r")\s*$")
_TIMER_HEADER = re.compile(r"(?P<mode>\(min, max\) time|max time|times) across ranks \(ms\):\s*$")
_MINMAX = re.compile(r"^\s+(?P<name>\S(?:.*?\S)?) \.*: \((?P<min>" + _NUM + r"), (?P<max>" + _NUM + r")\)\s*$")
_MAXONLY = re.compile(r"^\s+(?P<name>\S(?:.*?\S)?) \.*: (?P<max>" + _NUM + r")\s*$")
_ALL_NAME = re.compile(r"^\s+(?P<name>\S[^:]*):\s*$")
_ALL_RANK = re.compile(r"^\s+rank\s+(?P<rank>\d+): (?P<value>" + _NUM + r")\s*$")
_MEMORY = re.compile(r"(?P<label>[^|\]]*?)\s*memory \(MB\)\s*(?P<body>\|.*)$")
_RANK_TAG = re.compile(r"\[Rank (?P<rank>\d+)\]")
_MEMORY_FIELDS = {"allocated": "allocated_bytes", "max allocated": "max_allocated_bytes",
                  "reserved": "reserved_bytes", "max reserved": "max_reserved_bytes"}
_MEMORY_ITERATION = re.compile(r"(?:after (?P<a>\d+) iterations|iteration (?P<b>\d+))")
_ARGS_HEADER = re.compile(r"^-{3,} (?P<title>[\w -]*arguments) -{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,} end of (?P<title>[\w -]*arguments) -{3,}\s*$")
# `  {arg} {'.' * (48 - len(arg))} {value}`: names of 48 characters or more get no dots.
_ARG = re.compile(r"^\s+(?P<key>[A-Za-z_][\w-]*) (?P<dots>\.*) ?(?P<value>.*?)\s*$")
_ARG_NO_DOTS_MIN = 47
_ARGS_MAX_STRAY = 50  # lines of other output tolerated inside a dump before calling it unterminated
_WORLD = re.compile(r"using world size: (?P<world>\d+)")
_WORLD_PART = re.compile(r"(?<![\w-])(?P<what>data|tensor-model|pipeline-model|context|expert-model)"
                         r"-parallel[ -]size: (?P<n>\d+)")
_THEORETICAL = re.compile(r"Theoretical memory footprints: weight and optimizer=(?P<wo>" + _NUM + r") MB"
                          r"(?:, activation=(?P<act>" + _NUM + r") MB, total=(?P<total>" + _NUM + r") MB)?")
_RANK_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank "
                          r"\((?P<t>\d+), (?P<p>\d+)\)\s*[:=]\s*(?P<n>\d+)")
# Lines only Megatron starts this way (behind launcher and logging prefixes): the arguments dump, the
# iteration line, a timer block header, a memory report, the world-size and tensor-parallel set-up lines.
_SNIFF = line_start_pattern(
    r"-{3,} arguments -{3,}\s*$|iteration\s*[=:]?\s*\d+\s*/\s*\d+\s*\|\s*consumed[ _]samples\s*[:=]|"
    r"(?:\(min, max\) time|max time|times) across ranks \(ms\):|\(after \d+ iterations\) memory \(MB\)|"
    r"using world size: \d+, data-parallel|> initializing tensor model parallel with size \d+")
_MAX_WARNINGS_PER_KIND = 10
# W&B names its run as it starts and ends (`wandb: Syncing run NAME`, `wandb: 🚀 View run NAME at: URL`,
# `wandb: Synced NAME: URL`), and Megatron-DeepSpeed forks print it too (ALCF's `wandb.run.name: NAME` and
# `Updating WandB run.config: [NAME](URL)`).
_WANDB_RUN = re.compile(r"wandb: (?:Syncing run|\W*View run) (?P<a>\S+?)(?: at:|\s*$)|wandb: Synced (?P<b>\S+): https?://|"
                        r"wandb\.run\.name: (?P<c>\S+)|Updating WandB run\.config: \[(?P<d>[^\]\s]+)\]")

# Iteration-line field (lower case, `_`/parentheses as spaces) -> (column, type).
_ITERATION_FIELDS: dict[str, tuple[str, type]] = {
    "consumed samples": ("consumed_samples", int),
    "consumed tokens": ("consumed_tokens", int),
    "skipped samples": ("skipped_samples", int),
    "elapsed time per iteration ms": ("elapsed_ms_per_iteration", float),
    "throughput per gpu tflop/s/gpu": ("throughput_tflops_per_gpu", float),
    "tflops": ("throughput_tflops_per_gpu", float),
    # Megatron-DeepSpeed forks print both counts: Megatron-LM's formula and DeepSpeed's flops profiler.
    "[lm] tflops": ("throughput_tflops_per_gpu", float),
    "[ds] tflops": ("ds_tflops_per_gpu", float),
    "learning rate": ("learning_rate", float),
    "global batch size": ("global_batch_size", int),
    "loss scale": ("loss_scale", float),
    "grad norm": ("grad_norm", float),
    "num zeros": ("num_zeros", float),
    "params norm": ("params_norm", float),
    "number of skipped iterations": ("skipped_iterations", int),
    "number of nan iterations": ("nan_iterations", int),
    "actual seqlen": ("seq_length", int),
    "samples per second": ("samples_per_s", float),
    "tokens per gpu per second tgs": ("tokens_per_s_per_gpu", float),
}
# Arguments-dump key -> project name (recipes, resolved config and reports use the same names).
_LAYOUT_ARGS = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "data_parallel_size": "dp",
    "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
    "virtual_pipeline_model_parallel_size": "vpp", "sequence_parallel": "sp", "zero_stage": "zero_stage",
    "micro_batch_size": "micro_batch_size", "global_batch_size": "global_batch_size", "seq_length": "seq_length",
    "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size", "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "num_experts": "num_experts", "world_size": "world_size", "train_iters": "train_iters",
    "params_dtype": "params_dtype", "recompute_granularity": "recompute_granularity",
    "use_distributed_optimizer": "use_distributed_optimizer",
}
# The layout keys that are not sizes (whole numbers): flags and words.
_LAYOUT_FLAGS, _LAYOUT_WORDS = {"sp", "use_distributed_optimizer"}, {"params_dtype", "recompute_granularity"}
_WORLD_LINE_KEYS = {"data": "dp", "tensor-model": "tp", "pipeline-model": "pp", "context": "cp", "expert-model": "ep"}


class MegatronLogMeta(NamedTuple):
    """Table.meta of a `megatron_log` table (parse_megatron_log)."""

    args: dict[str, Any]  # the arguments dump, {name: value typed (int, float, bool, None or the text)}
    layout: dict[str, Any]  # the _LAYOUT_ARGS the dump or the `using world size` line states (tp, pp, dp, ...)
    theoretical_memory_bytes: dict[str, Any] | None = None  # {weight_and_optimizer, activation, total} estimated
    rank_parameters: list[dict[str, int]] | None = None  # [{tp_rank, pp_rank, params}] as printed per rank
    run_starts: tuple[RunStart, ...] = ()  # where each run after the first begins, when the log holds several


def sniff(path: str | os.PathLike[str]) -> str | None:
    """'megatron_log' if at least two lines of the file's first or last 64 KiB start (behind launcher and
    logging prefixes) the way Megatron's own lines do, else None.

    A Megatron-DeepSpeed log sniffs as both this and `deepspeed_log`; each parser takes its own lines.
    """
    return "megatron_log" if has_lines(_SNIFF, head_and_tail(path)) else None


def parse_megatron_log(path_or_text: str | os.PathLike[str], *, source: str = "", first_line: int = 1) -> Table:
    """Parse a Megatron training log from a file path or the text itself into `megatron_log`.

    Never raises on content: unreadable lines are skipped with a warning naming the file and line,
    a last line cut off mid-record loses its final field, and an input without Megatron lines gives
    an empty table and a warning. `meta` (MegatronLogMeta): `args` (the arguments dump, values typed), `layout` (tp,
    pp, dp, cp, ep, vpp, sp, micro/global batch size, seq_length, hidden_size, num_layers, ... from
    the dump or the `using world size` line), `theoretical_memory_bytes` (weight_and_optimizer,
    activation, total, from Megatron's own estimate) and `rank_parameters` ([{tp_rank, pp_rank,
    params}] from `number of parameters on (tensor, pipeline) model parallel rank`).
    """
    text, name, warnings = read_source(path_or_text, source)
    parser = _Parser(name, warnings)
    parser.run(text, first_line)
    warnings += clean(parser.rows, name, counts=("iteration", "train_iters", "consumed_samples", "consumed_tokens",
                                                 "skipped_samples", "global_batch_size", "skipped_iterations",
                                                 "nan_iterations", "seq_length", "rank"),
                      durations_ms=("elapsed_ms_per_iteration", "time_ms", "time_min_ms", "time_max_ms"),
                      tflops=("throughput_tflops_per_gpu", "ds_tflops_per_gpu"),
                      rates_per_s=("samples_per_s", "tokens_per_s_per_gpu"), loss_scales=("loss_scale",),
                      figures=("losses", "extra", "learning_rate", "grad_norm", "params_norm", "num_zeros"))
    for row in parser.rows:  # lm_loss is losses' `lm loss`: gone when that entry was dropped (counted once, there)
        if isinstance(row.get("losses"), dict) and row.get("lm_loss") is not None:
            row["lm_loss"] = _lm_loss(row["losses"])
    return Table.from_rows("megatron_log", COLUMNS, parser.rows, source=name, warnings=warnings,
                           meta=MegatronLogMeta(args=parser.args, layout=parser.layout,
                                                theoretical_memory_bytes=parser.theoretical_memory_bytes,
                                                rank_parameters=parser.rank_parameters,
                                                run_starts=tuple(parser.run_starts)))


def _lm_loss(losses: dict[str, Any]) -> Any:
    return next((v for k, v in losses.items() if _normal(k) == "lm loss"), None)


def _typed(value: str) -> Any:
    if value in ("None", ""):
        return None
    if value in ("True", "False"):
        return value == "True"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _normal(name: str) -> str:
    """A field name as the tables know it: lower case, `_`, `-` and parentheses as spaces (`lm-loss`, `lm_loss`
    and `lm loss` are one field)."""
    return " ".join(re.sub(r"[_()\-]", " ", name).lower().split())


def _int(value: float) -> int | None:
    return int(value) if value == value and abs(value) != float("inf") and value == int(value) else None


class _RunSoFar:
    """What the current run of a log has shown, each as (value, line) of the latest: what a line of another run
    contradicts."""

    __slots__ = ("record", "iteration", "train_iters", "batch", "ramp_up", "wandb")

    def __init__(self) -> None:
        self.record: tuple[str, int] | None = None  # its last iteration or validation line, as `iteration N`
        self.iteration: tuple[int, int] | None = None
        self.train_iters: tuple[int, int] | None = None
        self.batch: tuple[int, int] | None = None  # global batch size
        self.ramp_up: bool | None = None  # whether its arguments dump sets rampup_batch_size (None: no dump read)
        self.wandb: tuple[str, int] | None = None  # W&B run name


class _Parser(LineParser):
    max_warnings_per_kind = _MAX_WARNINGS_PER_KIND

    def __init__(self, name: str, warnings: list[str]) -> None:
        super().__init__(name, warnings)
        self.rows: list[dict[str, Any]] = []
        # MegatronLogMeta's fields, filled while reading (layout by finish_meta)
        self.args: dict[str, Any] = {}
        self.layout: dict[str, Any] = {}
        self.theoretical_memory_bytes: dict[str, int | None] | None = None
        self.rank_parameters: list[dict[str, int]] = []
        self.world_sizes: dict[str, int] | None = None  # the first `using world size` line's sizes
        self.iteration: int | None = None
        self.args_open: tuple[int, str] | None = None   # (line, title) of an open arguments dump
        self.args_stray = 0
        self.timer_mode: str | None = None
        self.timer_name: str | None = None               # current name in the all-ranks format
        self.run_starts: list[RunStart] = []
        self.current = _RunSoFar()
        self.clock = LineClock()

    def run(self, text: str, first_line: int = 1) -> None:
        self.feed(text, first_line)
        if self.args_open:
            self.warn("args", self.args_open[0], "arguments dump has no end line (file cut short?); kept what "
                                                  "was read")
        self.finish_meta()
        if not self.rows:
            self.warn("empty", None, "no Megatron training-log lines found (is this a Megatron log?)")

    def add(self, kind: str, lineno: int, **fields: Any) -> None:
        row = dict.fromkeys(COLUMNS)
        row.update(kind=kind, line=lineno, **fields)
        self.rows.append(row)

    def line(self, lineno: int, raw: str, cut: bool) -> None:
        text = raw
        if cut:
            bar = raw.rfind("|")
            text = raw[:bar] if bar >= 0 else ""
            if not text.strip():
                if raw.strip():
                    self.warn("cut", lineno, "last line is cut short; ignored")
                return
            self.warn("cut", lineno, "last line is cut short; its final field was dropped")
        back = self.clock.falls_back(lineno, text)
        if back:
            self.start_run(lineno, back)
        if self.args_open is not None and self.args_line(lineno, text):
            return
        if self.timer_mode is not None and self.timer_block_line(lineno, text):
            return
        if "iteration" in text and "|" in text:
            m = _ITERATION.search(text)
            if m:
                self.iteration_line(lineno, text, m)
                return
            m = _VALIDATION.search(text)
            if m:
                self.validation_line(lineno, text, m)
                return
        if "memory (MB)" in text:
            self.memory_line(lineno, text)
        elif "time (ms)" in text:
            self.old_timer_line(lineno, text)
        elif "across ranks (ms):" in text:
            m = _TIMER_HEADER.search(text)
            if m:
                self.timer_mode = {"(min, max) time": "minmax", "max time": "max", "times": "all"}[m["mode"]]
                self.timer_name = None
        elif "arguments" in text and text.lstrip().startswith("---"):
            m = _ARGS_HEADER.match(text.strip())
            if m and not _ARGS_END.match(text.strip()):
                self.set_up(lineno, "Megatron's arguments dump")
                self.args_open = (lineno, m["title"])
                self.args_stray = 0
        elif "using world size:" in text:
            self.set_up(lineno, "Megatron's `using world size` line")
            self.world_line(text)
        elif "Theoretical memory footprints" in text:
            m = _THEORETICAL.search(text)
            if m:
                self.theoretical_memory_bytes = {
                    "weight_and_optimizer": round(float(m["wo"]) * MIB),
                    "activation": round(float(m["act"]) * MIB) if m["act"] else None,
                    "total": round(float(m["total"]) * MIB) if m["total"] else None}
        elif "model parallel rank" in text:
            m = _RANK_PARAMS.search(text)
            if m:
                self.rank_parameters.append({"tp_rank": int(m["t"]), "pp_rank": int(m["p"]),
                                             "params": int(m["n"])})
        elif "andb" in text:
            m = _WANDB_RUN.search(text)
            if m:
                self.wandb_line(lineno, next(name for name in m.groups() if name))

    def start_run(self, line: int, why: str) -> None:
        after = next((r["line"] for r in reversed(self.rows) if r["line"] < line), 0)
        self.run_starts.append(RunStart(line, after, why))
        self.current = _RunSoFar()

    def set_up(self, lineno: int, what: str) -> None:
        """A line Megatron prints once, as it starts: after iteration or validation lines, another run starts."""
        if self.current.record:
            did, at = self.current.record
            self.start_run(lineno, f"{what} (line {lineno}) after {did} (line {at})")

    def wandb_line(self, lineno: int, name: str) -> None:
        known = self.current.wandb
        if known and known[0] != name:
            self.start_run(lineno, f"W&B run {name} (line {lineno}) after W&B run {known[0]} (line {known[1]})")
        self.current.wandb = (name, lineno)

    def iteration_starts_run(self, lineno: int, iteration: int, total: int, batch: int | None) -> str | None:
        """Why an iteration line belongs to another run than the lines before it, or None."""
        run = self.current
        if run.iteration and iteration <= run.iteration[0]:
            return f"iteration {iteration} (line {lineno}) after iteration {run.iteration[0]} (line {run.iteration[1]})"
        if run.train_iters and total != run.train_iters[0]:
            return (f"iteration {iteration} of {total} (line {lineno}) after iterations of {run.train_iters[0]} "
                    f"(line {run.train_iters[1]})")
        # A run's batch changes only by ramping up, and only where its arguments allow one.
        if batch and run.batch and batch != run.batch[0] and (batch < run.batch[0] or run.ramp_up is False):
            return (f"global batch size {batch} (line {lineno}) after {run.batch[0]} (line {run.batch[1]})"
                    + ("" if batch < run.batch[0] else ", without a ramp-up in the arguments"))
        return None

    def args_line(self, lineno: int, text: str) -> bool:
        if _ARGS_END.match(text.strip()):
            self.args_open = None
            return True
        m = _ARG.match(text)
        if m and (m["dots"] or len(m["key"]) >= _ARG_NO_DOTS_MIN):
            value = _typed(m["value"])
            self.args.setdefault(m["key"], value)
            if m["key"] == "rampup_batch_size":
                self.current.ramp_up = value is not None
            return True
        self.args_stray += 1
        if self.args_stray > _ARGS_MAX_STRAY:
            self.warn("args", self.args_open[0], "arguments dump has no end line; closed it after "
                                                  f"{_ARGS_MAX_STRAY} lines of other output")
            self.args_open = None
        return False

    def fields(self, lineno: int, segments: list[str]) -> list[tuple[str, str]]:
        """(name, value) pairs of `name: value` / `name=value` segments; glued pairs are split apart."""
        out: list[tuple[str, str]] = []
        for segment in segments:
            if not segment.strip():
                continue
            found = [(f["name"].strip(), f["value"]) for f in _FIELD.finditer(segment)]
            if found:
                out.extend(found)
                continue
            t = _FIELD_TEXT.match(segment)
            if t:
                out.append((t["name"].strip(), t["value"]))
            else:
                self.warn("field", lineno, f"field {segment.strip()[:60]!r} not understood; skipped")
        return out

    def record_fields(self, lineno: int, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        row: dict[str, Any] = {"losses": {}, "extra": {}}
        for name, raw in pairs:
            key = _normal(name)
            try:
                value: Any = float(raw)
            except ValueError:
                row["extra"][name] = raw
                continue
            if key in _ITERATION_FIELDS:
                column, kind = _ITERATION_FIELDS[key]
                if kind is int:
                    value = _int(value)
                    if value is None:
                        self.warn("field", lineno, f"{name}={raw} is not a whole number; skipped")
                        continue
                row[column] = value
            elif "loss" in key and not key.startswith("loss scale") and not key.endswith("ppl"):
                row["losses"][name] = value
            else:
                row["extra"][name] = value
        row["lm_loss"] = _lm_loss(row["losses"])
        return row

    def iteration_line(self, lineno: int, text: str, m: re.Match) -> None:
        iteration = int(m["it"])
        before = text[:m.start()]
        # gpt-neox-style lines print fields before `iteration`; take only clean `name: value` ones.
        segments = [s for s in before.split("|")[:-1] if _FIELD_TEXT.match(s)]
        segments += text[m.end():].split("|")
        row = self.record_fields(lineno, self.fields(lineno, segments))
        ts = _TIMESTAMP.search(before)
        total, batch = int(m["total"]), row.get("global_batch_size")
        self.add("iteration", lineno, iteration=iteration, train_iters=total,
                 timestamp=ts["ts"] if ts else None, **row)
        self.timer_mode = None
        if not all(is_count(v) for v in (iteration, total, batch or 0)):
            # a number past sense (a damaged line) is dropped from the row later; it tells no run apart either, or
            # the next sound iteration would look like a restart
            return
        other = self.iteration_starts_run(lineno, iteration, total, batch)
        if other:
            self.start_run(lineno, other)
        self.iteration = iteration
        run = self.current
        run.record, run.iteration = (f"iteration {iteration}", lineno), (iteration, lineno)
        run.train_iters = (total, lineno)
        if batch:
            run.batch = (batch, lineno)

    def validation_line(self, lineno: int, text: str, m: re.Match) -> None:
        it = _VALIDATION_ITERATION.search(m["what"])
        rest = _VALIDATION_ITERATION.sub("", m["what"]).strip() or None
        # `lm loss value: 8.1` is the `lm loss` of the validation set.
        pairs = [(n[:-len(" value")] if n.endswith(" value") else n, v)
                 for n, v in self.fields(lineno, text[m.end():].split("|"))]
        row = self.record_fields(lineno, pairs)
        iteration = int(it["it"]) if it else self.iteration
        total = self.current.train_iters
        if it and total and is_count(iteration) and iteration > total[0]:  # a number past sense is damage, not a run
            self.start_run(lineno, f"validation at iteration {iteration} (line {lineno}), past the {total[0]} "
                                   f"iterations of the run before (line {total[1]})")
        self.add("validation", lineno, iteration=iteration,
                 name=(m["suffix"] + " " + rest).strip() if rest or m["suffix"] else None, **row)
        self.current.record = (f"validation at iteration {iteration}", lineno)

    def memory_line(self, lineno: int, text: str) -> None:
        # Ranks print at the same moment, so their reports run together on one line.
        starts = [t.start() for t in _RANK_TAG.finditer(text)] or [0]
        if starts[0] > 0 and "memory (MB)" in text[:starts[0]]:
            starts.insert(0, 0)
        for i, start in enumerate(starts):
            chunk = text[start:starts[i + 1] if i + 1 < len(starts) else len(text)]
            tag = _RANK_TAG.match(chunk)
            m = _MEMORY.search(chunk[tag.end():] if tag else chunk)
            if not m:
                continue
            values: dict[str, int] = {}
            for name, raw in self.fields(lineno, m["body"].split("|")):
                column = _MEMORY_FIELDS.get(name.lower())
                if column:
                    values[column] = round(float(raw) * MIB)
            if len(values) < len(_MEMORY_FIELDS):
                missing = sorted(set(_MEMORY_FIELDS.values()) - set(values))
                self.warn("memory", lineno, f"memory report without {missing}")
            label = m["label"].strip() or None
            it = _MEMORY_ITERATION.search(label or "")
            iteration = int(it["a"] or it["b"]) if it else self.iteration
            self.add("memory", lineno, iteration=iteration, name=label, rank=int(tag["rank"]) if tag else None,
                     **values)

    def old_timer_line(self, lineno: int, text: str) -> None:
        if is_deepspeed_timer_line(text):
            return
        m = _OLD_TIMER.search(text)
        if not m:
            return
        for field in m["body"].split("|")[1:]:
            if not field.strip():
                continue
            p = _TIMER_PAIR.match(field)
            if not p:
                self.warn("timer", lineno, f"timer field {field.strip()[:60]!r} not understood; skipped")
                continue
            self.add("timer", lineno, iteration=self.iteration, name=p["name"], time_ms=float(p["value"]))

    def timer_block_line(self, lineno: int, text: str) -> bool:
        """Read one line of a multi-line timer block; False (and the block is over) if it is not one."""
        mode = self.timer_mode
        if mode == "minmax":
            m = _MINMAX.match(text)
            if m:
                hi = float(m["max"])
                self.add("timer", lineno, iteration=self.iteration, name=m["name"], time_ms=hi,
                         time_min_ms=float(m["min"]), time_max_ms=hi)
                return True
        elif mode == "max":
            m = _MAXONLY.match(text)
            if m:
                hi = float(m["max"])
                self.add("timer", lineno, iteration=self.iteration, name=m["name"], time_ms=hi, time_max_ms=hi)
                return True
        else:
            m = _ALL_RANK.match(text)
            if m and self.timer_name is not None:
                self.add("timer", lineno, iteration=self.iteration, name=self.timer_name, rank=int(m["rank"]),
                         time_ms=float(m["value"]))
                return True
            m = _ALL_NAME.match(text)
            if m:
                self.timer_name = m["name"].strip()
                return True
        self.timer_mode = None
        return False

    def world_line(self, text: str) -> None:
        m = _WORLD.search(text)
        sizes = {"world_size": int(m["world"])} if m else {}
        sizes.update({_WORLD_LINE_KEYS[p["what"]]: int(p["n"]) for p in _WORLD_PART.finditer(text)})
        if self.world_sizes is None:
            self.world_sizes = sizes

    def finish_meta(self) -> None:
        layout: dict[str, Any] = dict(self.world_sizes or {})
        args = self.args
        for key, name in _LAYOUT_ARGS.items():
            if key in args:
                layout[name] = args[key]
        if "dp" not in layout and all(isinstance(layout.get(k), int) for k in ("world_size", "tp", "pp")):
            model_parallel = layout["tp"] * layout["pp"] * (layout.get("cp") or 1)
            if model_parallel and layout["world_size"] % model_parallel == 0:
                layout["dp"] = layout["world_size"] // model_parallel
        for key, v in layout.items():
            want = bool if key in _LAYOUT_FLAGS else str if key in _LAYOUT_WORDS else int
            if v is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
                self.warn("layout", None, f"argument {key}={str(v)[:40]!r} is not {want.__name__}; ignored")
                layout[key] = None
        self.warnings.extend(clean([layout], f"{self.name} (arguments)",
                                   counts=[k for k, v in layout.items() if isinstance(v, int)]))
        self.layout = layout
