"""Kineto trace analysis, whole process against whole process: ours vs HolisticTraceAnalysis 0.5.0.

Each run is a fresh Python process doing the same work (each side runs --runs times per trace;
the median wall time and the largest peak memory count): load one rank's trace, then temporal
breakdown, communication/computation overlap and GPU kernel breakdown. HTA runs twice, with its
default JSON parser and with ParserBackend.IJSON_BATCH_AND_COMPRESS. Wall time is measured around
the process; peak memory is the peak RSS (VmHWM) each process reports at its end. Ratios are
against the faster HTA run; the targets are >= 20x faster and <= 1/4 of its peak memory.

Ours reads only trace_analysis.GPU_ANALYSIS_CATEGORIES, the events these analyses use (HTA's
analyses use no others either; the printed numbers show they come out the same).

Ours runs in the README's own install (the interpreter running this script, the project installed as README
says), HTA in a venv of its own, since it is not among the project's dependencies. Two rows for ours: the three
analyses as a script (the same work as HTA's side), and `python -m analysis doctor TRACE` as a user runs it (its
whole CLI, every doctor finding). The header says whether ours ran with the compiled path (the C scanner
analysis/parsers/_kscan.c, built by `pip install -e .`, and libdeflate from the deflate wheel) or a fallback.

HTA lives in its own venv, never in the project's environment:
    python -m venv /tmp/htavenv && /tmp/htavenv/bin/pip install HolisticTraceAnalysis==0.5.0 ijson

Usage (from the repository root):
    python bench/bench_trace.py [--hta-venv DIR] [--repeat 5] [--source TRACE] [TRACE ...]
The traces measured are tests/fixtures/kineto/hta_trace_diff_test.json.gz, any TRACE given, and a
trace built at run time in a temporary directory by repeating --source's steps --repeat times
(shifted in time, ProfilerStep numbers and correlation ids renumbered), about 150 MB of JSON
for the default source and 5 repeats.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "tests" / "fixtures" / "kineto" / "hta_trace_diff_test.json.gz"

# Each child reports its own peak RSS (VmHWM): ru_maxrss from wait4 would include this parent's
# peak, which Linux carries over fork and exec.
_PEAK = """
def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

_OURS = _PEAK + """
import json, sys
from analysis.parsers.kineto import parse_kineto
from analysis.analyzers import trace_analysis as ta
t = parse_kineto(sys.argv[1], categories=ta.GPU_ANALYSIS_CATEGORIES)
scopes = ta.TraceScopes(t)  # the table's scope, derived once for the four analyses (as the report does)
tb = ta.temporal_breakdown(t, scopes=scopes)
ov = ta.comm_comp_overlap(t, scopes=scopes)
kb = ta.kernel_breakdown(t, scopes=scopes)
kt = ta.kernel_type_breakdown(t, scopes=scopes)
types = {}
for r in kt.rows():
    types[r["kernel_type"]] = types.get(r["kernel_type"], 0) + r["time_us"]
print(json.dumps({
    "peak_mib": peak_mib(), "rows": len(t), "warnings": list(t.warnings)[:3],
    "temporal": [[r["rank"], r["idle_time_us"], r["compute_time_us"], r["non_compute_time_us"], r["kernel_time_us"]]
                 for r in tb.rows()],
    "overlap_pct": [[r["rank"], r["overlap_pct"]] for r in ov.rows()],
    "kernel_names": len(kb), "kernel_types": types}))
"""

# `python -m analysis doctor TRACE`, the whole CLI in this process, then its peak memory as the last line.
_DOCTOR = _PEAK + """
import contextlib, io, json, runpy, sys
sys.argv = ["analysis", "doctor", sys.argv[1]]
out = io.StringIO()
code = 0
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("analysis", run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
print(json.dumps({"peak_mib": peak_mib(), "exit": code, "lines_printed": out.getvalue().count("\\n")}))
"""

