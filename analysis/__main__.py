"""Command line of the analysis package: `python -m analysis COMMAND ...`, COMMAND one of COMMANDS (report, doctor,
recognize, busbw); `python -m analysis COMMAND --help` prints that command's usage, what it does and its options.

One reader serves every command (`read_args`): its inputs (`[LABEL=]PATH`, where the command takes labels: an
existing path is a path even with '='), its `key=value` options (launch.options.Option: launch's own option type and
value parsers, so a value is judged by the rules launch's commands use) and its flags with a value (`-o OUT`,
`--jobs N`, ...). A mistake on the command line prints one `error:` line, then the command's one usage line where
the command's shape is wrong, and exits 2; `--help` exits 0.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from launch.errors import printable
from launch.inputs import not_a_file
from launch.options import Option, choice, closest, text, whole
from launch.outputs import file_problem, folder_problem

MAX_JOBS = 4096  # --jobs: worker processes for a run's traces


class UsageError(Exception):
    """A mistake on the command line: printed as one `error:` line, with the command's usage line when the command's
    shape is wrong (not for a path that does not exist)."""

    def __init__(self, message: str, *, show_usage: bool = True):
        super().__init__(message)
        self.show_usage = show_usage


@dataclass(frozen=True)
class Flag:
    """A flag that takes a value: `--jobs N` or `--jobs=N` (a one-letter flag also as `-oOUT`). `key` names its value
    in CommandLine.flags; `needs` says what it takes when the command line ends after it; `repeat`: it may be given
    more than once (its values kept in order, as a tuple)."""

    names: tuple[str, ...]
    key: str
    metavar: str
    doc: str
    needs: str
    parse: Callable[[str], Any] = text
    repeat: bool = False


@dataclass(frozen=True)
class Command:
    """One subcommand: its usage line, what it does, and what its command line holds."""

    name: str
    usage: str  # the one usage line, without `usage: `
    about: str  # what it does: the body of its --help
    options: tuple[Option, ...] = ()  # its key=value options
    flags: tuple[Flag, ...] = ()
    labels: bool = False  # an input may be LABEL=PATH


@dataclass(frozen=True)
class CommandLine:
    """What one command line held, read (read_args)."""

    inputs: tuple[tuple[str | None, str], ...]  # (label or None, path), in order
    options: Mapping[str, Any]  # the key=value options given, parsed, by name
    flags: Mapping[str, Any]  # the flags given, parsed, by Flag.key (a repeatable flag's values as a tuple)


def _gib(value: str) -> float:
    try:
        gib = float(value)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(gib) or not 1e-3 <= gib <= 1e6:
        raise ValueError("must be a finite number from 0.001 to 1,000,000 (GiB of one device)")
    return gib


def _jobs(value: str) -> int:
    try:
        return whole(1, MAX_JOBS)(value)
    except ValueError:
        raise ValueError(f"must be a whole number from 1 to {MAX_JOBS} (worker processes; 1 reads the traces in this "
                         f"process)") from None


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("is not a number") from None


def _placement(value: str) -> str:
    from analysis.analyzers.ceilings import PLACEMENTS  # here: the sweep tables cost start-up time the others skip

    return choice(*PLACEMENTS)(value)


PATHS = ("PATH is a run directory, a folder of foreign files (DeepSpeed / Megatron logs, per-rank traces, nsys "
         "exports, nccl-tests output), or one file; files are recognised by content.")
LABELS = "A LABEL names the run in the output (default: <recipe>/<stamp> for our runs, else the folder's name)."
RUN_OPTIONS = (
    Option("ceiling", "nccl-tests output (a file, a folder or a commbench run directory) every run's bus bandwidth "
                      "is compared with (default: each run's own nccl-tests files)", text),
    Option("hardware", "a hardware profile (launch/config/catalogue/hardware) for runs without a resolved.json: the "
                       "peak FLOP/s for MFU and the device memory", text),
    Option("device_memory_gib", "GiB of one device, for the memory of runs without a plan", _gib),
)
JOBS = Flag(("--jobs",), "jobs", "N", "worker processes that read a run's trace files, one per rank (default: one "
            "per core; 1: none, the traces are read in this process)", "a number of worker processes", _jobs)
RUN_INPUTS = "[LABEL=]PATH ... [ceiling=PATH] [hardware=PROFILE] [device_memory_gib=N] [--jobs N]"
COMMANDS = {c.name: c for c in (
    Command("report", f"python -m analysis report {RUN_INPUTS} -o OUT.html|OUT.md",
            "The comparative report of the runs side by side (analysis.report), opening with its answer: the runs "
            "ranked, the fastest named, why each other one was slower; then steps, memory, where the time went, "
            "collectives, stragglers, the doctor's findings, prediction against measurement. The answer is printed "
            "here too after writing; on a terminal a progress bar over each run's ranks goes to stderr.",
            RUN_OPTIONS, (Flag(("-o", "--output"), "output", "OUT", "the report to write; the suffix picks the format "
                               "(.html: one self-contained file; .md: figures beside it in <name>_plots/); repeat "
                               "it for both", "a file name (OUT.html or OUT.md)", repeat=True), JOBS), labels=True),
    Command("doctor", f"python -m analysis doctor {RUN_INPUTS}",
            "The doctor's findings about the runs (analysis.analyzers.doctor: each a named pitfall with its evidence "
            "and fix), on stdout; nothing is written. On a terminal a progress bar over each run's ranks goes to "
            "stderr.", RUN_OPTIONS, (JOBS,), labels=True),
    Command("recognize", "python -m analysis recognize PATH ...",
            "What each file under each PATH is read as, grouped into runs, and every file skipped with the reason."),
    Command("busbw", "python -m analysis busbw RUN_DIR_OR_FILE ... -o OUT.png [--nominal GBPS] "
                     "[--placement median|out-of-place|in-place]",
            "Bus bandwidth against message size as one PNG, one panel per collective and one line per run "
            "(analysis.analyzers.ceilings.busbw_panels, analysis.report.plots.busbw_plot): a run directory "
            "contributes its built-in sweep (commbench/<op>.json) and NVIDIA nccl-tests' output "
            "(commbench/nccl-tests/<op>.txt) when present; a file may be any nccl-tests / rccl-tests text output or "
            "a commbench JSON. The dashed line is the link's nominal bus bandwidth from the first run's hardware "
            "profile.",
            flags=(Flag(("-o", "--out"), "output", "OUT.png", "the PNG to write", "a file name (OUT.png)"),
                   Flag(("--nominal",), "nominal", "GBPS", "reference bus bandwidth in GB/s (default: the first "
                        "run's hardware profile)", "a bus bandwidth in GB/s", _number),
                   Flag(("--placement",), "placement", "P", "median of both placements per size (as the report's "
                        "ceilings; the default), out-of-place or in-place", "median, out-of-place or in-place",
                        _placement))),
)}
USAGE = f"python -m analysis {{{','.join(COMMANDS)}}} ...   (COMMAND --help: its inputs and options)"


def read_args(command: Command, argv: Sequence[str]) -> CommandLine:
    """The inputs, options and flags of `command`'s command line `argv`; UsageError on a mistake."""
    known = {o.name: o for o in command.options}
    inputs: list[tuple[str | None, str]] = []
    options: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    it = iter(argv)
    for a in it:
        if a.startswith("-"):
            flag, value = _flag_of(command, a, it)
            if flag.repeat:
                flags[flag.key] = (*flags.get(flag.key, ()), value)
            elif flag.key in flags:
                raise UsageError(f"{flag.names[0]} given twice")
            else:
                flags[flag.key] = value
            continue
        key, eq, value = a.partition("=")
        if not eq or not command.labels or os.path.exists(a):
            inputs.append((None, a))
        elif key in known:
            if key in options:
                raise UsageError(f"{key}= given twice")
            options[key] = _parsed(known[key], value, f"{key}={value}")
        elif not key:
            raise UsageError(f"{a}: empty label")
        else:
            inputs.append((key, value))
    return CommandLine(tuple(inputs), options, flags)


