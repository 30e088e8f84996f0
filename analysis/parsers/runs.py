"""Load what `analysis.parsers.recognize` found for one run into parsed tables (the only stage that reads files).

Nothing here analyses: a `Run` holds the parser tables, our resolved config and plan when the run is
ours, the files used and skipped, and every warning the parsers raised (truncated or corrupt inputs
give partial tables and warnings, never an exception). A foreign Megatron / DeepSpeed log that holds several
runs (a restarted job, runs appended to one file) gives one `Run` per run it holds (`load_runs`). The report passes
a reader for Kineto traces (`read_traces`, analysis.analyzers.rank_traces) that reduces each rank as it is parsed, so
that a run of many ranks is never held whole.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from analysis.parsers._text import read_source, split_lines
from analysis.parsers.deepspeed_log import parse_deepspeed_log
from analysis.parsers.kineto import parse_kineto_ranks
from analysis.parsers.megatron_log import parse_megatron_log
from analysis.parsers.metrics import parse_metrics
from analysis.parsers.nccl_debug import parse_nccl_debug
from analysis.parsers.nccl_tests import parse_nccl_tests
from analysis.parsers.nsys import parse_nsys_sqlite
from analysis.parsers.nsys_adapter import as_kineto
from analysis.parsers.nsys_stats import parse_nsys_stats_csv
from analysis.parsers.recognize import Recognized, RunFiles
from analysis.parsers.tensorboard import parse_tensorboard
from analysis.table import Table
from launch import sense


@dataclass
class Run:
    label: str
    root: Path
    run_dir: bool
    files: list[tuple[str, tuple[str, ...]]]  # (path relative to root, kinds)
    skipped: list[tuple[str, str]]  # (path, reason)
    resolved: Any = None  # launch.config.resolve.Resolved
    resolved_source: str | None = None
    plan: Any = None  # launch.plan.layout.Plan
    plan_source: str | None = None
    hardware: Any = None  # launch.config.hardware.HardwareProfile
    hardware_source: str | None = None
    metrics: Table | None = None
    megatron: list[Table] = field(default_factory=list)
    deepspeed: list[Table] = field(default_factory=list)
    tensorboard: list[Table] = field(default_factory=list)
    # Kineto-shaped: the Kineto traces as load_run's read_traces gave them (else stacked by parse_kineto_ranks), or
    # nsys exports through nsys_adapter
    trace: Any = None
    trace_from: str | None = None  # "kineto" | "nsys"
    nsys_stats: list[Table] = field(default_factory=list)
    nccl_tests: list[Table] = field(default_factory=list)
    nccl_debug: list[Table] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ours: list[tuple[str, str]] = field(default_factory=list)  # (path, what): our files that hold no evidence
    segment: str | None = None  # one of several runs of a log: its lines, and what starts them

    def rel(self, path: str | os.PathLike[str]) -> str:
        try:
            return str(Path(path).resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def relabel(self, text: str) -> str:
        """`text` with the run's root folder left out of the file names it mentions."""
        root = str(self.root.resolve())
        out = text.replace(root + os.sep, "")
        plain = str(self.root)
        if plain not in (".", ""):
            out = out.replace(plain.rstrip(os.sep) + os.sep, "")
        return out


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_sense(doc: Any) -> None:
    """Raise ValueError naming the first number of our own document (read back, perhaps damaged) that makes no
    physical sense (launch.sense.first_senseless): a plan of 1e308 bytes is no prediction."""
    found = sense.first_senseless(doc)
    if found is not None:
        where, value, why = found
        raise ValueError(f"{where}={value!r} {why}")


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _document(path: Path) -> str:
    """The text of one of our JSON documents (resolved.json, plan.json); ValueError saying what the file holds instead
    of a JSON object (empty, not UTF-8, not JSON, an array), which their own readers would report as a stray
    KeyError or AttributeError."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise ValueError("an empty file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise ValueError("nested deeper than JSON can be read here") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{_JSON_TYPES.get(type(doc), type(doc).__name__)}, not a JSON object")
    return text


def _why(exc: Exception) -> str:
    """Why one of our documents cannot be read, for a warning that names the file already."""
    from launch.errors import ConfigError

    if isinstance(exc, ConfigError):
        return f"{exc.field}={exc.value!r} {exc.problem}"
    if isinstance(exc, KeyError):
        return f"its field {exc.args[0]!r} is missing"
    return str(exc)


def _whole(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < sense.COUNT_LIMIT


def _recorded_machine(env_files: list) -> Any:
    """The machine (launch.config.calibration.Machine) the run's env.json recorded, or None."""
    from launch.run.envinfo import recorded_machine

    for p in env_files[:1]:
        try:
            env = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return recorded_machine(env) if isinstance(env, dict) else None
    return None


