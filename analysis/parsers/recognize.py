"""Find what a run left behind: classify every file under a path by its content, and our own files by their place.

Each file is offered to the parsers' own `sniff()` functions (metrics JSONL, DeepSpeed and Megatron
logs, nsys SQLite / `nsys stats` text, TensorBoard event files) and to the content tests kept here
for formats whose parser has none (Kineto traces, nccl-tests output, NCCL_DEBUG logs, and our own
resolved.json / plan.json / env.json). A file may have several kinds: a Megatron-DeepSpeed log is
both a DeepSpeed and a Megatron log, a training log run with NCCL_DEBUG=INFO is also an NCCL log.

A folder that holds a resolved config (by content), or a file named resolved.json beside a metrics/ folder (by the
layout of launch.run.rundir.RunDir), is one of our run directories; every file under it belongs to that run. There
the layout's own files (resolved.json, plan.json, metrics/rank{R}.jsonl) are read as what our writers put there
whatever their content, so that damage inside one is reported by its reader, with the line, instead of the file being
skipped as unrecognised. A report we wrote is told by its exact head (REPORT_HEADS) and listed as ours wherever it
lies. Recognised files outside run directories form one foreign run per path given. Files nothing recognises are
listed with the reason, never silently dropped.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from analysis.parsers import deepspeed_log, megatron_log, metrics, nsys, tensorboard
from analysis.parsers._text import (
    SNIFF_BYTES,
    has_lines,
    head_and_tail,
    line_start_pattern,
    looks_like_text,
    wide_encoding,
)
from analysis.parsers.nccl_debug import LOG_LINE_START
from launch.inputs import not_a_file
from launch.run.rundir import NOT_EVIDENCE, RunDir

KINDS: dict[str, str] = {
    "resolved": "our resolved config (resolved.json): marks its folder as a run directory",
    "plan": "our planner output (plan.json)",
    "env": "our environment record (env.json)",
    "layer_calls": "our per-rank layer call counts (logs/layer_calls_rank*.json)",
    "commbench_json": "our collective sweep result (commbench/<op>.json, the unrounded twin of <op>.txt)",
    "metrics_jsonl": "our per-rank metrics JSONL",
    "kineto_trace": "PyTorch profiler (Kineto) Chrome trace, .json or .json.gz, one per rank",
    "nsys_sqlite": "Nsight Systems SQLite export",
    "nsys_stats_csv": "`nsys stats` output (CSV or column text)",
    "nccl_tests": "nccl-tests / rccl-tests output",
    "nccl_debug": "NCCL_DEBUG=INFO log lines",
    "deepspeed_log": "DeepSpeed training log",
    "megatron_log": "Megatron-LM / Megatron-DeepSpeed training log",
    "tensorboard": "TensorBoard event file",
}

_MAX_FILES = 20000
_GZIP_MAGIC = b"\x1f\x8b"
# `traceEvents` may follow a long header (distributedInfo of a large job), hence Kineto's header keys too.
_TRACE_SIGNS = re.compile(rb'"traceEvents"\s*:|\{\s*"ph"\s*:\s*"[XBEiIMCbnesftPOND]"|'
                          rb'"(?:distributedInfo|deviceProperties)"\s*:')
# nccl-tests' column header and its units line, its banners and its footer, each where a line starts.
_NCCL_TESTS_SIGNS = line_start_pattern(
    r"#[ \t]+(?:size|bytes)[ \t]+(?:count|N)[ \t]+type\b|#[ \t]+\(B\)[ \t]+\(elements\)|# nccl-tests version|"
    r"rccl-tests: Version|#?[ \t]*Avg bus bandwidth[ \t]*:")
_RESOLVED_KEYS = {"schema_version", "recipe_name", "recipe", "model", "hardware", "grid", "ds_config"}
_PLAN_KEYS = {"recipe_name", "backend", "hardware", "grid", "ranks", "comm", "step", "notes"}
_ENV_KEYS = {"git_commit", "packages", "python"}
_COMMBENCH_KEYS = {"version", "op", "nccl_tests_op", "rows", "group_size", "bus_factor"}
_SMALL_JSON = 4 << 20

# The head every report we write begins with (analysis.report.render writes it): what marks a file as one of ours, read
# back exactly where the renderer puts it, never found by searching the text, so a user's notes that quote a report are
# not taken for one. Kept here, below the renderers, because the recognizer lists such a file as ours wherever it lies
# and `-o` replaces only such a file.
MD_HEAD = ("# layoutlab report\n"
           "<!-- written by python -m analysis report: the next report of this name replaces it -->\n")
HTML_HEAD = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             "<meta name='generator' content='python -m analysis report'>")
REPORT_HEADS = (MD_HEAD.encode(), HTML_HEAD.encode())


@dataclass(frozen=True)
class Recognized:
    path: Path
    kinds: tuple[str, ...]  # empty when skipped
    reason: str = ""  # why a file was skipped, or a note on a recognised one
    ours: bool = False  # our own file that is no evidence (rundir.NOT_EVIDENCE, a report of ours), not damage


@dataclass(frozen=True)
class RunFiles:
    """The files of one run: our run directory, or the foreign files found under one path."""

    label: str
    root: Path
    run_dir: bool
    files: tuple[Recognized, ...]
    skipped: tuple[Recognized, ...]
    warnings: tuple[str, ...] = ()

    def of(self, kind: str) -> list[Path]:
        return [f.path for f in self.files if kind in f.kinds]

    def rel(self, path: Path | str) -> str:
        """`path` relative to the run's root, as reports name files."""
        try:
            return str(Path(path).resolve().relative_to(self.root.resolve())) or "."
        except (ValueError, OSError, RuntimeError):  # outside the root, or a symlink loop that cannot resolve
            return str(path)


