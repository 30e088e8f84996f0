"""Every torch-backend GPU recipe of the catalogue rehearsed at its real size (`python -m launch rehearse`, one after
another), each figure beside the plan's: the ratio planned / rehearsed is the benchmark, the rehearsal (torch's own
memory tracker, FLOP counter and collective counter over the recipe's real step) its baseline, measured in the same
run. Writes the table to bench/results/rehearsal.txt and the rehearsed peaks to recipes/rehearsed.json, which the
catalogue (`python -m launch docs`) shows beside the plan and tests/unit/test_rehearsed_catalogue.py holds the plan to.

    python bench/rehearse_catalogue.py [NAME ...]     (all of them: about ten minutes on 2 cores)
"""
from __future__ import annotations

from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import datetime as dt  # noqa: E402
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from launch.commands.catalogue import entries
from launch.commands.rehearse import rehearsable
from launch.run.rehearsal import CATALOGUE, CATALOGUE_SCHEMA

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
RESULTS = REPO / "bench" / "results" / "rehearsal.txt"
GiB = 1024 ** 3


def rehearse(name: str, out: Path) -> tuple[dict, float]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "launch", "rehearse", f"recipes/{name}", f"out={out}"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "rehearsal.json").read_text()), time.perf_counter() - start


def row(name: str, rank: dict, seconds: float) -> str:
    phases = "  ".join(f"{p['ratio']:.3f}" if p["ratio"] else "  n/a" for p in rank["phases"])
    calls = ", ".join(f"{k} {n}" + ("" if rank["collectives_planned"].get(k) == n
                                    else f"/{rank['collectives_planned'].get(k, 0)}")
                      for k, n in sorted(rank["collectives_measured"].items()))
    return (f"{name:20} {rank['peak_bytes_measured'] / GiB:8.2f} {rank['peak_bytes_planned'] / GiB:8.2f} "
            f"{rank['peak_ratio']:6.3f}   {phases}   {rank['peak_phase_planned'] or '-':8} "
            f"{rank['flops_ratio']:6.3f}  {seconds:6.1f}  {calls}")


def main(names: list[str]) -> int:
    torch_gpu = [e.name for e in entries(RECIPES)
                 if e.resolved.recipe.backend == "torch" and not e.on_cpu and rehearsable(e.resolved)]
    unknown = [n for n in names if n not in torch_gpu]
    if unknown:
        print(f"error: {', '.join(unknown)}: not a torch-backend GPU recipe of recipes/ (those: {', '.join(torch_gpu)})",
              file=sys.stderr)
        return 2
    chosen = names or torch_gpu
    recorded_path = RECIPES / CATALOGUE
    recorded = json.loads(recorded_path.read_text()) if recorded_path.is_file() else {}
    recipes = dict(recorded.get("recipes", {})) if names else {}
    lines = []
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            record, seconds = rehearse(name, Path(tmp) / name)
            # when and with what each recipe was rehearsed: a partial rerun leaves the others' as they were
            recipes[name] = {"measured": stamp, "versions": versions, "seconds": round(seconds, 1),
                             "ranks": [{"rank": r["rank"], "role": r["role"], "peak_bytes": r["peak_bytes_measured"],
                                        "phases": {p["phase"]: p["bytes_measured"] for p in r["phases"]},
                                        "peak_at": r["peak_at"]} for r in record["ranks"]]}
            for r in record["ranks"]:
                lines.append(row(name, r, seconds))
                print(lines[-1], flush=True)
    recorded_path.write_text(json.dumps({
        "schema": CATALOGUE_SCHEMA, "written_by": "python bench/rehearse_catalogue.py",
        "recipes": dict(sorted(recipes.items()))}, indent=1) + "\n")
    header = [
        "# python bench/rehearse_catalogue.py: every torch-backend GPU recipe rehearsed at full size, one after another",
        f"# {stamp}, 2-core CPU machine, {versions}. One rank per distinct role (every rank alike without a pipeline).",
        "# rehearsed = torch's memory tracker (FSDPMemTracker; MemTracker under DDP) over the real step on a fake",
        "# process group under FakeTensorMode; planned = the plan's peak before its allowance (plan.json, launch/plan:",
        "# the torch accounting, phase by phase). ratio = planned / rehearsed; then the same for the step's phases",
        "# (forward, backward, optimizer step), the phase the plan puts the peak in, FLOPs per step (planned /",
        "# rehearsed, attention from the formula on both sides), the command's wall seconds, and calls per step by kind",
        "# (rehearsed, /planned where they differ).",
        f"{'recipe':20} {'rehearsed':>8} {'planned':>8} {'ratio':>6}   fwd    bwd    step    {'peak at':8} "
        f"{'FLOPs':>6}  {'wall s':>6}  collectives",
    ]
    if names:
        print(f"rehearsed {len(chosen)} recipe(s); {RESULTS} left as it was (it holds whole-catalogue runs)")
    else:
        RESULTS.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {recorded_path}" + ("" if names else f" and {RESULTS}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
