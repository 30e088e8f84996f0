"""The Kineto reader's memory per event and its event limit, against Python's json module on the same trace.

    python bench/bench_trace_memory.py [events=2000000]

Builds a gzip trace of `events` tiny complete events (the hostile shape: 2 million take 5.6 MB of gzip here, and
events that repeat exactly, as a loop's do, compress further),
then in fresh processes measures the peak RSS (VmHWM) of (a) `parse_kineto` of it, (b) `json.load` of the same file
(the baseline: what a reader that holds the document costs), each less a process that only imports the same modules,
and prints bytes per event for each and their ratio; then reads a trace past analysis.parsers.kineto.MAX_EVENTS
with the limit lowered to `events` / 2 in the child, and prints what it kept and its peak, which the limit bounds.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = r"""
import sys, json, gzip
from analysis.parsers import kineto
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
what, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
if limit:
    kineto.MAX_EVENTS = limit
kept = 0
if what == "ours":
    t = kineto.parse_kineto(path)
    kept = len(t)
    warned = any("more than" in w for w in t.warnings)
elif what == "json":
    with gzip.open(path) as fh:
        kept = len(json.load(fh)["traceEvents"])
    warned = False
else:
    warned = False
print(json.dumps({"hwm": hwm(), "kept": kept, "warned": warned}))
"""


def _write_trace(path: Path, n: int) -> None:
    with gzip.open(path, "wt", compresslevel=6) as fh:
        fh.write('{"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [\n')
        for i in range(n):
            fh.write(f'{{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": {i}, "dur": 1}}'
                     + (",\n" if i < n - 1 else "\n"))
        fh.write("]}\n")


def _child(what: str, path: Path, limit: int = 0) -> dict:
    # the child imports the project as README's install leaves it (pip install -e .), from the repository root
    out = subprocess.run([sys.executable, "-c", CHILD, what, str(path), str(limit)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    events = 2_000_000
    for a in argv:
        key, _, value = a.partition("=")
        if key != "events" or not value.isdigit() or int(value) < 1000:
            print(f"error: {a!r}: give events=N (N >= 1000)", file=sys.stderr)
            return 2
        events = int(value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny_events.json.gz"
        _write_trace(path, events)
        size = path.stat().st_size
        idle = _child("none", path)["hwm"]
        ours, base = _child("ours", path), _child("json", path)
        per_ours, per_json = (ours["hwm"] - idle) / events, (base["hwm"] - idle) / events
        from analysis.parsers import kineto

        print(f"trace: {events:,} tiny complete events, {size / 1e6:.1f} MB gzip; idle process {idle / 2**20:.0f} MiB; "
              + ("C scanner" if kineto._kscan else "no C scanner: msgspec"))
        print(f"  parse_kineto: {per_ours:6.0f} B/event ({ours['kept']:,} events kept)")
        print(f"  json.load (baseline): {per_json:6.0f} B/event ({base['kept']:,} events)")
        print(f"  ratio ours / json.load: {per_ours / per_json:.2f}")
        half = events // 2
        capped = _child("ours", path, half)
        print(f"  with MAX_EVENTS={half:,}: kept {capped['kept']:,}, warned {capped['warned']}, "
              f"{(capped['hwm'] - idle) / 2**20:.0f} MiB over idle (uncapped: {(ours['hwm'] - idle) / 2**20:.0f} MiB)")
        print(f"  at the shipped MAX_EVENTS={kineto.MAX_EVENTS:,}: ~{kineto.MAX_EVENTS * per_ours / 2**30:.1f} GiB of "
              "table at most")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
