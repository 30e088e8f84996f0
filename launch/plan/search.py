"""The search behind `python -m launch recommend`: every layout of a recipe's model on its devices, planned, the
ones that fit ranked by predicted tokens/s/device, and what was dropped and why. Pure: the resolver and the planner,
no runs (launch/commands/recommend.py runs and verifies)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from launch.config.backends import BACKENDS, traits
from launch.config.calibration import Machine
from launch.config.grid import divisors
from launch.config.resolve import Resolved, resolve_path
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from launch.plan.layout import Plan
from launch.units import GiB

MAX_MICRO_BATCH = 16  # the largest micro-batch tried (and calibrated)


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
    cpu = resolved.hardware.device_type == "cpu"
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
                    for zero in bt.zero_stages:
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
                                if bt.offload_optimizer_alone:
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