@dataclass(frozen=True)
class Inventory:
    root: Path
    files: tuple[Recognized, ...]
    skipped: tuple[Recognized, ...]
    run_dirs: tuple[Path, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)


# ----------------------------------------------------------------------------------- content tests

def _head(path: Path, n: int = SNIFF_BYTES) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def _decompressed_head(path: Path) -> bytes:
    """The first 64 KiB of a file's text, gunzipped when it is gzip (a cut stream gives what it holds)."""
    raw = _head(path, 1 << 20)
    if not raw.startswith(_GZIP_MAGIC):
        return raw[:SNIFF_BYTES]
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw, SNIFF_BYTES)
    except zlib.error:
        return b""


def is_our_report(path: str | os.PathLike[str]) -> bool:
    """Whether `path` begins exactly as a report we wrote (MD_HEAD or HTML_HEAD)."""
    return _head(Path(path), max(map(len, REPORT_HEADS))).startswith(REPORT_HEADS)


def sniff_kineto(path: str | os.PathLike[str]) -> str | None:
    """'kineto_trace' for a Chrome-trace JSON (plain or gzip) with `traceEvents` or trace events."""
    head = _decompressed_head(Path(path)).lstrip()
    if not head[:1] in (b"{", b"["):
        return None
    return "kineto_trace" if _TRACE_SIGNS.search(head) else None


def sniff_nccl_tests(path: str | os.PathLike[str]) -> str | None:
    """'nccl_tests' when at least two lines start with an nccl-tests / rccl-tests column header, units
    line, banner or footer."""
    return "nccl_tests" if has_lines(_NCCL_TESTS_SIGNS, head_and_tail(path)) else None


def sniff_nccl_debug(path: str | os.PathLike[str]) -> str | None:
    """'nccl_debug' when at least two lines start with NCCL's log prefix (`host:pid:tid [dev] NCCL INFO`)."""
    return "nccl_debug" if has_lines(LOG_LINE_START, head_and_tail(path)) else None


def sniff_own_json(path: str | os.PathLike[str]) -> str | None:
    """'resolved', 'plan', 'env', 'commbench_json' or 'layer_calls' for our own run-directory JSON files,
    by their keys; a damaged resolved.json or plan.json by its first keys (see _damaged_own_json)."""
    p = Path(path)
    head = _head(p, 64).lstrip()
    if not head.startswith(b"{"):
        return None
    try:
        if p.stat().st_size > _SMALL_JSON:
            return None
        d = json.loads(p.read_text(errors="replace"))
    except OSError:
        return None
    except ValueError:
        return _damaged_own_json(p)
    if not isinstance(d, dict):
        return None
    keys = set(d)
    if _RESOLVED_KEYS <= keys:
        return "resolved"
    if _PLAN_KEYS <= keys:
        return "plan"
    if _ENV_KEYS <= keys:
        return "env"
    if _COMMBENCH_KEYS <= keys:
        return "commbench_json"
    if set(d) == {"forward_calls_per_layer"}:
        return "layer_calls"
    return None


# The first two keys our writers put in resolved.json (launch.config.resolve.Resolved.to_json) and plan.json
# (launch.plan.layout.Plan.to_json).
_RESOLVED_HEAD = ("schema_version", "recipe_name")
_PLAN_HEAD = ("recipe_name", "backend")
_JSON_KEY = re.compile(rb'"([A-Za-z_]\w*)"\s*:')


