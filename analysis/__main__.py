"""Command line of the analysis package.

  python -m analysis report [LABEL=]PATH ... [ceiling=PATH] [hardware=PROFILE] [device_memory_gib=N] [--jobs N]
                            -o OUT.html|OUT.md
  python -m analysis doctor [LABEL=]PATH ... [ceiling=PATH] [hardware=PROFILE] [device_memory_gib=N] [--jobs N]
  python -m analysis recognize PATH ...
  python -m analysis busbw RUN_DIR_OR_FILE ... -o OUT.png [--nominal GBPS] [--placement median|out-of-place|in-place]

PATH is a run directory, a folder of foreign files (DeepSpeed / Megatron logs, per-rank traces, nsys
exports, nccl-tests output), or one file; files are recognised by content. `-o` may be repeated;
its suffix picks the format. `hardware=` names a hardware profile (launch/config/catalogue/hardware) for
runs without a resolved.json: it gives the peak FLOP/s for MFU and the device memory. A run's trace
files (one per rank) are read by worker processes, one per core unless `--jobs N` caps them (1: no
workers); on a terminal a progress bar over the ranks goes to stderr. Errors print one line and exit 2.

`busbw` draws bus bandwidth against message size, one panel per collective and one line per run
(analysis.analyzers.ceilings.busbw_panels, analysis.report.plots.busbw_plot): a run directory contributes its
built-in sweep (`commbench/<op>.json`) and NVIDIA nccl-tests' output (`commbench/nccl-tests/<op>.txt`) when
present; a file may be any nccl-tests / rccl-tests text output or a commbench JSON. The dashed line is the
link's nominal bus bandwidth from the first run's hardware profile (`--nominal` overrides it).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from launch.errors import printable
from launch.outputs import file_problem, folder_problem

_KEYS = ("ceiling", "hardware", "device_memory_gib")
MAX_JOBS = 4096  # --jobs: worker processes for a run's traces
USAGE = ("usage: python -m analysis report [LABEL=]PATH ... [ceiling=PATH] [hardware=PROFILE] "
         "[device_memory_gib=N] [--jobs N] -o OUT.html|OUT.md\n"
         "       python -m analysis doctor [LABEL=]PATH ... [ceiling=PATH] [hardware=PROFILE] [device_memory_gib=N] "
         "[--jobs N]\n"
         "       python -m analysis recognize PATH ...\n"
         "       python -m analysis busbw RUN_DIR_OR_FILE ... -o OUT.png [--nominal GBPS] "
         "[--placement median|out-of-place|in-place]")


class UsageError(Exception):
    """A mistake on the command line: printed as one `error:` line, with the usage when the command's
    shape is wrong (not for a path that does not exist)."""

    def __init__(self, message: str, *, show_usage: bool = True):
        super().__init__(message)
        self.show_usage = show_usage


def parse_args(argv: Sequence[str]) -> tuple[list[tuple[str | None, str]], dict[str, str], list[str]]:
    """(inputs as (label, path), key=value options and --jobs (as "jobs"), outputs). An existing path is a path even
    with '='."""
    inputs: list[tuple[str | None, str]] = []
    options: dict[str, str] = {}
    outputs: list[str] = []
    it = iter(argv)
    for a in it:
        if a in ("-o", "--output"):
            nxt = next(it, None)
            if nxt is None:
                raise UsageError(f"{a} needs a file name (OUT.html or OUT.md)")
            outputs.append(nxt)
        elif a.startswith("-o") and len(a) > 2:
            outputs.append(a[2:])
        elif a == "--jobs" or a.startswith("--jobs="):
            value = a.partition("=")[2] if "=" in a else next(it, None)
            if value is None:
                raise UsageError("--jobs needs a number of worker processes")
            if "jobs" in options:
                raise UsageError("--jobs given twice")
            options["jobs"] = value
        elif a.startswith("-"):
            raise UsageError(f"unknown flag {a}; options are key=value ({', '.join(_KEYS)}) and --jobs N")
        elif os.path.exists(a):
            inputs.append((None, a))
        elif "=" in a:
            key, value = a.split("=", 1)
            if key in _KEYS:
                if key in options:
                    raise UsageError(f"{key}= given twice")
                options[key] = value
            elif not key:
                raise UsageError(f"{a}: empty label")
            else:
                inputs.append((key, value))
        else:
            inputs.append((None, a))
    return inputs, options, outputs


def _options(options: dict[str, str]) -> dict:
    kw: dict = {}
    if "ceiling" in options:
        if not Path(options["ceiling"]).exists():
            raise UsageError(f"ceiling={options['ceiling']}: no such file or folder", show_usage=False)
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
        try:
            gib = float(options["device_memory_gib"])
        except ValueError:
            raise UsageError(f"device_memory_gib={options['device_memory_gib']}: not a number") from None
        if not math.isfinite(gib) or not 1e-3 <= gib <= 1e6:
            raise UsageError(f"device_memory_gib={options['device_memory_gib']}: must be a finite number from 0.001 "
                             f"to 1,000,000 (GiB of one device)")
        kw["device_memory_bytes"] = int(gib * 2**30)
    if "jobs" in options:
        jobs = options["jobs"]
        if not (jobs.isascii() and jobs.isdigit()) or not 1 <= int(jobs) <= MAX_JOBS:
            raise UsageError(f"--jobs {jobs}: must be a whole number from 1 to {MAX_JOBS} (worker processes; 1 reads "
                             f"the traces in this process)")
        kw["jobs"] = int(jobs)
    return kw


def _progress_bar() -> Callable[[str, int, int], None] | None:
    """build_report's `progress`: a bar over a run's trace files on stderr, redrawn in place; None when stderr is no
    terminal (a log or a pipe would fill with redraws)."""
    if not sys.stderr.isatty():
        return None

    def draw(label: str, done: int, total: int) -> None:
        if total < 2:
            return
        width = 30
        filled = width * done // total
        end = "\n" if done == total else ""
        sys.stderr.write(printable(f"\r{label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total} ranks") + end)
        sys.stderr.flush()
    return draw


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        # The usage line of that command, then the whole description (options, inputs, formats).
        own = [line.strip().removeprefix("usage:").strip() for line in USAGE.splitlines() if f"analysis {cmd} " in line]
        print(f"usage: {own[0]}" if own else USAGE)
        print("\n\n".join(__doc__.strip().split("\n\n")[2:]))
        return 0
    try:
        if cmd == "recognize":
            return _recognize(rest)
        if cmd == "busbw":
            return _busbw(rest)
        if cmd not in ("report", "doctor"):
            raise UsageError(f"unknown command {cmd!r}")
        inputs, options, outputs = parse_args(rest)
        if not inputs:
            raise UsageError("give at least one PATH")
        _require_paths(p for _, p in inputs)
        if cmd == "report" and not outputs:
            raise UsageError("give -o OUT.html or -o OUT.md")
        for o in outputs:
            if Path(o).suffix.lower() not in (".html", ".htm", ".md", ".markdown"):
                raise UsageError(f"-o {o}: the suffix decides the format; use .html or .md")
        kw = _options(options)
        replacing = _check_outputs(outputs, [p for _, p in inputs] + ([options["ceiling"]] if "ceiling" in options
                                                                        else []))
    except UsageError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        if exc.show_usage:
            print(USAGE, file=sys.stderr)
        return 2
    from analysis.report.data import build_report  # the renderers only when writing (doctor prints findings)

    rep = build_report(inputs, progress=_progress_bar(), **kw)
    if cmd == "doctor":
        for f in rep.findings:
            print(printable(f"[{f.severity}] {f.run}: {f.rule}: {f.message}"))
            for ev in f.evidence:
                print(printable(f"    evidence: {ev}"))
            print(printable(f"    fix: {f.fix}"))
        if not rep.findings:
            print("no findings")
        return 0
    from analysis.report.render import write_report

    for path in replacing:
        print(f"replacing the earlier report {path}")
    for path in write_report(rep, outputs):
        print(f"wrote {path}")
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


def _recognize(paths: Sequence[str]) -> int:
    from analysis.parsers.recognize import group_runs, recognize

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


def _busbw(argv: Sequence[str]) -> int:
    """Bus bandwidth vs message size of commbench runs and nccl-tests outputs, as one PNG."""
    import argparse

    from analysis.analyzers.ceilings import PLACEMENTS, busbw_panels
    from analysis.parsers.commbench import load
    from analysis.report.plots import busbw_plot

    ap = argparse.ArgumentParser(prog="python -m analysis busbw",
                                 description="Bus bandwidth against message size: one panel per collective, one "
                                             "line per run.")
    ap.add_argument("inputs", nargs="+", help="run directories, commbench/<op>.json files or nccl-tests text outputs")
    ap.add_argument("-o", "--out", required=True, help="PNG to write")
    ap.add_argument("--nominal", type=float, help="reference busbw in GB/s (default: the first run's hardware profile)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="median",
                    help="median of both placements per size (as the report's ceilings), or one placement")
    args = ap.parse_args(argv)
    missing = [p for p in args.inputs if not Path(p).exists()]
    if missing:
        print(printable(f"error: {missing[0]} does not exist; pass run directories or result files"), file=sys.stderr)
        return 2
    tables, warnings = load(args.inputs)
    for w in warnings:
        print(printable(f"warning: {w}"), file=sys.stderr)
    if not any(len(t) for t in tables.values()):
        print(printable("error: no results to plot in " + ", ".join(args.inputs)), file=sys.stderr)
        return 2
    nominal = args.nominal if args.nominal is not None else _first_nominal(args.inputs)
    out = busbw_plot(busbw_panels(tables, args.placement), nominal_GBps=nominal, out_png=args.out,
                     placement=args.placement)
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