_LOG_PARSERS: dict[str, Callable[..., Table]] = {"megatron_log": parse_megatron_log,
                                                 "deepspeed_log": parse_deepspeed_log}
LogTables = Mapping[Path, Mapping[str, Table]]  # each Megatron / DeepSpeed log's table per kind


class _LogRun(NamedTuple):
    """One run of a log that holds several."""

    first: int  # its first line
    last: int | None  # its last line; None: to the end of the file
    why: str  # what starts it ('' for the file's first run)
    kinds: tuple[str, ...]  # the parsers that read records in it


ReadTraces = Callable[["Run", list[Path]], Any]


def load_runs(rf: RunFiles, *, hardware: Any = None, hardware_source: str = "",
              read_traces: ReadTraces | None = None) -> list[Run]:
    """Every run `rf` holds: one (load_run), unless a foreign Megatron / DeepSpeed log among its files holds several
    (its parsers' `meta.run_starts`). Each run of such a log is then read from its own lines into a run of its own,
    labelled `<label>#1`, `#2`, ... in file order (`<label>/<file>#1`, ... when other files remain: those stay one
    run). `hardware` (a HardwareProfile) stands in for runs without a resolved.json of their own; `read_traces`: see
    load_run."""
    logs = {f.path: {k: _LOG_PARSERS[k](f.path, source=rf.rel(f.path)) for k in f.kinds if k in _LOG_PARSERS}
            for f in rf.files if set(f.kinds) & _LOG_PARSERS.keys()}
    # Our run directory is one run by its layout; a resumed run of ours writes a new directory.
    split = {} if rf.run_dir else {p: found for p, tables in logs.items() if len(found := _runs_in(tables)) > 1}
    if not split:
        return [load_run(rf, logs, hardware=hardware, hardware_source=hardware_source, read_traces=read_traces)]
    rest = tuple(f for f in rf.files if f.path not in split)
    runs = [load_run(replace(rf, files=rest), logs, hardware=hardware, hardware_source=hardware_source,
                     read_traces=read_traces)] if rest else []
    for f in rf.files:
        if f.path in split:
            label = f"{rf.label}/{rf.rel(f.path)}" if rest or len(split) > 1 else rf.label
            runs += _read_apart(rf, f, label, split[f.path], first=not runs, hardware=hardware,
                                hardware_source=hardware_source)
    return runs


@dataclass
class _Start:
    """Where one run of a log starts, as its parsers' run starts merged: the first line, the last line a parser told
    it at, and the parsers' reasons."""

    first: int
    told: int
    reasons: list[str]


def _runs_in(tables: Mapping[str, Table]) -> list[_LogRun]:
    """The runs one log holds, by its parsers' run starts. Each parser reads only its own lines, so two starts whose
    ranges (after, line] overlap are one run's (a Megatron-DeepSpeed run's `step=1` before its `iteration 1`): it
    starts at the earlier line. A stretch without a record of either parser is no run."""
    merged: list[_Start] = []
    for s in sorted((s for t in tables.values() for s in t.meta.run_starts), key=lambda s: s.line):
        if merged and s.after < merged[-1].told:
            merged[-1].told = s.line
            merged[-1].reasons += [s.why] if s.why not in merged[-1].reasons else []
        else:
            merged.append(_Start(s.line, s.line, [s.why]))
    records = {kind: sorted(t.columns["line"]) for kind, t in tables.items()}
    starts = [(1, "")] + [(m.first, "; ".join(m.reasons)) for m in merged]
    out = []
    for (first, why), (end, _) in zip(starts, starts[1:] + [(None, "")]):
        last = end - 1 if end is not None else None
        kinds = tuple(kind for kind, lines in records.items() if _any_within(lines, first, last))
        if kinds:
            out.append(_LogRun(first, last, why, kinds))
    return out


