"""The search behind `python -m launch recommend`: every layout of a recipe's model on its devices, planned, the
ones that fit ranked by predicted tokens/s/device, and what was dropped and why. Pure: the resolver and the planner,
no runs (launch/commands/recommend.py runs and verifies)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from launch.config.backends import BACKENDS, traits
from launch.config.calibration import Machine
from launch.config.grid import divisors
from launch.config.resolve import Resolved, resolve
from launch.config.schema import load_recipe, with_overrides
from launch.errors import ConfigError
from launch.plan.build import plan_resolved
from launch.plan.layout import Plan
from launch.units import GiB

MAX_MICRO_BATCH = 16  # the largest micro-batch tried (and calibrated)
# The most devices recommend enumerates layouts for: the world's divisors are found by trial up to its square root
# (10^6 trials here), and no machine comes near.
MAX_DEVICES = 1 << 40


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
    return [layout for block in _blocks(resolved, lambda _: resolved.recipe_path) for layout in block.layouts()]


@dataclass(frozen=True)
class _Block:
    """The layouts of one backend, tp and pp: sp × ZeRO stage × activation checkpointing × micro-batch, each with
    its offloaded variants (not on CPU ranks)."""

    backend: str
    tp: int
    pp: int
    dp: int
    micro: tuple[int, ...]
    cpu: bool

    def _axes(self):
        bt = traits(self.backend)
        sps = (False, True) if self.tp > 1 and "sp" in bt.features else (False,)
        acs = ("none", "selective", "full") if "selective" in bt.features else ("none", "full")
        return bt, sps, acs

    def _offloads(self, bt, zero: int) -> int:
        if self.cpu or not bt.offload or zero == 0:
            return 0
        return bool(bt.offload_optimizer_alone) + (zero == 3)

    def layouts(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        bt, sps, acs = self._axes()
        backend, tp, pp, dp = self.backend, self.tp, self.pp, self.dp
        for sp in sps:
            for zero in bt.zero_stages:
                for ac in acs:
                    for mb in self.micro:
                        label = (f"{backend} tp{tp} pp{pp} dp{dp} z{zero}" + (" sp" if sp else "")
                                 + (f" ac={ac}" if ac != "none" else "") + f" mb{mb}")
                        ov = (f"backend={backend}", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=auto",
                              f"parallel.sp={str(sp).lower()}", "parallel.vpp=1", f"parallel.zero_stage={zero}",
                              f"train.activation_checkpointing={ac}", f"batch.micro_batch_size={mb}",
                              "parallel.offload_optimizer=none", "parallel.offload_params=none")
                        yield label, ov
                        if not self._offloads(bt, zero):
                            continue
                        if bt.offload_optimizer_alone:
                            yield (label + " off=opt", ov[:-2] + ("parallel.offload_optimizer=cpu",
                                                                   "parallel.offload_params=none"))
                        if zero == 3:
                            yield (label + " off=opt+params", ov[:-2] + ("parallel.offload_optimizer=cpu",
                                                                          "parallel.offload_params=cpu"))

    def size(self) -> int:
        """len(list(self.layouts())), counted, not listed."""
        bt, sps, acs = self._axes()
        return len(sps) * len(acs) * len(self.micro) * sum(1 + self._offloads(bt, z) for z in bt.zero_stages)


def _blocks(resolved: Resolved, where: Callable[[str], str]) -> Iterator[_Block]:
    """The layouts to try, a backend, tp and pp at a time, in `layouts`' order. Every loop runs over divisors (the
    world's found once, up to its square root; micro-batches up to MAX_MICRO_BATCH): the work follows how many
    layouts there are, not the size of the world or of the global batch. A machine of more than MAX_DEVICES is
    refused (`where` names the file or override that set a field)."""
    r = resolved.recipe
    gpn, world, gbs = r.hardware.gpus_per_node, resolved.world_size, r.batch.global_batch_size
    if world > MAX_DEVICES:
        field, value = ("hardware.gpus_per_node", gpn) if gpn > r.hardware.nodes else ("hardware.nodes", r.hardware.nodes)
        raise ConfigError(where(field), field, value,
                          f"makes {world:,} devices (hardware.nodes × hardware.gpus_per_node), more than recommend "
                          f"enumerates layouts for ({MAX_DEVICES:,})",
                          f"lower {field}: hardware.nodes × hardware.gpus_per_node at most {MAX_DEVICES:,}")
    cpu = resolved.hardware.device_type == "cpu"
    of_world = divisors(world)
    for backend in BACKENDS:
        bt = traits(backend)
        if bt.missing_packages():
            continue
        for tp in divisors(gpn):
            for pp in (d for d in of_world if (world // tp) % d == 0):
                if pp > 1 and "pp" not in bt.features:
                    continue
                dp = world // (tp * pp)
                if gbs % dp == 0:  # else no micro-batch size makes the global batch: no layout
                    yield _Block(backend, tp, pp, dp, tuple(divisors(gbs // dp, at_most=MAX_MICRO_BATCH)), cpu)


def _splits_by_tp(model, tp: int) -> bool:
    return not any(n % tp for n in (model.num_heads, model.num_kv_heads, model.intermediate_size))


def _shape_scope(model, block: _Block, e: ConfigError) -> tuple[str, int] | None:
    """The layouts a refusal `e` of a layout of `block` holds for as it stands. The resolver checks the model's shape
    (tp divides the attention heads, the KV heads and the MLP width; then pp × vpp, vpp = 1 here, the layers) before
    the backend and every field the search varies under tp and pp (sp, ZeRO stage, checkpointing, micro-batch,
    offload), so its refusal of a tp the shape cannot split by, ("tp", tp), is its refusal of every layout with that
    tp, and its refusal of such a pp, ("pp", pp), of every layout with that pp and a tp that does split the model.
    None: the refusal is this layout's own."""
    if e.field == "parallel.tp" and not _splits_by_tp(model, block.tp):
        return "tp", block.tp
    if e.field == "parallel.pp" and model.num_layers % block.pp:
        return "pp", block.pp
    return None