def _flag_of(command: Command, arg: str, rest: Iterator[str]) -> tuple[Flag, Any]:
    """The flag `arg` names and its value, parsed: attached (`--jobs=2`, `-oOUT`) or the next argument."""
    name, eq, attached = arg.partition("=") if arg.startswith("--") else (arg, "", "")
    for flag in command.flags:
        short = next((n for n in flag.names if len(n) == 2 and arg.startswith(n) and len(arg) > 2), None)
        if name in flag.names or short:
            value = arg[2:] if short and name not in flag.names else attached if eq else next(rest, None)
            if value is None:
                raise UsageError(f"{arg} needs {flag.needs}")
            return flag, _parsed(flag, value, f"{flag.names[0]} {value}")
    bare = {n.lstrip("-"): n for f in command.flags for n in f.names}  # judged without the dashes every flag has
    close = bare.get(closest(name.lstrip("-"), bare) or "")
    takes = ([f"key=value ({', '.join(o.name for o in command.options)})"] if command.options else []) + [
        f"{f.names[0]} {f.metavar}" for f in command.flags]
    listed = ", ".join(takes[:-1]) + " and " + takes[-1] if len(takes) > 1 else "".join(takes)
    raise UsageError(f"unknown flag {arg}; " + (f"did you mean {close}? " if close else "")
                     + (f"options are {listed}" if takes else f"{command.name} takes no flags"))