def _any_within(lines: list[int], first: int, last: int | None) -> bool:
    """Whether sorted `lines` hold one in [first, last] (None: to the end)."""
    at = bisect.bisect_left(lines, first)
    return at < len(lines) and (last is None or lines[at] <= last)


def _read_apart(rf: RunFiles, f: Recognized, label: str, found: list[_LogRun], *, first: bool, hardware: Any,
                hardware_source: str) -> list[Run]:
    """One run per run of the log `f`, each parsed from its own lines alone (its own arguments, set-up, steps and
    timers), records numbered as in the file. `first`: these are `rf`'s first runs, which list its skipped files and
    carry its warnings."""
    name = rf.rel(f.path)
    text, _, read_warnings = read_source(f.path, name)
    lines, cut = split_lines(text)
    runs = []
    for k, piece in enumerate(found, start=1):
        last = piece.last or len(lines)
        # Numbered from its first line, so that each record keeps its line number in the file; a last line the file
        # cut short stays cut.
        own = "".join(line + "\n" for line in lines[piece.first - 1:last])
        if cut and last == len(lines):
            own = own[:-1]
        # Only the parsers with records here: a run without Megatron lines is no Megatron log to warn about.
        logs = {f.path: {kind: _LOG_PARSERS[kind](own, source=name, first_line=piece.first) for kind in piece.kinds}}
        holds = first and k == 1
        # the file's own read warnings (NULs dropped, an encoding) once, with its first run, not once per run
        said = (tuple(read_warnings) if k == 1 else ())
        part = RunFiles(f"{label}#{k}", rf.root, False, (replace(f, kinds=piece.kinds),),
                        rf.skipped if holds else (), (rf.warnings if holds else ()) + said)
        run = load_run(part, logs, hardware=hardware, hardware_source=hardware_source)
        run.segment = (f"lines {piece.first}–{last} of {name}: "
                       + (f"a new run, as {piece.why}" if piece.why else "the file's first run"))
        runs.append(run)
    return runs


def load_run(rf: RunFiles, logs: LogTables, *, hardware: Any = None, hardware_source: str = "",
             read_traces: ReadTraces | None = None) -> Run:
    """Read every recognised file of one run, its Megatron / DeepSpeed logs already parsed (`logs`). `hardware` (a
    HardwareProfile) stands in for runs without a resolved.json of their own. `read_traces(run, files)` reads the
    run's Kineto traces (called once its other files are read) into an object with a trace table's name, source,
    warnings (names relabelled), meta (a KinetoRanksMeta, sources relative) and len; without it they are stacked into
    one table (parse_kineto_ranks)."""
    run = Run(rf.label, rf.root, rf.run_dir, [(rf.rel(f.path), f.kinds) for f in rf.files],
              [(rf.rel(s.path), s.reason) for s in rf.skipped if not s.ours], warnings=list(rf.warnings),
              ours=[(rf.rel(s.path), s.reason.removeprefix("ours: ")) for s in rf.skipped if s.ours])
    _read_resolved(run, rf)
    if run.hardware is None and hardware is not None:
        run.hardware, run.hardware_source = hardware, hardware_source
    _read_plan(run, rf)
    metrics = rf.of("metrics_jsonl")
    if metrics:
        run.metrics = parse_metrics(metrics, relative_to=rf.root)
    for kind, into in (("megatron_log", run.megatron), ("deepspeed_log", run.deepspeed)):
        for p in rf.of(kind):
            t = logs[p][kind]
            if len(t):
                into.append(t)
            else:
                run.warnings.extend(t.warnings)
    for p in rf.of("tensorboard"):
        run.tensorboard.append(parse_tensorboard(p, source=rf.rel(p)))
    _read_trace(run, rf, read_traces)
    for p in rf.of("nsys_stats_csv"):
        run.nsys_stats.append(parse_nsys_stats_csv(p, source=rf.rel(p)))
    _read_comm(run, rf)
    for t in [run.metrics, *run.megatron, *run.deepspeed, *run.tensorboard, *run.nsys_stats, *run.nccl_tests,
              *run.nccl_debug]:
        if t is not None:
            run.warnings.extend(run.relabel(w) for w in t.warnings)
    if run.trace is not None and run.trace_from == "kineto":
        run.warnings.extend(run.trace.warnings)
    elif run.trace is not None:
        run.warnings.extend(run.relabel(w) for w in run.trace.warnings)
    _check_grid(run, hardware, hardware_source)
    return run


