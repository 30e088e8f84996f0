"""The report at cluster scale: `python -m analysis report` over N ranks' Kineto traces, time and peak memory.

Each N-rank input is built from one real trace (default tests/fixtures/kineto/hta_trace_diff_test.json.gz, HTA's
V100 test trace, 33 MB of JSON): N copies in a temporary folder, each with its `distributedInfo` rank (and world
size) rewritten, deleted afterwards. A copy is one gzip member, as the profiler writes it: the rewritten header's deflate
blocks (flushed to a byte boundary) followed by the trace body's, compressed once, with the CRC of the whole; building
256 ranks costs one compression, not 256.

For each N the whole command runs as a user runs it, once with `--jobs 1` (serial) and once with `--jobs J` (every
core by default), each a fresh process; wall time is taken around it and peak memory is the `ru_maxrss` that wait4
reports for it, which covers the report process and the worker processes it reaped, the largest of them (this script
stays small, since Linux carries a parent's peak over fork and exec, and the inputs are built in a child process); and
the peak PSS of the whole process tree, sampled every 50 ms, which counts the workers running at once. Printed per N: wall
and CPU time (the CPU time of the processes, workers included: what other work on the machine cannot change), peak
RSS, ranks per second, the serial / parallel ratio; then the targets: peak RSS at the largest N <= 1.5x that at
the smallest, speed-up >= 1.7 on 2 cores, throughput at the largest N within 20% of the smallest. HolisticTraceAnalysis
0.5.0 (its own venv, as bench_trace.py sets it up) loads the smallest set and runs the same three analyses as
bench_trace.py (temporal breakdown, communication/computation overlap, kernel breakdown), for scale.

Usage (from the repository root):
    python bench/bench_scale.py [--ranks 8,64,256] [--jobs J] [--runs 1] [--source TRACE] [--hta-venv DIR]
                                [--out bench/results/bench_scale.txt]
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "tests" / "fixtures" / "kineto" / "hta_trace_diff_test.json.gz"
DEFAULT_OUT = REPO / "bench" / "results" / "bench_scale.txt"
_DIST_INFO = re.compile(rb'"distributedInfo"\s*:\s*')
_HEAD_BYTES = 1 << 16  # distributedInfo is written before the events

_HTA = """
import logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
a.get_temporal_breakdown(visualize=False)
a.get_comm_comp_overlap(visualize=False)
a.get_gpu_kernel_breakdown(visualize=False)
"""


def build_ranks(source: Path, ranks: int, folder: Path) -> None:
    """`ranks` copies of `source` in `folder` as rank-<i>.json.gz, each stating its rank and the world size."""
    opener = gzip.open if source.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(source, "rb") as fh:
        text = fh.read()
    found = _DIST_INFO.search(text, 0, _HEAD_BYTES)
    if found is None:  # no distributedInfo: one is added after the opening brace
        cut, info, suffix = text.index(b"{") + 1, {}, b", "
    else:  # the rewritten one takes its place; its object may nest (torch writes pg_config as a list of objects)
        # latin-1: one character per byte, so the decoder's end is a byte offset
        info, end = json.JSONDecoder().raw_decode(text[found.end():found.end() + _HEAD_BYTES].decode("latin-1"))
        cut, suffix = found.start(), b""
        text = text[:found.start()] + text[found.end() + end:]
    head, body = text[:cut], text[cut:]
    # A raw deflate stream of the body, ending in the final block; it refers to nothing before it, so it may follow
    # any blocks that end on a byte boundary (a sync flush, which is not final).
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    body_blocks = packer.compress(body) + packer.flush()
    gzip_header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no time, unknown OS
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        stated = head + b'"distributedInfo": ' + json.dumps({**info, "rank": rank, "world_size": ranks}).encode() + suffix
        packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
        head_blocks = packer.compress(stated) + packer.flush(zlib.Z_SYNC_FLUSH)
        crc = zlib.crc32(body, zlib.crc32(stated))
        trailer = crc.to_bytes(4, "little") + ((len(stated) + len(body)) & 0xFFFFFFFF).to_bytes(4, "little")
        (folder / f"rank-{rank}.json.gz").write_bytes(gzip_header + head_blocks + body_blocks + trailer)


def tree_pss_kib(pid: int) -> int:
    """The proportional set size (shared pages split between their processes) of `pid` and its descendants, KiB: the
    memory the whole process tree holds."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith("Pss:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:  # the process ended meanwhile
            continue
    return total