def _parsed(option: Option | Flag, value: str, shown: str) -> Any:
    try:
        return option.parse(value)
    except ValueError as exc:
        raise UsageError(f"{shown}: {exc}") from None


def _run_options(args: CommandLine) -> dict:
    """build_report's keywords from report's and doctor's options: the ceiling found, the hardware profile read."""
    kw: dict = {}
    options = args.options
    if "ceiling" in options:
        if not Path(options["ceiling"]).exists():
            raise UsageError(f"ceiling={options['ceiling']}: no such file or folder", show_usage=False)
        problem = None if Path(options["ceiling"]).is_dir() else not_a_file(Path(options["ceiling"]))
        if problem:  # a FIFO: its read would block, and "no tables found there" would hide why
            raise UsageError(f"ceiling={options['ceiling']}: {problem}; give nccl-tests output", show_usage=False)
        kw["ceiling"] = options["ceiling"]
    if "hardware" in options:
        from launch.config.hardware import load_profile
        from launch.errors import ConfigError

        try:
            kw["hardware"] = load_profile(options["hardware"], context="command line", field="hardware")
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        kw["hardware_source"] = f"hardware={options['hardware']} (command line)"
    if "device_memory_gib" in options:
        kw["device_memory_bytes"] = int(options["device_memory_gib"] * 2**30)
    if "jobs" in args.flags:
        kw["jobs"] = args.flags["jobs"]
    return kw


@contextlib.contextmanager
def _progress_bars() -> Iterator[Callable[[str, int, int], None] | None]:
    """build_report's `progress`: a rich bar per run over its trace files on stderr (as the ranks show their steps);
    None when stderr is no terminal (a log or a pipe would fill with redraws)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console  # here: 25 ms of start-up that a pipe or a log never needs
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    # A run's label is its folder's name: shown as text (never rich markup), control characters escaped.
    bars = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TextColumn("ranks"), TimeRemainingColumn(), console=Console(file=sys.stderr),
                    # the workers reading the traces need the cores more than the bar needs redrawing
                    refresh_per_second=2)
    tasks: dict[str, TaskID] = {}

    def draw(label: str, done: int, total: int) -> None:
        if total < 2:
            return
        if label not in tasks:
            tasks[label] = bars.add_task(printable(label), total=total)
        bars.update(tasks[label], completed=done)

    with bars:
        yield draw


def _help(command: Command) -> str:
    """`python -m analysis COMMAND --help`: its usage line, what it does, its inputs and its options."""
    lines = [f"usage: {command.usage}", "", _wrap(command.about)]
    if command.name != "busbw":
        lines += ["", _wrap(PATHS + (" " + LABELS if command.labels else ""))]
    if command.options or command.flags:
        lines += ["", "options:"]
        named = [(o.name + "=", o.doc) for o in command.options] + [
            (f"{', '.join(f.names)} {f.metavar}", f.doc) for f in command.flags]
        lines += [_wrap(doc, f"  {name:<24} ", " " * 27) for name, doc in named]
    lines += ["", "Errors print one line and exit 2."]
    return "\n".join(lines)


def _wrap(paragraph: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(paragraph, width=110, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _overview() -> str:
    """`python -m analysis --help`: every command's usage line."""
    return "\n".join([f"usage: {USAGE}", "", *(f"  {c.usage}" for c in COMMANDS.values()), "",
                      _wrap(f"{PATHS} {LABELS}")])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if "-h" in argv or "--help" in argv:
        print(_help(command) if command is not None else _overview())
        return 0
    try:
        if not argv:
            raise UsageError(f"give a command: {', '.join(COMMANDS)}")
        if command is None:
            close = closest(argv[0], COMMANDS)
            raise UsageError(f"unknown command {argv[0]!r}" + (f"; did you mean {close}?" if close else ""))
        args = read_args(command, argv[1:])
        if command.name == "recognize":
            return _recognize(args)
        if command.name == "busbw":
            return _busbw(args)
        return _report(command.name, args)
    except UsageError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        if exc.show_usage:
            print(f"usage: {command.usage if command is not None else USAGE}", file=sys.stderr)
        return 2


