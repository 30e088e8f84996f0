"""`python -m launch recommend recipes/NAME [key=value ...] [top=K] [verify=true] [steps=N]`: every layout, ranked.

Enumerates every layout of the recipe's model on its devices (hardware.nodes × gpus_per_node): backend (each one
installed) × tp (inside a node) × pp × dp × ZeRO stage × offload × activation checkpointing × micro-batch size
× sequence parallelism, with the recipe's global batch, sequence length and precision held. Each candidate goes
through the resolver (which refuses what a backend cannot build, and says why) and the planner (which drops
what does not fit, and by how much); the rest are ranked by predicted tokens/s/device and printed as a table and
a bar chart. Offload is tried only where the same layout does not fit without it (it never makes a step faster),
and not on CPU ranks (their memory is the host's already). With no hardware.profile on the command line and a
nominal one in the recipe, the layouts are timed with the newest calibration `calibrate` left for this machine,
model and world (launch/config/calibration.py's `newest_for`), and the first line names it.

With `verify=true` the top K (default 3) run for real, short (`steps`, default 30), one after another through the
sweep runner, and are re-ranked by their measured median step time; predicted vs measured is printed and written,
with the measurements, into a new calibration file beside the one used (the planner reads the ratio back as a
correction, labelled; nothing is overwritten).
"""
from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from launch.commands.args import Option, boolean, read, whole
from launch.commands.render import make_console, recommendation, safe
from launch.config.resolve import resolve_path
from launch.plan.search import Candidate, search
from launch.run import envinfo
from launch.run.timesource import time_source

DEFAULT_TOP = 3
DEFAULT_VERIFY_STEPS = 30
USAGE = "usage: python -m launch recommend recipes/NAME [key=value ...] [top=K] [verify=true] [steps=N]"
OPTIONS = (Option("top", f"how many layouts to list (default 20; {DEFAULT_TOP} with verify=true)", whole(1, 10_000)),
           Option("verify", "run the top layouts for real and re-rank them by measured step time", boolean, False),
           Option("steps", f"steps of each verifying run (default {DEFAULT_VERIFY_STEPS})", whole(1, 1_000_000),
                  DEFAULT_VERIFY_STEPS))


def _verify(recipe: str, overrides: Sequence[str], top: Sequence[Candidate], steps: int, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from launch.commands.sweep import member, run_members, sweep_folder, write_report

    held = [*overrides, f"train.steps={steps}", "train.checkpoint_every=0"]
    folder = sweep_folder("recommend")
    measured = run_members([member(c.label, recipe, [*held, *c.overrides]) for c in top], folder, quiet=True)
    rank = {c.label: i for i, c in enumerate(top, 1)}  # predicted
    done = sorted((x for x in measured if x.step_time_s is not None), key=lambda x: x.step_time_s)
    t = Table(title="verified: re-ranked by measured median step time after warm-up", title_justify="left")
    for col in ("#", "layout", "predicted ms", "measured ms", "error", "predicted rank", "run"):
        t.add_column(col, justify="left" if col in ("layout", "run") else "right")
    for i, x in enumerate(done, 1):
        pred = x.member.plan.step.total_s
        t.add_row(str(i), escape(x.member.label), f"{pred * 1e3:.1f}", f"{x.step_time_s * 1e3:.1f}",
                  f"{(pred - x.step_time_s) / x.step_time_s:+.1%}", str(rank[x.member.label]), escape(str(x.run_dir)))
    console.print(t)
    for x in measured:
        if x.step_time_s is None:
            console.print(f"  {escape(x.member.label)}: no measured step (exit {x.rc}); see {escape(str(x.run_dir))}")
    if done:
        console.print(f"measured fastest: {escape(done[0].member.label)}{_verdict(done[0], measured[0])}")
        _feed_back(done, console)
    report = write_report(measured, folder)
    if report:
        console.print(f"report: {escape(str(report))}")
    return 0 if len(done) == len(measured) else 1


def _verdict(fastest, pick) -> str:
    """How the predicted top pick (`pick`) fared against the measured fastest."""
    if fastest is pick:
        return " (the predicted top pick)"
    noise = math.hypot(pick.noise_s, fastest.noise_s)
    if pick.step_time_s is not None and pick.step_time_s - fastest.step_time_s <= 2 * noise:
        return (f" (the predicted top pick measured {pick.step_time_s * 1e3:.1f} ms, within twice the noise of "
                f"±{noise * 1e3:.1f} ms: a tie at these steps)")
    return " (not the predicted top pick)"


def _feed_back(done, console) -> None:
    """Write a new calibration file beside the one used: the same figures plus these measurements and the
    geometric-mean measured/predicted ratio, which the planner applies (labelled) to plans that use it. Only runs
    the calibration timed count: a nominal prediction says nothing about it."""
    from rich.markup import escape

    calib = done[0].member.resolved.hardware.calibration
    timed = [x for x in done if x.member.plan.step.timing == "calibrated" and x.step_time_s > 0]
    if calib is None or not timed:
        console.print("  (no calibrated prediction among them: run `python -m launch calibrate` on this machine "
                      "(recommend then finds it) or pass hardware.profile=PATH to feed measurements back into a "
                      "calibration)")
        return
    verified = list(calib.get("verified", ()))
    stamp = dt.datetime.now(dt.timezone.utc)
    for x in timed:
        step = x.member.plan.step
        verified.append({"layout": x.member.label, "overrides": list(x.member.overrides), "measured_s": x.step_time_s,
                         "predicted_s": step.total_s / step.correction, "run_dir": str(x.run_dir),
                         "when": stamp.isoformat(timespec="seconds")})
    ratio = math.exp(statistics.fmean(math.log(v["measured_s"] / v["predicted_s"]) for v in verified))
    if not 0.1 <= ratio <= 10:
        console.print(f"  measured/predicted = {ratio:.3g} is outside any sense (0.1-10): not fed back; recalibrate")
        return
    doc = {k: v for k, v in calib.items() if k != "source_path"} | {"verified": verified, "correction": ratio}
    path = Path(calib["source_path"])
    for n in range(100):  # a new name each time: nothing existing is replaced
        out = path.with_name(f"{path.stem}.verified-{stamp:%Y%m%d-%H%M%S}" + (f"-{n}" if n else "") + ".json")
        try:
            with open(out, "x") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
            break
        except FileExistsError:
            continue
    console.print(f"  fed back: {escape(str(out))} holds {len(verified)} verified run(s); measured/predicted = "
                  f"{ratio:.3f}, applied to plans that use it (hardware.profile={escape(str(out))})")


def cmd_recommend(args: Sequence[str]) -> int:
    a = read(args, command="recommend", usage=USAGE, options=OPTIONS, positional=(1, 1), overrides=True)
    recipe, overrides, verify = a.positional[0], list(a.overrides), a.options["verify"]
    top = a.options["top"] or (DEFAULT_TOP if verify else 20)
    console = make_console()
    base = resolve_path(recipe, overrides)
    machine = envinfo.machine()
    source = time_source(base, overrides, machine)
    for line in source.lines:
        console.print(safe(line), soft_wrap=True)  # a path stays whole
    overrides = list(source.overrides)
    rec = search(recipe, overrides, machine)
    recommendation(base.recipe_name, rec, top, console)
    if not verify or not rec.ranked:
        return 0 if rec.ranked else 1
    return _verify(recipe, overrides, rec.ranked[:top], a.options["steps"], console)