def measured(argv: list[str], *, sample: bool = False) -> dict:
    """Run one command: wall seconds around it, its CPU seconds and peak RSS (MiB, the largest of its processes) from
    wait4, its exit status and last line; with `sample`, the peak of its process tree's PSS sampled every 50 ms (the
    sampling takes CPU from the command: its times are not reported)."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        tree = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if sample:
                tree = max(tree, tree_pss_kib(proc.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        out.seek(0)
        lines = out.read().decode(errors="replace").strip().splitlines()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024,
            "tree_mib": tree / 1024, "rc": proc.returncode, "last": lines[-1] if lines else ""}


def median_of(argv: list[str], runs: int, *, tree: bool = False) -> dict:
    """`runs` runs of measured: the median wall time's, the largest peak RSS; with `tree`, one more run samples the
    process tree's PSS."""
    results = [measured(argv) for _ in range(runs)]
    failed = [r for r in results if r["rc"] != 0]
    if failed:
        return failed[0]
    median = sorted(results, key=lambda r: r["wall_s"])[len(results) // 2]
    return {**median, "peak_mib": max(r["peak_mib"] for r in results),
            "tree_mib": measured(argv, sample=True)["tree_mib"] if tree else None}


def report(folder: Path, out: Path, jobs: int) -> list[str]:
    return [sys.executable, "-m", "analysis", "report", str(folder), "-o", str(out), "--jobs", str(jobs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,64,256", help="comma-separated rank counts (default 8,64,256)")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="--jobs of the parallel run (default: this machine's cores)")
    ap.add_argument("--runs", type=int, default=1, help="runs per measurement; the median wall time counts")
    ap.add_argument("--source", type=Path, default=DEFAULT_TRACE, help="the trace copied as every rank")
    ap.add_argument("--hta-venv", type=Path, default=Path(os.environ.get("HTA_VENV", "/tmp/htavenv")))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the dated result is written")
    ap.add_argument("--build", nargs=2, metavar=("FOLDER", "N"), help=argparse.SUPPRESS)  # the builder child
    args = ap.parse_args(argv)
    if args.build:
        build_ranks(args.source, int(args.build[1]), Path(args.build[0]))
        return 0
    counts = sorted({int(n) for n in args.ranks.split(",")})
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    say(f"bench_scale.py, {stamp}: python -m analysis report over N copies of {args.source.name} "
        f"({args.source.stat().st_size / 1e6:.1f} MB gzip), {len(os.sched_getaffinity(0))} cores, "
        f"parallel --jobs {args.jobs}, median of {args.runs} run(s); load average before: "
        f"{os.getloadavg()[0]:.2f} (other work on the machine takes cores from the parallel run)")
    say("MiB: peak RSS of the largest process (wait4); all MiB: peak PSS of the report process and its workers "
        "together, sampled every 50 ms in one more run, untimed")
    say(f"{'ranks':>6}{'serial s':>10}{'CPU s':>7}{'MiB':>6}{'parallel s':>12}{'CPU s':>7}{'MiB':>6}{'all MiB':>9}"
        f"{'ranks/s':>9}{'speed-up':>10}")
    rows = {}
    hta = None
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        for n in counts:
            folder = Path(tmp) / f"ranks{n}"
            subprocess.run([sys.executable, __file__, "--source", str(args.source), "--build", str(folder), str(n)],
                           check=True, cwd=REPO)
            serial = median_of(report(folder, Path(tmp) / f"serial{n}.md", 1), args.runs)
            parallel = median_of(report(folder, Path(tmp) / f"parallel{n}.md", args.jobs), args.runs, tree=True)
            for label, r in (("serial", serial), ("parallel", parallel)):
                if r["rc"] != 0:
                    say(f"{n} ranks, {label}: FAILED (exit {r['rc']}): {r['last']}")
                    return 1
            same = len({(Path(tmp) / f"{mode}{n}.md").read_text().replace(f"{mode}{n}_plots", "")
                        for mode in ("serial", "parallel")}) == 1
            rows[n] = (serial, parallel)
            say(f"{n:>6}{serial['wall_s']:>10.2f}{serial['cpu_s']:>7.1f}{serial['peak_mib']:>6.0f}"
                f"{parallel['wall_s']:>12.2f}{parallel['cpu_s']:>7.1f}{parallel['peak_mib']:>6.0f}"
                f"{parallel['tree_mib']:>9.0f}{n / parallel['wall_s']:>9.1f}"
                f"{serial['wall_s'] / parallel['wall_s']:>10.2f}" + ("" if same else "   REPORTS DIFFER"))
            if n == counts[0] and (args.hta_venv / "bin" / "python").exists():
                hta = median_of([str(args.hta_venv / "bin" / "python"), "-c", _HTA, str(folder)], args.runs, tree=True)
            shutil.rmtree(folder)
    lo, hi = counts[0], counts[-1]
    mem = rows[hi][1]["peak_mib"] / rows[lo][1]["peak_mib"]
    tree = rows[hi][1]["tree_mib"] / rows[lo][1]["tree_mib"]
    speedups = {n: s["wall_s"] / p["wall_s"] for n, (s, p) in rows.items()}
    throughput = (hi / rows[hi][1]["wall_s"]) / (lo / rows[lo][1]["wall_s"])
    say()
    say(f"peak RSS at {hi} ranks / at {lo}: {mem:.2f} (target <= 1.5: {'met' if mem <= 1.5 else 'MISSED'}); all "
        f"processes' PSS: {tree:.2f}")
    say("parallel speed-up (serial / parallel): " + ", ".join(f"{n} ranks {s:.2f}" for n, s in speedups.items())
        + f" (target >= 1.7 at {hi} ranks, where parsing is the work rather than the start-up: "
        f"{'met' if speedups[hi] >= 1.7 else 'MISSED'})")
    say(f"throughput at {hi} ranks / at {lo}: {throughput:.2f} (target >= 0.8: "
        f"{'met' if throughput >= 0.8 else 'MISSED'})")
    if hta is None:
        say(f"HolisticTraceAnalysis: no venv at {args.hta_venv} (see bench_trace.py for its setup): not measured")
    elif hta["rc"] != 0:
        say(f"HolisticTraceAnalysis 0.5.0 on {lo} ranks: FAILED (exit {hta['rc']}): {hta['last']}")
    else:
        ours = rows[lo][1]
        say(f"HolisticTraceAnalysis 0.5.0 on {lo} ranks (load + temporal breakdown + overlap + kernel breakdown): "
            f"{hta['wall_s']:.2f} s, {hta['peak_mib']:.0f} MiB (all processes {hta['tree_mib']:.0f}); the whole report "
            f"here {ours['wall_s']:.2f} s, {ours['peak_mib']:.0f} MiB (all processes {ours['tree_mib']:.0f}): "
            f"{hta['wall_s'] / ours['wall_s']:.1f}x faster, {ours['tree_mib'] / hta['tree_mib']:.2f} of its memory")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write("\n".join(lines) + "\n\n")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