def _report(name: str, args: CommandLine) -> int:
    """`report` (the report written to each -o) and `doctor` (the findings printed)."""
    outputs = args.flags.get("output", ())
    if not args.inputs:
        raise UsageError("give at least one PATH")
    _require_paths(p for _, p in args.inputs)
    if name == "report" and not outputs:
        raise UsageError("give -o OUT.html or -o OUT.md")
    for o in outputs:
        if Path(o).suffix.lower() not in (".html", ".htm", ".md", ".markdown"):
            raise UsageError(f"-o {o}: the suffix decides the format; use .html or .md")
    kw = _run_options(args)
    ceiling = [args.options["ceiling"]] if "ceiling" in args.options else []
    replacing = _check_outputs(outputs, [p for _, p in args.inputs] + ceiling)
    from analysis.report.data import build_report  # the renderers only when writing (doctor prints findings)

    with _progress_bars() as progress:
        rep = build_report(args.inputs, progress=progress, **kw)
    if name == "doctor":
        for f in rep.findings:
            print(printable(f"[{f.severity}] {f.run}: {f.rule}: {f.message}"))
            for ev in f.evidence:
                print(printable(f"    evidence: {ev}"))
            print(printable(f"    fix: {f.fix}"))
        if not rep.findings:
            print("no findings")
        # what could not be read is said here too: "no findings" of an input nothing was read from misleads (a FIFO
        # in a rank's metrics' place, a file no parser knows); our own files that are no evidence are not listed
        warned = [w for r in rep.runs for w in r.run.warnings] + [
            f"{p} — skipped: {why}" for r in rep.runs for p, why in r.run.skipped if not why.startswith("ours")]
        for w in warned[:5]:
            print(printable(f"warning: {w}"))
        if len(warned) > 5:
            print(f"... and {len(warned) - 5} more warning(s): `python -m analysis report` lists them all")
        return 0
    from analysis.report.render import write_report

    for path in replacing:
        print(f"replacing the earlier report {path}")
    for path in write_report(rep, outputs):
        print(f"wrote {path}")
    from analysis.report.sections import console_answer

    for line in console_answer(rep):
        print(printable(line))
    warned = sum(len(r.run.warnings) for r in rep.runs)
    if warned:
        print(f"{warned} warning(s) about partial or unreadable inputs: see the report's Warnings section")
    unused = sum(len(r.unused) for r in rep.runs)
    if unused:
        print(f"{unused} note(s) on logs not used for steps, memory or layout: see the report's Runs section")
    return 0


def _check_outputs(outputs: Sequence[str], inputs: Sequence[str]) -> list[Path]:
    """Refuse, before anything is read, every output the one writer's rules refuse (launch/outputs.py: an input or a
    place inside one, a folder, a file that is not an earlier report of ours, a Markdown report's figure folder holding
    anything but our figures, a link, a place no folder can be made) — save one exception: a report directly inside a
    run directory of ours that it reads, where users keep it (later reports list it as ours). Returns the earlier
    reports that will be replaced (said in one line each)."""
    from analysis.parsers.recognize import is_our_report

    writer = "python -m analysis report"
    seen: set[Path] = set()
    replacing: list[Path] = []
    for o in outputs:
        out = Path(o)
        where = out.resolve().parent if not out.is_symlink() else None
        guarded = [Path(p) for p in inputs if not (where == Path(p).resolve() and (Path(p) / "resolved.json").is_file())]
        problem = file_problem(out, ours=is_our_report, writer=writer, inputs=guarded)
        if not problem and out.suffix.lower() in (".md", ".markdown"):
            plots = out.with_name(out.stem + "_plots")
            problem = folder_problem(plots, ours=_only_our_figures, writer=writer, inputs=guarded)
            problem = problem and f"{plots.name} {problem}"
        if problem:
            raise UsageError(f"-o {o}: {problem}; choose another name or move it", show_usage=False)
        if out.resolve() in seen:
            raise UsageError(f"-o {o}: given twice", show_usage=False)
        seen.add(out.resolve())
        if out.exists():
            replacing.append(out.resolve())
    return replacing