_HTA = _PEAK + """
import json, logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from hta.configs.parser_config import ParserBackend, ParserConfig
if sys.argv[2] != "json":
    cfg = ParserConfig.get_default_cfg()
    cfg.set_parser_backend(ParserBackend.IJSON_BATCH_AND_COMPRESS)
    ParserConfig.set_default_cfg(cfg)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_files={int(sys.argv[3]): sys.argv[1]})
tb = a.get_temporal_breakdown(visualize=False)
ov = a.get_comm_comp_overlap(visualize=False)
types, names = a.get_gpu_kernel_breakdown(visualize=False)
print(json.dumps({
    "peak_mib": peak_mib(),
    "temporal": [[int(r["rank"]), float(r["idle_time(us)"]), float(r["compute_time(us)"]),
                  float(r["non_compute_time(us)"]), float(r["kernel_time(us)"])] for _, r in tb.iterrows()],
    "overlap_pct": [[int(r["rank"]), float(r["comp_comm_overlap_pctg"])] for _, r in ov.iterrows()],
    "kernel_names": len(names),
    "kernel_types": {r["kernel_type"].lower(): float(r["sum"]) for _, r in types.iterrows()}}))
"""


def run_measured(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """Run one process: wall seconds around it, and its JSON answer (which holds its peak RSS)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    answer = None
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    if lines:
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            answer = None
    error = None if answer is not None else (
        (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1])
    return {"wall_s": wall, "peak_mib": answer["peak_mib"] if answer else None, "answer": answer, "error": error}


def build_repeated(source: Path, repeat: int, target: Path) -> dict:
    """Write `source`'s events `repeat` times, each copy shifted past the previous one in time
    with its ProfilerStep numbers and correlation / External id / flow ids renumbered, so the
    result reads as one longer run of the same job."""
    opener = gzip.open if source.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(source, "rb") as fh:
        doc = json.load(fh)
    events = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    t0 = min(e["ts"] for e in timed)
    span = max(e["ts"] + (e.get("dur") or 0) for e in timed) - t0
    shift = span + 1000
    steps = sorted({int(e["name"].split("#")[1]) for e in events
                    if str(e.get("name", "")).startswith("ProfilerStep#")})
    nsteps = (steps[-1] - steps[0] + 1) if steps else 0
    ids = [v for e in events for v in ((e.get("args") or {}).get("correlation"), (e.get("args") or {}).get("External id"), e.get("id"))
           if isinstance(v, int)]
    id_shift = (max(ids) + 1) if ids else 0

    def copy(e: dict, k: int) -> dict:
        if k == 0:
            return e
        e = dict(e)
        if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M":
            e["ts"] = e["ts"] + k * shift
        name = e.get("name")
        if isinstance(name, str) and name.startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{int(name.split('#')[1]) + k * nsteps}"
        if isinstance(e.get("id"), int):
            e["id"] = e["id"] + k * id_shift
        args = e.get("args")
        if isinstance(args, dict):
            args = dict(args)
            for key in ("correlation", "External id"):
                if isinstance(args.get(key), int) and args[key] > 0:
                    args[key] = args[key] + k * id_shift
            e["args"] = args
        return e

    with open(target, "w") as out:
        out.write("{\n")
        for key, value in doc.items():
            out.write(f"  {json.dumps(key)}: {json.dumps(value)},\n")
        out.write('  "traceEvents": [\n')
        first = True
        for k in range(repeat):
            for e in events:
                if k and e.get("ph") == "M":
                    continue
                out.write(("" if first else ",\n") + "  " + json.dumps(copy(e, k)))
                first = False
        out.write("\n  ]\n}\n")
    return {"rank": (doc.get("distributedInfo") or {}).get("rank", 0), "events": len(events) * repeat}


def rank_of(path: Path) -> int:
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rb") as fh:
        head = fh.read(1 << 16).decode(errors="replace")
    marker = head.find('"rank":')
    if marker < 0:
        return 0
    digits = "".join(ch for ch in head[marker + 7:marker + 20].strip() if ch.isdigit())
    return int(digits or 0)


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def fast_path(python: Path, env: dict[str, str]) -> str:
    code = ("from analysis.parsers import kineto as k, kineto_source as s; "
            "print(('C scanner' if k._kscan else 'no C scanner: msgspec') + ', '"
            " + ('libdeflate' if s._libdeflate else 'no libdeflate: zlib'))")
    out = subprocess.run([str(python), "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or f"cannot import analysis: {out.stderr.strip().splitlines()[-1:]}"


def same_numbers(ours: dict, hta: dict) -> bool:
    """The issue's tolerance: each breakdown number within 1% of the rank's total (kernel) time,
    overlap within 1 point, the same ranks."""
    if [t[0] for t in ours["temporal"]] != [t[0] for t in hta["temporal"]]:
        return False
    for a, b in zip(ours["temporal"], hta["temporal"]):
        total = b[4] or 1.0
        if any(abs(x - y) > 0.01 * total for x, y in zip(a[1:], b[1:])):
            return False
    return all(o[0] == h[0] and (o[1] is None) == (h[1] is None) and (o[1] is None or abs(o[1] - h[1]) <= 1.0)
               for o, h in zip(ours["overlap_pct"], hta["overlap_pct"]))


def run_repeated(argv: list[str], times: int, env: dict[str, str] | None = None) -> dict:
    """run_measured `times` times: the median wall time, the largest peak memory, the first answer."""
    results = [run_measured(argv, env) for _ in range(times)]
    ok = [r for r in results if r["answer"] is not None]
    if not ok:
        return results[0]
    walls = sorted(r["wall_s"] for r in ok)
    return {"wall_s": walls[len(walls) // 2], "walls": walls, "peak_mib": max(r["peak_mib"] for r in ok),
            "answer": ok[0]["answer"], "error": None}


def bench_one(path: Path, hta_python: Path | None, python: Path, env: dict[str, str], times: int) -> None:
    size = path.stat().st_size
    print(f"\n== {path.name}  ({size / 1e6:.1f} MB on disk, rank {rank_of(path)}; median of {times} runs each)",
          flush=True)
    runs: dict[str, dict] = {}
    if hta_python is not None:
        for backend in ("json", "ijson_batch_and_compress"):
            runs[f"HTA 0.5.0 {backend}"] = run_repeated(
                [str(hta_python), "-c", _HTA, str(path), backend, str(rank_of(path))], times)
            print(f"   {'HTA 0.5.0 ' + backend:<34} done in {runs[f'HTA 0.5.0 {backend}']['wall_s']:.1f} s", flush=True)
    runs["ours"] = run_repeated([str(python), "-c", _OURS, str(path)], times, env)
    runs["ours: python -m analysis doctor"] = run_repeated([str(python), "-c", _DOCTOR, str(path)], times, env)
    hta_ok = {k: v for k, v in runs.items() if k.startswith("HTA") and v["answer"] is not None}
    best = min(hta_ok.items(), key=lambda kv: kv[1]["wall_s"]) if hta_ok else None
    print(f"   {'run':<34}{'wall s':>9}{'peak MiB':>10}{'x faster':>10}{'mem frac':>10}")
    for label, r in runs.items():
        speed = mem = None
        if best is not None and r["answer"] is not None and not label.startswith("HTA"):
            speed = best[1]["wall_s"] / r["wall_s"]
            mem = r["peak_mib"] / best[1]["peak_mib"]
        note = "" if r["answer"] is not None else f"   FAILED: {r['error']}"
        print(f"   {label:<34}{r['wall_s']:>9.2f}{fmt(r['peak_mib'], '.0f'):>10}{fmt(speed, '.1f'):>10}"
              f"{fmt(mem, '.3f'):>10}{note}")
    result = None
    if best is not None:
        ours = runs["ours"]
        if ours["answer"] is not None:
            speed = best[1]["wall_s"] / ours["wall_s"]
            mem = ours["peak_mib"] / best[1]["peak_mib"]
            print(f"   vs {best[0]}: {speed:.1f}x faster (target >= 20: {'met' if speed >= 20 else 'MISSED'}), "
                  f"{mem:.3f} of its peak memory (target <= 0.25: {'met' if mem <= 0.25 else 'MISSED'})")
            result = (speed, mem, same_numbers(ours["answer"], best[1]["answer"]))
        doctor = runs["ours: python -m analysis doctor"]
        if doctor["answer"] is not None:
            print(f"   vs {best[0]}: `python -m analysis doctor` {best[1]['wall_s'] / doctor['wall_s']:.1f}x faster, "
                  f"{doctor['peak_mib'] / best[1]['peak_mib']:.3f} of its peak memory (exit {doctor['answer']['exit']})")
    print("   numbers side by side (per rank: idle, compute, non-compute, kernel time in us; overlap %)")
    for label, r in runs.items():
        a = r["answer"]
        if a is None or "temporal" not in a:
            continue
        temporal = "; ".join(f"r{t[0]}: {t[1]:.0f} {t[2]:.0f} {t[3]:.0f} {t[4]:.0f}" for t in a["temporal"])
        overlap = "; ".join(f"r{o[0]}: {fmt(o[1])}" for o in a["overlap_pct"])
        print(f"   {label:<34}{temporal} | overlap {overlap}")
    ref = best[1]["answer"] if best else None
    ours = runs["ours"]["answer"]
    if ref and ours:
        print("   kernel type time (us), HTA | ours:")
        for k in sorted(set(ref["kernel_types"]) | set(ours["kernel_types"]), key=lambda k: -ref["kernel_types"].get(k, 0)):
            print(f"     {k:<58}{fmt(ref['kernel_types'].get(k), '.0f'):>12} | {fmt(ours['kernel_types'].get(k), '.0f')}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, help="more Kineto traces (.json or .json.gz) to measure")
    ap.add_argument("--hta-venv", type=Path, default=Path(os.environ.get("HTA_VENV", "/tmp/htavenv")),
                    help="venv with HolisticTraceAnalysis==0.5.0 (and ijson); env HTA_VENV; default /tmp/htavenv")
    ap.add_argument("--source", type=Path, default=DEFAULT_TRACE, help="trace whose steps are repeated")
    ap.add_argument("--repeat", type=int, default=5, help="copies of --source in the large trace (0: none)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side per trace; the median wall time counts")
    args = ap.parse_args()
    hta_python = args.hta_venv / "bin" / "python"
    if not hta_python.exists():
        print(f"no HTA venv at {args.hta_venv} (set --hta-venv or HTA_VENV); measuring ours only")
        hta_python = None
    python = Path(sys.executable)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "analysis", "launch"], cwd=REPO, check=True,
                   capture_output=True)  # bytecode as an install has it, compiled untimed
    env = dict(os.environ)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; HTA: {hta_python or 'absent'}; "
          f"ours: {python} ({fast_path(python, env)})")
    traces = [DEFAULT_TRACE, *args.traces]
    with tempfile.TemporaryDirectory() as tmp:
        if args.repeat > 0:
            big = Path(tmp) / f"repeated{args.repeat}x_{args.source.name.split('.')[0]}.json"
            t0 = time.perf_counter()
            info = build_repeated(args.source, args.repeat, big)
            print(f"built {big.name}: {info['events']} events, {big.stat().st_size / 1e6:.0f} MB of JSON "
                  f"in {time.perf_counter() - t0:.0f} s")
            traces.append(big)
        results = {path: bench_one(path, hta_python, python, env, args.runs) for path in traces}
        if any(results.values()):
            print("\n== summary (the targets apply to the multi-MB traces and the repeated one)")
            for path, r in results.items():
                if r is None:
                    continue
                scope = "target" if path.stat().st_size >= 1e6 else "small: start-up bound, not a target"
                print(f"   {path.name:<44}{r[0]:>6.1f}x faster {r[1]:>7.3f} of the memory   breakdown and overlap "
                      f"as HTA's (1% / 1 point): {'yes' if r[2] else 'NO'}   ({scope})")

if __name__ == "__main__":
    main()