def _damaged_own_json(path: Path) -> str | None:
    """'resolved' or 'plan' for one of ours that is no longer valid JSON (cut short, edited by hand),
    told by the first keys its writer puts there: classified so, the loader warns that it cannot be
    read and the folder stays a run directory, instead of both being dropped without a word."""
    first = tuple(m[1].decode() for m in itertools.islice(_JSON_KEY.finditer(_head(path, 4096)), 2))
    return {_RESOLVED_HEAD: "resolved", _PLAN_HEAD: "plan"}.get(first)


# The first exclusive kind ends the search, so the order sets the speed (and which kind a file lists first): traces
# first, as the largest files and a cheap test (a regex over 64 KB; nsys's searches 1 MB as `nsys stats` text),
# then binary formats, JSON, text logs.
_SNIFFERS: tuple[Callable[[str], str | None], ...] = (
    sniff_kineto, nsys.sniff, tensorboard.sniff, sniff_own_json, metrics.sniff,
    sniff_nccl_tests, sniff_nccl_debug, deepspeed_log.sniff, megatron_log.sniff,
)
_EXCLUSIVE = {"nsys_sqlite", "tensorboard", "kineto_trace", "resolved", "plan", "env", "layer_calls",
              "commbench_json", "metrics_jsonl"}


def classify(path: str | os.PathLike[str]) -> Recognized:
    """The kinds of one file, judged by content, or the reason none applies."""
    p = Path(path)
    problem = not_a_file(p)  # a FIFO reads as size 0, and opening it would block: say what it is
    if problem:
        return Recognized(p, (), problem)
    try:
        size = p.stat().st_size
    except OSError as exc:
        return Recognized(p, (), f"cannot read ({exc.strerror or exc})")
    if size == 0:
        return Recognized(p, (), "empty file")
    if is_our_report(p):
        return Recognized(p, (), "ours: a report written by python -m analysis report", ours=True)
    kinds: list[str] = []
    for sniff in _SNIFFERS:
        try:
            kind = sniff(os.fspath(p))
        except Exception as exc:  # a sniffer must never stop the walk; say which one failed
            return Recognized(p, (), f"could not be read while testing its format ({type(exc).__name__}: {exc})")
        if kind:
            kinds.append(kind)
            if kind in _EXCLUSIVE:
                break
    if kinds:
        return Recognized(p, tuple(kinds))
    head = _head(p, SNIFF_BYTES)
    wide = wide_encoding(head)
    if wide:
        return Recognized(p, (), f"{wide} text (a byte-order mark); every supported text format is UTF-8: convert it "
                                 f"with `iconv -f {wide} -t UTF-8`")
    if not looks_like_text(head) or head.startswith(_GZIP_MAGIC):
        return Recognized(p, (), "binary file of no supported format")
    return Recognized(p, (), "text without lines from any supported tool (DeepSpeed, Megatron, nccl-tests, "
                             "NCCL_DEBUG, nsys stats, our metrics)")


def _ours(r: Recognized, run_dirs: list[Path]) -> Recognized | None:
    """`r` as one of our own files that holds no evidence, when it sits where our run directory layout puts one."""
    for rd in run_dirs:
        if rd in r.path.parents:
            rel = r.path.relative_to(rd)
            for pattern, what in NOT_EVIDENCE.items():
                if rel.match(pattern) and len(rel.parts) == len(Path(pattern).parts):
                    return Recognized(r.path, (), f"ours: {what}", ours=True)
    return None


def _named_run_dir(folder: Path) -> bool:
    """Whether `folder` is laid out as our run directory: a resolved.json (RunDir.is_run_dir) beside the metrics/
    folder RunDir.create makes. Told by names, so that a damaged resolved.json keeps its run ours."""
    return RunDir.is_run_dir(folder) and RunDir(folder).metrics_dir.is_dir()


_DIGITS = re.compile(r"\d+")


def _layout_kind(path: Path, run_dirs: set[Path]) -> str | None:
    """The kind of file our writers put at `path`, when `path` is where launch.run.rundir.RunDir puts resolved.json,
    plan.json or a rank's metrics in one of `run_dirs`; None elsewhere."""
    if path.parent in run_dirs:
        layout = RunDir(path.parent)
        return {layout.resolved: "resolved", layout.plan: "plan"}.get(path)
    rank = _DIGITS.search(path.name)
    if path.parent.parent in run_dirs and rank and RunDir(path.parent.parent).metrics(int(rank[0])) == path:
        return "metrics_jsonl"
    return None