def _only_our_figures(folder: Path) -> bool:
    """A Markdown report's figure folder as render_markdown fills it: figure<N>.png files only."""
    return all(f.is_file() and f.name.startswith("figure") and f.suffix == ".png" for f in folder.iterdir())


def _require_paths(paths: Iterable[str]) -> None:
    for p in paths:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such file or folder", show_usage=False)


def _recognize(args: CommandLine) -> int:
    from analysis.parsers.recognize import group_runs, recognize

    paths = [p for _, p in args.inputs]
    if not paths:
        raise UsageError("give at least one PATH")
    _require_paths(paths)
    for p in paths:
        inv = recognize(p)
        for rf in group_runs(inv):
            print(printable(f"{rf.label}  ({'run directory' if rf.run_dir else 'foreign files'}: {rf.root})"))
            for f in rf.files:
                print(printable(f"  {rf.rel(f.path)}: {', '.join(f.kinds)}"))
            for s in rf.skipped:
                print(printable(f"  {rf.rel(s.path)}: skipped ({s.reason})"))
            for w in rf.warnings:
                print(printable(f"  warning: {w}"))
    return 0


def _busbw(args: CommandLine) -> int:
    """Bus bandwidth vs message size of commbench runs and nccl-tests outputs, as one PNG."""
    inputs = [p for _, p in args.inputs]
    if not inputs:
        raise UsageError("give at least one RUN_DIR_OR_FILE")
    if "output" not in args.flags:
        raise UsageError("give -o OUT.png")
    missing = [p for p in inputs if not Path(p).exists()]
    if missing:
        raise UsageError(f"{missing[0]} does not exist; pass run directories or result files", show_usage=False)
    from analysis.analyzers.ceilings import busbw_panels
    from analysis.parsers.commbench import load
    from analysis.report.plots import busbw_plot, is_our_busbw_png

    out = Path(args.flags["output"])
    problem = ("is not a .png: busbw writes a PNG" if out.suffix.lower() != ".png" else
               file_problem(out, ours=is_our_busbw_png, writer="python -m analysis busbw", inputs=map(Path, inputs)))
    if problem:  # before anything is read: an input, a link, someone's file
        raise UsageError(f"-o {args.flags['output']}: {problem}; choose another name or move it", show_usage=False)

    tables, warnings = load(inputs)
    for w in warnings:
        print(printable(f"warning: {w}"), file=sys.stderr)
    if not any(len(t) for t in tables.values()):
        print(printable("error: no results to plot in " + ", ".join(inputs)), file=sys.stderr)
        return 2
    nominal = args.flags["nominal"] if "nominal" in args.flags else _first_nominal(inputs)
    placement = args.flags.get("placement", "median")
    out = busbw_plot(busbw_panels(tables, placement), nominal_GBps=nominal, out_png=args.flags["output"],
                     placement=placement)
    print(out)
    return 0


def _first_nominal(inputs: Sequence[str]) -> float | None:
    """analysis.parsers.commbench.nominal_from_run of the first run directory that has one; a damaged resolved.json
    is warned about."""
    from analysis.parsers.commbench import nominal_from_run
    from launch.errors import ConfigError

    for p in inputs:
        if not Path(p).is_dir():
            continue
        try:
            nominal = nominal_from_run(p)
        except (ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
            print(printable(f"warning: {p}: its resolved.json cannot be read ({exc}); no nominal busbw from it"),
                  file=sys.stderr)
            continue
        if nominal:
            return nominal
    return None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