def _read_resolved(run: Run, rf: RunFiles) -> None:
    """The run's resolved.json, with its hardware, into `run`; a warning instead where it cannot be believed."""
    rel = rf.rel
    for p in rf.of("resolved")[:1]:
        from launch.config.resolve import Resolved
        from launch.errors import ConfigError

        try:
            resolved = Resolved.from_json(_document(p), source=rel(p))
            _check_sense(json.loads(resolved.to_json()))
            bad = [k for k, v in vars(resolved.grid).items() if not _whole(v, low=1)]
            if bad:
                raise ValueError(f"grid.{bad[0]}={getattr(resolved.grid, bad[0])!r} is not a positive whole number")
            run.resolved = resolved
            run.resolved_source = rel(p)
            run.hardware, run.hardware_source = run.resolved.hardware, f"{rel(p)} hardware.{run.resolved.hardware.name}"
        except (ConfigError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            run.warnings.append(f"{rel(p)}: cannot be read as a resolved config ({_why(exc)}); the layout comes from "
                                f"the metrics' meta record and the plan only from a readable plan.json")


def _read_plan(run: Run, rf: RunFiles) -> None:
    """The run's plan.json into `run`, else a plan recomputed from its resolved config (read first); a warning says
    why plan.json cannot be read once it is known what stands in for it."""
    rel = rf.rel
    plans = rf.of("plan")
    unread_plan = None
    if plans:
        from launch.plan.layout import Plan

        try:
            text = _document(plans[0])
            plan = Plan.from_json(text)
            _check_sense(json.loads(text))
            bad = [f.name for f in fields(plan.step) if f.type in ("float", "int")
                   and not _real(getattr(plan.step, f.name))]
            if bad:
                raise ValueError(f"step.{bad[0]}={getattr(plan.step, bad[0])!r} is not a finite number")
            run.plan = plan
            run.plan_source = rel(plans[0])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            unread_plan = _why(exc)
    if run.plan is None and run.resolved is not None:
        from launch.plan.build import plan_resolved

        try:
            # The machine the run recorded, never the one rendering the report: a recomputed plan depends only
            # on the run's own files.
            machine = _recorded_machine(rf.of("env"))
            run.plan = plan_resolved(run.resolved, machine)
            _check_sense(json.loads(run.plan.to_json()))
            run.plan_source = (f"recomputed from {run.resolved_source} (launch.plan.build.plan_resolved; no readable "
                               f"plan.json)")
        except (ArithmeticError, ValueError, KeyError, TypeError, AttributeError) as exc:
            run.plan = None
            run.warnings.append(f"{run.resolved_source}: no plan can be computed from it ({type(exc).__name__}: {exc})")
    if unread_plan:
        instead = (f"the plan is recomputed from {run.resolved_source}" if run.plan is not None
                   else "the run has no plan to compare with")
        run.warnings.append(f"{rel(plans[0])}: cannot be read as a plan ({unread_plan}); {instead}")


def _read_trace(run: Run, rf: RunFiles, read_traces: ReadTraces | None) -> None:
    """The run's Kineto traces (through `read_traces`, see load_run), else its nsys exports, into `run.trace`."""
    rel = rf.rel
    traces = rf.of("kineto_trace")
    if traces and read_traces is not None:
        run.trace, run.trace_from = read_traces(run, traces), "kineto"
    elif traces:
        t = parse_kineto_ranks(traces)
        ranks = {r: m._replace(source=rel(m.source or "")) for r, m in t.meta.ranks.items()}
        run.trace = Table(t.name, t.columns, t.doc, ", ".join(rel(p) for p in traces),
                          tuple(run.relabel(w) for w in t.warnings), t.meta._replace(ranks=ranks))
        run.trace_from = "kineto"
    sqlite = rf.of("nsys_sqlite")
    if sqlite:
        tables = [parse_nsys_sqlite(p, source=rel(p)) for p in sqlite]
        if run.trace is None:
            run.trace, run.trace_from = as_kineto(tables), "nsys"
        else:
            run.warnings.append(f"{', '.join(rel(p) for p in sqlite)}: nsys exports beside Kineto traces; the time "
                                f"breakdown uses the Kineto traces")


def _read_comm(run: Run, rf: RunFiles) -> None:
    """The run's nccl-tests outputs (else its commbench results) and NCCL_DEBUG logs into `run`."""
    rel = rf.rel
    for p in rf.of("nccl_tests"):
        t = parse_nccl_tests(p, source=rel(p))
        if len(t):
            run.nccl_tests.append(t)
        else:
            run.warnings.extend(t.warnings)
    if not run.nccl_tests and rf.of("commbench_json"):
        # Only when no nccl-tests text is there: commbench writes every result twice (text and JSON). Imported
        # here: the commbench schema costs a run without commbench results (doctor on a trace) 50 ms.
        from analysis.parsers.commbench import commbench_table
        from launch.comm.commbench_spec import read_result

        for p in rf.of("commbench_json"):
            try:
                t = commbench_table(read_result(p))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                run.warnings.append(f"{rel(p)}: cannot be read as a commbench result ({exc})")
                continue
            run.nccl_tests.append(Table(t.name, t.columns, t.doc, rel(p), t.warnings, t.meta))
    for p in rf.of("nccl_debug"):
        run.nccl_debug.append(parse_nccl_debug(p, source=rel(p)))


def _check_grid(run: Run, hardware: Any, hardware_source: str) -> None:
    """resolved.json records the layout that ran; where the run's own files say otherwise (the ranks the traces
    record, the metrics' meta record) it was edited or belongs to another run. Its layout is then not believed (the
    collectives it would expect, a plan recomputed from it, its hardware profile: `hardware` stands in, as for a
    run without one): a warning says which file says what."""
    if run.resolved is None:
        return
    g, par = run.resolved.grid, run.resolved.recipe.parallel
    said = {}
    if (par.tp, par.pp) != (g.tp, g.pp):
        said["its own recipe.parallel"] = f"tp={par.tp}, pp={par.pp}"
    if run.trace is not None and run.trace.meta.world_size not in (None, g.world):
        said["the traces' distributedInfo"] = f"world_size {run.trace.meta.world_size}"
    m = run.metrics.meta if run.metrics is not None else None
    stated = {"world_size": m.world_size, "tp": m.tp, "pp": m.pp, "dp": m.dp} if m is not None else {}
    theirs = {k: v for k, v in stated.items() if v is not None}
    ours = {"world_size": g.world, "tp": g.tp, "pp": g.pp, "dp": g.dp}
    if any(theirs[k] != ours[k] for k in theirs):
        said[f"the metrics' meta record ({m.files[0] if m is not None and m.files else 'metrics'})"] = ", ".join(
            f"{k}={v}" for k, v in theirs.items())
    if not said:
        return
    run.warnings.append(
        f"{run.resolved_source}: grid tp×pp×dp = {g.tp}×{g.pp}×{g.dp} = {g.world} ranks, but "
        + "; ".join(f"{who} says {what}" for who, what in said.items())
        + ": its layout is not believed (no expected collectives or plan from it); restore the run's own "
          "resolved.json or leave it out")
    if run.plan is not None and run.plan_source and run.plan_source.startswith("recomputed from"):
        run.plan, run.plan_source = None, None
    run.hardware, run.hardware_source = (hardware, hardware_source) if hardware is not None else (None, None)
    run.resolved = run.resolved_source = None