def _judged(recipe: str, overrides: Sequence[str], machine: Machine | None) -> Iterator[Candidate | tuple[_Block, str]]:
    """Every layout judged, in `layouts`' order: a Candidate each, or (block, reason) for a whole block that the
    resolver refuses for its tp or pp alone (`_shape_scope`; asked once, at the first layout of that tp or pp)."""
    loaded = load_recipe(recipe, overrides)
    base = resolve(loaded)
    fitting_without_offload: set[str] = set()
    refused_by_shape: dict[tuple[str, int], str] = {}

    def known(block: _Block) -> str | None:
        return refused_by_shape.get(("tp", block.tp)) or (
            refused_by_shape.get(("pp", block.pp)) if _splits_by_tp(base.model, block.tp) else None)

    for block in _blocks(base, loaded.where):
        whole = known(block)
        if whole:
            yield block, whole
            continue
        for i, (label, ov) in enumerate(block.layouts()):
            offloaded = " off=" in label
            if offloaded and label.split(" off=")[0] in fitting_without_offload:
                continue  # the same layout fits without offloading, which only adds time
            if known(block):  # refused earlier in this block for its tp or pp
                yield Candidate(label, ov, None, known(block))
                continue
            try:
                plan = plan_resolved(resolve(with_overrides(loaded, ov)), machine)
            except ConfigError as e:
                why = f"{e.field}: {e.problem}"
                scope = _shape_scope(base.model, block, e)
                if scope is not None:
                    refused_by_shape[scope] = why
                    if i == 0:  # the block's first layout: the refusal is every one of its layouts'
                        yield block, why
                        break
                yield Candidate(label, ov, None, why)
                continue
            why = ""
            if not plan.fits:
                worst = plan.worst()
                why = (f"needs {worst.memory[worst.implementation].total / GiB:.2f} GiB on {worst.kind}, "
                       f"{worst.usable_bytes / GiB:.2f} usable" if not all(rp.fits for rp in plan.ranks) else
                       f"needs {plan.host_bytes_per_node / GiB:.1f} GiB host per node, "
                       f"{plan.host_usable_bytes / GiB:.1f} usable")
            elif not offloaded:
                fitting_without_offload.add(label)
            yield Candidate(label, ov, plan, why)


def candidates(recipe: str, overrides: Sequence[str], machine: Machine | None = None) -> list[Candidate]:
    """Every layout of the recipe's model on its devices, planned for `machine` (launch.config.calibration.Machine;
    None: nominal figures only), each listed. The resolver is asked once for a tp or pp the model's shape refuses;
    the layouts under it are listed with its answer. `search` counts them instead."""
    out: list[Candidate] = []
    for item in _judged(recipe, overrides, machine):
        if isinstance(item, Candidate):
            out.append(item)
        else:
            block, why = item
            out.extend(Candidate(label, ov, None, why) for label, ov in block.layouts())
    return out


def search(recipe: str, overrides: Sequence[str], machine: Machine | None = None) -> Recommendation:
    """`recommend(candidates(recipe, overrides, machine))`, with the layouts refused for their tp or pp counted rather
    than listed: what the recommendation shows (the ranking, the reasons counted) costs work in proportion to the
    layouts the resolver and the planner judge, not to the layouts that a shape refusal covers."""
    weighted: list[tuple[Candidate, int]] = []
    for item in _judged(recipe, overrides, machine):
        if isinstance(item, Candidate):
            weighted.append((item, 1))
        else:
            block, why = item
            label, ov = next(block.layouts())
            weighted.append((Candidate(label, ov, None, why), block.size()))
    return _tally(weighted)


def ranked(cands: Sequence[Candidate]) -> list[Candidate]:
    """The layouts that fit, fastest first, of the best-founded timing any has (calibrated, then fitted, then
    nominal): measured passes, the compute model on this machine's figures and the data sheet's do not compare."""
    fit = [c for c in cands if c.fits]
    for timing in ("calibrated", "fitted"):
        if any(c.plan.step.timing == timing for c in fit):
            fit = [c for c in fit if c.plan.step.timing == timing]
            break
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
    return _tally([(c, 1) for c in cands])


def _tally(weighted: Sequence[tuple[Candidate, int]]) -> Recommendation:
    """The recommendation of candidates each standing for `n` layouts (n > 1: refused layouts, counted, not listed)."""
    cands = [c for c, _ in weighted]
    fit = ranked(cands)
    chosen = {id(c) for c in fit}
    too_big = [c for c in cands if c.plan is not None and not c.fits]
    reasons: dict[str, int] = {}
    for c, count in weighted:
        if c.plan is None:
            why = c.refused
        elif not c.fits:
            why = "does not fit"
        elif id(c) not in chosen:  # fits, but the calibration does not time it
            note = next((n for n in c.plan.notes if n.startswith("time:")), "time: nominal")
            why = "not ranked with the calibrated ones: " + note.split("because ", 1)[-1]
        else:
            continue
        reasons[why] = reasons.get(why, 0) + count
    return Recommendation(sum(count for _, count in weighted), sum(c.fits for c in cands), tuple(fit),
                          tuple(sorted(reasons.items(), key=lambda kv: -kv[1])),
                          None if fit else min(too_big, key=Candidate.overflow_bytes, default=None))
