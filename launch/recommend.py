"""`python -m launch recommend recipes/NAME [key=value ...] [top=K] [verify=true] [steps=N]`: every layout, ranked.

Enumerates every layout of the recipe's model on its devices (hardware.nodes × gpus_per_node): backend (each one
installed) × tp (inside a node) × pp × dp × ZeRO stage × offload × activation checkpointing × micro-batch size
× sequence parallelism, with the recipe's global batch, sequence length and precision held. Each candidate goes
through the resolver (which refuses what a backend cannot build, and says why) and the planner (which drops
what does not fit, and by how much); the rest are ranked by predicted tokens/s/device and printed as a table and
a bar chart. Offload is tried only where the same layout does not fit without it (it never makes a step faster),
and not on CPU ranks (their memory is the host's already).

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

from launch.backends import BACKENDS, traits
from launch.errors import ConfigError
from launch.planner import GiB, Plan, plan_resolved
from launch.resolve import Resolved, resolve_path

MAX_MICRO_BATCH = 16
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
        """How far the worst rank is over its usable memory (host overflow counts too); 0 when it fits."""
        if self.plan is None:
            return math.inf
        worst = self.plan.worst()
        device = worst.memory[worst.implementation].total - worst.usable_bytes
        host = self.plan.host_bytes_per_node - self.plan.host_usable_bytes
        return max(0, device, host)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
        for tp in _divisors(gpn):
            for pp in _divisors(world // tp):
                if pp > 1 and "pp" not in bt.features:
                    continue
                dp = world // (tp * pp)
                for sp in (False, True) if tp > 1 and "sp" in bt.features else (False,):
                    for zero in range(4):
                        for ac in ("none", "selective", "full") if "selective" in bt.features else ("none", "full"):
                            for mb in [b for b in _divisors(gbs // dp) if b <= MAX_MICRO_BATCH] if gbs % dp == 0 else []:
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


def candidates(recipe: str, overrides: Sequence[str]) -> list[Candidate]:
    base = resolve_path(recipe, overrides)
    out: list[Candidate] = []
    fitting_without_offload: set[str] = set()
    for label, ov in layouts(base):
        offloaded = " off=" in label
        if offloaded and label.split(" off=")[0] in fitting_without_offload:
            continue  # the same layout fits without offloading, which only adds time
        try:
            plan = plan_resolved(resolve_path(recipe, [*overrides, *ov]))
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


def uncalibrated(cands: Sequence[Candidate], fit: Sequence[Candidate]) -> list[Candidate]:
    """Layouts that fit but are left out of the ranking because the calibration does not time them."""
    chosen = {id(c) for c in fit}
    return [c for c in cands if c.fits and id(c) not in chosen]


def _console():
    from rich.console import Console

    return Console(width=int(os.environ.get("COLUMNS", "120")), highlight=False, soft_wrap=True)


def render(recipe_name: str, cands: Sequence[Candidate], shown: int, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    fit = ranked(cands)
    refused = [c for c in cands if c.plan is None]
    too_big = [c for c in cands if c.plan is not None and not c.fits]
    console.print(f"[bold]recommend[/bold] {escape(recipe_name)}: {len(cands)} layouts tried, "
                  f"{sum(c.fits for c in cands)} fit ({len(fit)} ranked), {len(too_big)} do not fit, "
                  f"{len(refused)} cannot be built")
    if not fit:
        closest = min(too_big, key=Candidate.overflow_bytes, default=None)
        console.print("no layout fits" + (f"; the closest is {escape(closest.label)}: {escape(closest.refused)}"
                                          if closest else ""))
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
    reasons: dict[str, int] = {}
    for c in refused:
        reasons[c.refused] = reasons.get(c.refused, 0) + 1
    for c in too_big:
        reasons["does not fit"] = reasons.get("does not fit", 0) + 1
    for c in uncalibrated(cands, fit):
        why = next((n for n in c.plan.notes if n.startswith("time:")), "time: nominal")
        key = "not ranked with the calibrated ones: " + why.split("because ", 1)[-1]
        reasons[key] = reasons.get(key, 0) + 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        console.print(f"  dropped {n}: {escape(why)}")
    notes = {n for c in fit[:shown] for n in c.plan.notes if n.startswith("time:")}
    for n in sorted(notes):
        console.print(f"  note: {escape(n)}")


def _verify(recipe: str, overrides: Sequence[str], top: Sequence[Candidate], steps: int, console) -> int:
    from launch.sweep import member, run_members, write_report

    held = [*overrides, f"train.steps={steps}", "train.checkpoint_every=0"]
    members = [member(c.label, recipe, [*held, *c.overrides]) for c in top]
    measured = run_members(members, quiet=True)
    rows = [(c, x) for c, x in zip(top, measured, strict=True)]
    ok = [(c, x) for c, x in rows if x.step_time_s is not None]
    ok.sort(key=lambda cx: cx[1].step_time_s)
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="verified: re-ranked by measured median step time after warm-up", title_justify="left")
    for col in ("#", "layout", "predicted ms", "measured ms", "error", "predicted rank", "run"):
        t.add_column(col, justify="left" if col in ("layout", "run") else "right")
    for i, (c, x) in enumerate(ok, 1):
        pred = x.member.plan.step.total_s
        t.add_row(str(i), escape(c.label), f"{pred * 1e3:.1f}", f"{x.step_time_s * 1e3:.1f}",
                  f"{(pred - x.step_time_s) / x.step_time_s:+.1%}", str(top.index(c) + 1), escape(str(x.run_dir)))
    console.print(t)
    for c, x in rows:
        if x.step_time_s is None:
            console.print(f"  {escape(c.label)}: no measured step (exit {x.rc}); see {escape(str(x.run_dir))}")
    if ok:
        fastest, pick = ok[0][1], next(x for c, x in rows if c is top[0])
        if ok[0][0] is top[0]:
            verdict = " (the predicted top pick)"
        elif pick.step_time_s is not None and (pick.step_time_s - fastest.step_time_s
                                               <= 2 * math.hypot(pick.noise_s, fastest.noise_s)):
            verdict = (f" (predicted rank {top.index(ok[0][0]) + 1}; the predicted top pick measured "
                       f"{pick.step_time_s * 1e3:.1f} ms, within twice the noise of ±"
                       f"{math.hypot(pick.noise_s, fastest.noise_s) * 1e3:.1f} ms: a tie at these steps)")
        else:
            verdict = f" (predicted rank {top.index(ok[0][0]) + 1})"
        console.print(f"measured fastest: {escape(ok[0][0].label)}{verdict}")
        _feed_back(members[0].resolved, ok, console)
    report = write_report(measured, "recommend")
    if report:
        console.print(f"report: {escape(str(report))}")
    return 0 if len(ok) == len(rows) else 1


def _feed_back(resolved: Resolved, ok, console) -> None:
    """Write a new calibration file beside the one used: the same figures plus these measurements and the
    geometric-mean measured/predicted ratio, which the planner applies (labelled) to plans that use it."""
    from rich.markup import escape

    calib = resolved.hardware.calibration
    if calib is None:
        console.print("  (nominal profile: run `python -m launch calibrate` and pass hardware.profile=PATH to feed "
                      "measurements back into a calibration)")
        return
    verified = list(calib.get("verified", ()))
    stamp = dt.datetime.now(dt.timezone.utc)
    for c, x in ok:
        step = x.member.plan.step
        verified.append({"layout": c.label, "overrides": list(c.overrides), "measured_s": x.step_time_s,
                         "predicted_s": step.total_s / step.correction, "run_dir": str(x.run_dir),
                         "when": stamp.isoformat(timespec="seconds")})
    ratio = math.exp(statistics.fmean(math.log(v["measured_s"] / v["predicted_s"]) for v in verified))
    doc = {k: v for k, v in calib.items() if k != "source_path"} | {"verified": verified, "correction": ratio}
    path = Path(calib["source_path"])
    out = path.with_name(f"{path.stem}.verified-{stamp:%Y%m%d-%H%M%S}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"  fed back: {escape(str(out))} holds {len(verified)} verified run(s); measured/predicted = "
                  f"{ratio:.3f}, applied to plans that use it (hardware.profile={escape(str(out))})")


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
    cands = candidates(recipe, overrides)
    render(resolve_path(recipe, overrides).recipe_name, cands, top, console)
    fit = ranked(cands)
    if not verify or not fit:
        return 0 if fit else 1
    return _verify(recipe, overrides, fit[:top], int(own["steps"]), console)
