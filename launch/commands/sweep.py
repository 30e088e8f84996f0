"""`bash launch/sweep.sh recipes/A recipes/B ... [key=value ...] [--dry-run]`: a set of runs held equal, then one report.

Every member is resolved first; a set whose members differ in what makes step times comparable (global batch,
sequence length, steps, warm-up steps, profiling) is refused before anything runs. The members then run one
after another, each a fresh run (`run.resume=never`) in its own run directory, with a progress line naming which
of how many is going; at the end `python -m analysis report` writes the comparative report of all of them.
`--dry-run` prints the plan table of the whole set (fits, predicted step time, predicted communication) and
runs nothing. `python -m launch recommend ... verify=true` runs its top layouts through `run_members`.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from launch.commands.args import read
from launch.commands.render import make_console, sweep_table
from launch.commands.run import check_inputs, four_bit_preflight
from launch.config.resolve import Resolved, resolve_path
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from launch.plan.layout import Plan
from launch.run import envinfo
from launch.outputs import claim_folder
from launch.run.rundir import RunDir, runs_root
from launch.run.timesource import time_source
from launch.units import GiB

# What must be equal across a set for its step times and curves to compare (dotted recipe key -> reader).
HELD_EQUAL: dict[str, Callable[[Resolved], object]] = {
    "batch.global_batch_size": lambda r: r.recipe.batch.global_batch_size,
    "batch.seq_len": lambda r: r.recipe.batch.seq_len,
    "train.steps": lambda r: r.recipe.train.steps,
    "train.warmup_steps": lambda r: r.recipe.train.warmup_steps,
    "run.profile": lambda r: r.recipe.run.profile,
}

USAGE = "usage: bash launch/sweep.sh recipes/A recipes/B ... [key=value ...] [--dry-run]"
MAX_MEMBERS = 1000  # recipes in one sweep


@dataclass(frozen=True)
class Member:
    label: str
    recipe: str
    overrides: tuple[str, ...]
    resolved: Resolved
    plan: Plan


@dataclass(frozen=True)
class Measured:
    member: Member
    run_dir: Path
    rc: int
    step_time_s: float | None  # median measured step (its slowest rank), as the report; None when none was recorded
    noise_s: float = 0.0  # the median's standard error: 1.2533 · sd / √n over those steps


def member(label: str, recipe: str, overrides: Sequence[str]) -> Member:
    """One run of the set, without a final checkpoint unless the overrides ask for one (run.save_final: a benchmark
    run's would be its largest write), timed as run.sh would time it (launch/run/timesource.py): its overrides then
    carry the calibration, so that the run and the table name the same figures."""
    machine = envinfo.machine()
    overrides = ["run.save_final=false", *overrides]  # the user's own run.save_final comes later and wins
    resolved = resolve_path(recipe, [*overrides, "run.resume=never"])
    source = time_source(resolved, overrides, machine)
    if source.calibration:
        resolved = resolve_path(recipe, [*source.overrides, "run.resume=never"])
    return Member(label or resolved.recipe_name, recipe, source.overrides, resolved, plan_resolved(resolved, machine))


def distinct_labels(members: Sequence[Member]) -> list[Member]:
    """Each member labelled by its recipe's own name (`.` spelled out, as its run directory is), a repeated name
    numbered (`a`, `a-2`): the report tells runs apart by label."""
    taken: set[str] = set()
    out = []
    for m in members:
        label, n = m.label, 1
        while label in taken:  # `a`, `a`, `a-2` gives a, a-2, a-2-2: a number never lands on a name already given
            n += 1
            label = f"{m.label}-{n}"
        taken.add(label)
        out.append(m if label == m.label else dataclasses.replace(m, label=label))
    return out


def check_equal(members: Sequence[Member]) -> None:
    """Refuse a set that differs in what HELD_EQUAL names: one line naming both members and the values."""
    first = members[0]
    for m in members[1:]:
        for key, value_of in HELD_EQUAL.items():
            a, b = value_of(first.resolved), value_of(m.resolved)
            if a != b:
                raise ConfigError(m.resolved.recipe_path, key, b,
                                  f"differs from {first.label}'s {a}: the set's step times would not compare",
                                  f"hold it equal on the command line, e.g. {key}={a}")


def plan_rows(members: Sequence[Member]) -> list[dict]:
    """One row per member: what the dry run prints (computing apart from rendering)."""
    rows = []
    for m in members:
        p, worst = m.plan, m.plan.worst()
        comm = sum(c.time_s for c in p.comm)
        rows.append({"label": m.label, "fits": p.fits, "memory_GiB": worst.memory[worst.implementation].total / GiB,
                     "step_ms": p.step.total_s * 1e3, "comm_ms": comm * 1e3,
                     "tokens_per_s_per_device": p.step.tokens_per_s_per_device, "timing": p.step.timing})
    return rows


def median_step_time(run: RunDir) -> tuple[float | None, float]:
    """(median measured step time, its standard error) of a finished run, as its report counts it
    (launch.run.metrics.measured_step_times: warm-up left out, each step its slowest rank's)."""
    from launch.run.metrics import measured_step_times, read_metrics

    steps = measured_step_times([read_metrics(p) for p in sorted(run.metrics_dir.glob("rank*.jsonl"))])
    if not steps:
        return None, 0.0
    se = 1.2533 * statistics.stdev(steps) / len(steps) ** 0.5 if len(steps) > 1 else 0.0
    return statistics.median(steps), se


def run_members(members: Sequence[Member], folder: Path, *, quiet: bool = False) -> list[Measured]:
    """Run each member with `python -m launch run`, one after another, each in a fresh run directory under `folder`
    (the sweep's own, never the recipe's runs folder: `run.resume=auto` of a later run must not pick these up)."""
    out = []
    for i, m in enumerate(members, 1):
        run = RunDir.create(_label_safe(m.label), root=folder)
        print(f"[{i}/{len(members)}] {m.label} -> {run.root}", flush=True)
        argv = [sys.executable, "-m", "launch", "run", m.recipe, *m.overrides, "run.resume=never"]
        rc = subprocess.call(argv, env={**os.environ, "LAYOUTLAB_RUN_DIR": str(run.root)},
                             stdout=subprocess.DEVNULL if quiet else None)
        out.append(Measured(m, run.root, rc, *median_step_time(run)))
        if rc != 0:
            print(f"[{i}/{len(members)}] {m.label} failed (exit {rc}); its logs are in {run.logs}", flush=True)
    return out


def sweep_folder(kind: str) -> Path:
    """The folder a sweep (or recommend's verification) owns: runs/sweeps/<kind>-<UTC stamp>/, its member runs
    and its report inside."""
    return claim_folder(runs_root() / "sweeps", f"{kind}-", field="LAYOUTLAB_RUNS")


def write_report(measured: Sequence[Measured], folder: Path) -> Path | None:
    """The comparative report (Markdown, and HTML beside it) of the runs that finished, by the analysis CLI (launch
    never imports analysis)."""
    done = [x for x in measured if x.rc == 0]
    if not done:
        return None
    out = folder / "report.md"
    labels = [f"{_label_safe(x.member.label)}={x.run_dir}" for x in done]
    subprocess.call([sys.executable, "-m", "analysis", "report", *labels, "-o", str(out), "-o",
                     str(out.with_suffix(".html"))])
    return out if out.is_file() else None


def _label_safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def cmd_sweep(args: Sequence[str]) -> int:

    a = read(args, command="sweep.sh", usage=USAGE, positional=(0, MAX_MEMBERS), overrides=True, dry_run=True)
    dry, recipes, overrides = a.dry_run, list(a.positional), list(a.overrides)
    if len(recipes) < 2:
        raise ConfigError("command line", "recipes", recipes, "names fewer than two recipes: nothing to compare", USAGE)
    members = distinct_labels([member("", r, overrides) for r in recipes])
    check_equal(members)
    checked = set()
    for m in members:  # as run.sh checks them, before the dry run's table and the sweep's folder: one line, nothing made
        inputs = (m.resolved.recipe.data, m.resolved.recipe.model.weights)
        if inputs not in checked:  # members of one sweep mostly read one corpus: tokenized once here, not per member
            check_inputs(m.resolved)
            checked.add(inputs)
    sweep_table(plan_rows(members), f"sweep of {len(members)} runs" + (f" ({' '.join(overrides)})" if overrides else ""),
                make_console())
    if dry:
        return 0
    four_bit_preflight([m.resolved for m in members])  # before the first member trains, not at its own launch
    folder = sweep_folder("sweep")
    measured = run_members(members, folder)
    for x in measured:
        got = f"{x.step_time_s * 1e3:.1f} ms measured" if x.step_time_s is not None else "no measured step"
        print(f"  {x.member.label}: {x.member.plan.step.total_s * 1e3:.1f} ms predicted, {got} ({x.run_dir})")
    report = write_report(measured, folder)
    if report:
        print(f"report: {report}")
    elif any(x.rc == 0 for x in measured):
        print(f"the report of {folder} was not written (see the lines above)", file=sys.stderr)
        return 1
    return 0 if all(x.rc == 0 for x in measured) else 1