def recognize(path: str | os.PathLike[str]) -> Inventory:
    """Classify every file under `path` (a file or a folder, searched recursively) by content."""
    root = Path(path)
    if not root.exists():
        return Inventory(root, (), (Recognized(root, (), "does not exist"),), ())
    if not root.is_dir():  # a file, or a FIFO or device named as the input: classify says what it is
        r = classify(root)
        return Inventory(root, (r,) if r.kinds else (), () if r.kinds else (r,), ())
    found: list[Recognized] = []
    skipped: list[Recognized] = []
    warnings: list[str] = []
    run_dirs: list[Path] = []
    layouts: set[Path] = set()  # run_dirs, for the lookup of every file's place
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        here: list[Recognized] = []
        for name in sorted(filenames):
            count += 1
            if count > _MAX_FILES:
                warnings.append(f"{root}: more than {_MAX_FILES} files; the rest were not examined")
                break
            here.append(classify(d / name))
        is_run = _named_run_dir(d) or any("resolved" in r.kinds for r in here)
        if is_run:
            run_dirs.append(d)
            layouts.add(d)
        # a file of ours by its place in a run directory, unless it is no regular file (a FIFO named rank0.jsonl
        # would block its reader): classify has said what it is
        here = [Recognized(r.path, (kind,)) if (kind := _layout_kind(r.path, layouts)) and not_a_file(r.path) is None
                else r for r in here]
        for r in here:
            if not r.kinds:
                skipped.append(r if r.ours else _ours(r, run_dirs) or r)
        found.extend(r for r in here if r.kinds)
        if count > _MAX_FILES:
            break
        keep = []
        for name in sorted(dirnames):
            if name.startswith("."):
                skipped.append(Recognized(d / name, (), "hidden folder"))
            elif (d / name).is_symlink():
                skipped.append(Recognized(d / name, (), "a symlink to a folder, not followed (it can loop or lead "
                                                        "elsewhere): give its target as an input of its own"))
            elif is_run and name == "checkpoints":
                # The run directory's layout (launch/run/rundir.py) puts model state here: large, not evidence.
                skipped.append(Recognized(d / name, (), "ours: checkpoints of the run (model state)", ours=True))
            else:
                keep.append(name)
        dirnames[:] = keep
    return Inventory(root, tuple(found), tuple(skipped), tuple(run_dirs), tuple(warnings))


def group_runs(inv: Inventory, label: str | None = None) -> list[RunFiles]:
    """One RunFiles per run directory under the path, plus one for the foreign files outside them.

    Labels: the given label (suffixed with the run's folder when the path holds several runs), else
    `<recipe folder>/<stamp>` for a run directory and the folder (or file) name otherwise.
    """
    def owner(p: Path) -> Path | None:
        best = None
        for r in inv.run_dirs:
            if p == r or r in p.parents:
                if best is None or len(r.parts) > len(best.parts):
                    best = r
        return best

    by_run: dict[Path | None, list[Recognized]] = defaultdict(list)
    skipped_by: dict[Path | None, list[Recognized]] = defaultdict(list)
    for f in inv.files:
        by_run[owner(f.path)].append(f)
    for s in inv.skipped:
        skipped_by[owner(s.path)].append(s)
    root = inv.root if inv.root.is_dir() else inv.root.parent
    runs: list[RunFiles] = []
    many = len(inv.run_dirs) + (1 if by_run.get(None) else 0) > 1
    for rd in inv.run_dirs:
        default = f"{rd.parent.name}/{rd.name}" if rd.parent.name else rd.name
        lbl = (f"{label}/{rd.relative_to(root)}" if many else label) if label else default
        runs.append(RunFiles(lbl, rd, True, tuple(by_run.get(rd, ())), tuple(skipped_by.get(rd, ()))))
    foreign = by_run.get(None, [])
    loose_skipped = skipped_by.get(None, [])
    if foreign or not runs:
        name = inv.root.name if inv.root.is_dir() else inv.root.stem.split(".")[0]
        lbl = label or name or str(inv.root)
        warnings = inv.warnings
        if not foreign and not runs:
            why = (f"{loose_skipped[0].path.name}: {loose_skipped[0].reason}" if len(loose_skipped) == 1 else
                   f"{len(loose_skipped)} skipped, each with its reason" if loose_skipped else "it is empty")
            warnings += (f"{inv.root}: nothing recognised ({why}); there is nothing to report for it",)
        runs.append(RunFiles(lbl, root, False, tuple(foreign), tuple(loose_skipped), warnings))
    elif loose_skipped:
        first = runs[0]
        runs[0] = RunFiles(first.label, first.root, first.run_dir, first.files,
                           first.skipped + tuple(loose_skipped), first.warnings + inv.warnings)
    return runs
