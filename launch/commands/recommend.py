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
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from launch.config.backends import BACKENDS, traits
from launch.config.calibration import Machine, Newest, newest_for
from launch.config.grid import divisors
from launch.config.resolve import Resolved, resolve_path
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from launch.plan.layout import Plan
from launch.run import envinfo
from launch.units import GiB

MAX_MICRO_BATCH = 16  # the largest micro-batch tried (and calibrated)
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_TOP = 3
DEFAULT_VERIFY_STEPS = 30


@dataclass(frozen=True)
class Candidate:
    label: str  # e.g. "deepspeed tp2 pp1 dp1 z1 mb4"
    overrides: tuple[str, ...]
    plan: Plan | None  # None: the resolver refused it
    refused: str = ""  # the resolver's problem, or why it does not fit

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    def overflow_bytes(self) -> int:
        """How far the worst rank of a planned layout is over its usable memory (host overflow counts too)."""
        worst = self.plan.worst()
        device = worst.memory[worst.implementation].total - worst.usable_bytes
        host = self.plan.host_bytes_per_node - self.plan.host_usable_bytes
        return max(0, device, host)


def layouts(resolved: Resolved) -> list[tuple[str, tuple[str, ...]]]:
    """(label, overrides) of every combination to try, before the resolver and the planner judge them."""
    r = resolved.recipe
    gpn, world, gbs = r.hardware.gpus_per_node, resolved.world_size, r.batch.global_batch_size
    cpu = resolved.hardware.name == "cpu"
    out = []
    for backend in BACKENDS:
        bt = traits(backend)
        if bt.missing_packages():
            continue
        for tp in divisors(gpn):
            for pp in divisors(world // tp):
                if pp > 1 and "pp" not in bt.features:
                    continue
                dp = world // (tp * pp)
                for sp in (False, True) if tp > 1 and "sp" in bt.features else (False,):
                    for zero in ZERO_STAGES:
                        for ac in ("none", "selective", "full") if "selective" in bt.features else ("none", "full"):
                            for mb in [b for b in divisors(gbs // dp) if b <= MAX_MICRO_BATCH] if gbs % dp == 0 else []:
                                label = (f"{backend} tp{tp} pp{pp} dp{dp} z{zero}" + (" sp" if sp else "")
                                         + (f" ac={ac}" if ac != "none" else "") + f" mb{mb}")
                                ov = (f"backend={backend}", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=auto",
                                      f"parallel.sp={str(sp).lower()}", "parallel.vpp=1", f"parallel.zero_stage={zero}",
                                      f"train.activation_checkpointing={ac}", f"batch.micro_batch_size={mb}",
                                      "parallel.offload_optimizer=none", "parallel.offload_params=none")
                                out.append((label, ov))
                                if cpu or not bt.offload or zero == 0:
                                    continue
                                out.append((label + " off=opt", ov[:-2] + ("parallel.offload_optimizer=cpu",
                                                                            "parallel.offload_params=none")))
                                if zero == 3:
                                    out.append((label + " off=opt+params", ov[:-2] + ("parallel.offload_optimizer=cpu",
                                                                                       "parallel.offload_params=cpu")))
    return out


def candidates(recipe: str, overrides: Sequence[str], machine: Machine | None = None) -> list[Candidate]:
    """Every layout of the recipe's model on its devices, planned for `machine` (launch.config.calibration.Machine;
    None: nominal figures only)."""
    base = resolve_path(recipe, overrides)
    out: list[Candidate] = []
    fitting_without_offload: set[str] = set()
    for label, ov in layouts(base):
        offloaded = " off=" in label
        if offloaded and label.split(" off=")[0] in fitting_without_offload:
            continue  # the same layout fits without offloading, which only adds time
        try:
            plan = plan_resolved(resolve_path(recipe, [*overrides, *ov]), machine)
        except ConfigError as e:
            out.append(Candidate(label, ov, None, f"{e.field}: {e.problem}"))
            continue
        why = ""
        if not plan.fits:
            worst = plan.worst()
            why = (f"needs {worst.memory[worst.implementation].total / GiB:.2f} GiB on {worst.kind}, "
                   f"{worst.usable_bytes / GiB:.2f} usable" if not all(rp.fits for rp in plan.ranks) else
                   f"needs {plan.host_bytes_per_node / GiB:.1f} GiB host per node, {plan.host_usable_bytes / GiB:.1f} usable")
        elif not offloaded:
            fitting_without_offload.add(label)
        out.append(Candidate(label, ov, plan, why))
    return out


def ranked(cands: Sequence[Candidate]) -> list[Candidate]:
    """The layouts that fit, fastest first. Once any is timed by a calibration, only calibrated ones are ranked:
    nominal figures of the same machine are not comparable with measured ones."""
    fit = [c for c in cands if c.fits]
    if any(c.plan.step.timing == "calibrated" for c in fit):
        fit = [c for c in fit if c.plan.step.timing == "calibrated"]
    return sorted(fit, key=lambda c: -c.plan.step.tokens_per_s_per_device)


@dataclass(frozen=True)
class Recommendation:
    """What `recommend` found: the ranking, what was dropped and why (counted), and the closest miss."""

    tried: int
    fitting: int  # fit, ranked or not
    ranked: tuple[Candidate, ...]
    dropped: tuple[tuple[str, int], ...]  # (reason, how many), most common first
    closest: Candidate | None  # the smallest overflow, when nothing fits


def recommend(cands: Sequence[Candidate]) -> Recommendation:
    fit = ranked(cands)
    chosen = {id(c) for c in fit}
    too_big = [c for c in cands if c.plan is not None and not c.fits]
    reasons: dict[str, int] = {}
    for c in cands:
        if c.plan is None:
            why = c.refused
        elif not c.fits:
            why = "does not fit"
        elif id(c) not in chosen:  # fits, but the calibration does not time it
            note = next((n for n in c.plan.notes if n.startswith("time:")), "time: nominal")
            why = "not ranked with the calibrated ones: " + note.split("because ", 1)[-1]
        else:
            continue
        reasons[why] = reasons.get(why, 0) + 1
    return Recommendation(len(cands), sum(c.fits for c in cands), tuple(fit),
                          tuple(sorted(reasons.items(), key=lambda kv: -kv[1])),
                          None if fit else min(too_big, key=Candidate.overflow_bytes, default=None))


def _console():
    from rich.console import Console

    return Console(width=int(os.environ.get("COLUMNS", "120")), highlight=False, soft_wrap=True)


def render(recipe_name: str, rec: Recommendation, shown: int, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    fit = rec.ranked
    refused = sum(n for why, n in rec.dropped if why != "does not fit" and not why.startswith("not ranked"))
    too_big = dict(rec.dropped).get("does not fit", 0)
    console.print(f"[bold]recommend[/bold] {escape(recipe_name)}: {rec.tried} layouts tried, {rec.fitting} fit "
                  f"({len(fit)} ranked), {too_big} do not fit, {refused} cannot be built")
    if not fit:
        console.print("no layout fits" + (f"; the closest is {escape(rec.closest.label)}: {escape(rec.closest.refused)}"
                                          if rec.closest else ""))
        return
    t = Table(title="layouts that fit, fastest first (predicted)", title_justify="left")
    for col in ("#", "layout", "step ms", "tokens/s/device", "memory/rank GiB", "comm ms", "timing", ""):
        t.add_column(col, justify="right" if col in ("#", "step ms", "tokens/s/device", "memory/rank GiB", "comm ms")
                     else "left", no_wrap=col in ("layout", ""))
    best = fit[0].plan.step.tokens_per_s_per_device
    for i, c in enumerate(fit[:shown], 1):
        s, worst = c.plan.step, c.plan.worst()
        bar = "█" * max(1, round(24 * s.tokens_per_s_per_device / best))
        t.add_row(str(i), escape(c.label), f"{s.total_s * 1e3:.1f}", f"{s.tokens_per_s_per_device:,.0f}",
                  f"{worst.memory[worst.implementation].total / GiB:.2f}", f"{sum(x.time_s for x in c.plan.comm) * 1e3:.1f}",
                  s.timing, bar)
    console.print(t)
    if len(fit) > shown:
        console.print(f"  … and {len(fit) - shown} more that fit (top={len(fit)} lists them all)")
    for why, n in rec.dropped:
        console.print(f"  dropped {n}: {escape(why)}")
    for n in sorted({n for c in fit[:shown] for n in c.plan.notes if n.startswith("time:")}):
        console.print(f"  note: {escape(n)}")


def _verify(recipe: str, overrides: Sequence[str], top: Sequence[Candidate], steps: int, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from launch.commands.sweep import member, run_members, write_report

    held = [*overrides, f"train.steps={steps}", "train.checkpoint_every=0"]
    measured = run_members([member(c.label, recipe, [*held, *c.overrides]) for c in top], quiet=True)
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
    report = write_report(measured, "recommend")
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


def _newest_calibration(base: Resolved, overrides: Sequence[str]) -> Newest | None:
    """Where the command line names no hardware.profile and the recipe's (`base`) is nominal: the newest calibration
    that `calibrate` left under the runs folder for this machine, model and world, if any (`calibrate` then
    `recommend` is the documented order; ranking on nominal figures after measuring would throw the measurement
    away)."""
    from launch.run.rundir import runs_root

    if any(a.split("=", 1)[0].strip() == "hardware.profile" for a in overrides) or not base.hardware.nominal:
        return None  # named (the override parser strips the key too), or the recipe's own
    r = base.recipe
    return newest_for(runs_root(), machine_kind=envinfo.machine_kind(), versions=envinfo.package_versions(),
                      base_profile=base.hardware.name, world_size=base.world_size,
                      ranks_per_node=r.hardware.gpus_per_node, model=base.model.name, dtype=r.precision.dtype,
                      seq_len=r.batch.seq_len)


def cmd_recommend(args: Sequence[str]) -> int:
    if not args or "=" in args[0]:
        raise ConfigError("command line", "recipe", None, "is missing",
                          "usage: python -m launch recommend recipes/NAME [key=value ...] [top=K] [verify=true] [steps=N]")
    recipe, rest = args[0], list(args[1:])
    own = {"top": None, "verify": "false", "steps": str(DEFAULT_VERIFY_STEPS)}
    overrides = []
    for a in rest:
        key, _, value = a.partition("=")
        if key in own:
            own[key] = value
        else:
            overrides.append(a)
    if own["verify"] not in ("true", "false"):
        raise ConfigError("command line", "verify", own["verify"], "must be true or false", "use verify=true")
    for key in ("top", "steps"):
        if own[key] is not None and not (own[key].isdigit() and int(own[key]) >= 1):
            raise ConfigError("command line", key, own[key], "must be a whole number >= 1", f"e.g. {key}=3")
    verify = own["verify"] == "true"
    top = int(own["top"]) if own["top"] else (DEFAULT_TOP if verify else 20)
    console = _console()
    base = resolve_path(recipe, overrides)
    newest = _newest_calibration(base, overrides)
    if newest is not None:
        from rich.markup import escape

        if newest.unreadable:
            console.print(f"warning: passed over {len(newest.unreadable)} calibration file(s) that cannot be read, "
                          f"e.g. {escape(newest.unreadable[0])}")
        if newest.path is not None:
            overrides.append(f"hardware.profile={newest.path}")
            console.print(f"timed with {escape(str(newest.path))}: the newest calibration of this machine for this "
                          f"model and world (no hardware.profile given; hardware.profile={escape(base.hardware.name)} "
                          "gives nominal figures)")
    rec = recommend(candidates(recipe, overrides, envinfo.machine()))
    render(base.recipe_name, rec, top, console)
    if not verify or not rec.ranked:
        return 0 if rec.ranked else 1
    return _verify(recipe, overrides, rec.ranked[:top], int(own["steps"]), console)
