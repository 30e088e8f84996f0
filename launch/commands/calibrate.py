"""`python -m launch calibrate [recipes/NAME] [key=value ...] [out=PATH]`: measure this machine for the planner.

On the ranks the recipe would train on (CPU ranks here, GPUs there) it runs
  1. the commbench sweep (launch/ranks/commbench.py) once per group size the layouts of this world can use, every group
     at once, with compute interleaved between the calls as in a step (`commbench.interleave_us`), before the
     figures below and again after them, and fits a latency + bandwidth line per collective and group size over
     both sweeps' points (launch/config/calibration.py);
  2. one probe per local rank at the same time (launch/ranks/calibrate_rank.py): torch Adam over flat partitions,
     making the micro-batches, and GEMMs, a streaming add and sdpa attention, to which the compute model's figures
     are fitted (launch.config.calibration.Fitted: what times the layouts the passes do not cover);
  3. per backend and TP degree, the backend's own trainer on every rank of a node (launch/ranks/calibrate_pass.py):
     forward and backward for every micro-batch size and activation-checkpointing mode, TP collectives included,
     and where the forward goes (before, inside and after the decoder layers: the planner's pipeline stages),
     and at tp = 1 whole train_steps per ZeRO stage, whose part the rest does not explain is the engine's own cost;
and writes a calibration file that `hardware.profile=PATH` accepts. Every figure says how and when it was
measured. Nothing existing is replaced: `out` must not exist.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from launch import REPO_ROOT
from launch.comm.commbench_spec import read_result
from launch.commands.args import Option, read, text, whole
from launch.config import calibration as cal
from launch.config.calibration import (
    FILE_NAME,
    MEASURED_PACKAGES,
    OPS,
    RUNS_FOLDER,
    AlphaBeta,
    Calibration,
    Compute,
    EngineCost,
    Fitted,
    GemmPoint,
    Pass,
    fit_alpha_beta,
)
from launch.config.backends import traits
from launch.config.commbench import groups_of
from launch.config.grid import divisors
from launch.config.resolve import Resolved, resolve_path
from launch.commands.run import check_inputs
from launch.errors import ConfigError
from launch.plan.compute import fit_gemm, flash_attention_flops
from launch.plan.search import MAX_MICRO_BATCH
from launch.run import envinfo, launcher
from launch.outputs import file_problem, write_atomic, write_new
from launch.run.rundir import RunDir

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "tiny_zero2"
INTERLEAVE_US = 500.0  # compute between calls: about one decoder layer's forward of a small model on a CPU rank


USAGE = ("usage: python -m launch calibrate [recipes/NAME] [key=value ...] [out=PATH] [backends=NAME,...] "
         "[iters=N]")
ITERS = cal.ITERS
WARMUP_ITERS = 3


@dataclass(frozen=True)
class Args:
    recipe: str
    overrides: list[str]
    out: str | None
    backends: tuple[str, ...]  # whose passes to time: every installed backend unless named
    iters: int = ITERS


def _backends(value: str) -> tuple[str, ...]:
    from launch.config.backends import BACKENDS

    names = tuple(b for b in value.split(",") if b)
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"names no backend ({', '.join(unknown) or 'empty'}); name some of: {', '.join(BACKENDS)}")
    return names


OPTIONS = (Option("out", "the calibration file to write (default runs/calibration/<stamp>/calibration.json)", text),
           Option("backends", "whose passes to time, comma separated (default: every installed backend)", _backends),
           Option("iters", f"timed iterations per pass, 3-10000 (default {ITERS}; fewer is faster and noisier)",
                  whole(3, 10_000), ITERS))


def parse(args: Sequence[str]) -> Args:
    from launch.config.backends import BACKENDS

    a = read(args, command="calibrate", usage=USAGE, options=OPTIONS, positional=(0, 1), overrides=True)
    backends = a.options["backends"] or tuple(name for name, t in BACKENDS.items() if not t.missing_packages())
    if not backends:
        raise ConfigError("command line", "backends", "(none installed)", "no training backend can be imported here",
                          "install the project (python -m pip install -e .) or name one with backends=NAME")
    return Args(a.positional[0] if a.positional else str(DEFAULT_RECIPE), list(a.overrides), a.options["out"],
                backends, a.options["iters"])


def cmd_calibrate(args: Sequence[str]) -> int:
    a = parse(args)
    recipe, overrides, out_arg = a.recipe, a.overrides, a.out
    resolved = resolve_path(recipe, overrides)
    if not resolved.hardware.nominal:
        raise ConfigError(resolved.recipe_path, "hardware.profile", resolved.recipe.hardware.profile,
                          "is already a calibration", "name the nominal profile to measure against, e.g. hardware.profile=cpu")
    # checked as given: resolved first, a dangling link would name its missing target, which may be created
    problem = out_arg and file_problem(Path(out_arg).expanduser(), ours=lambda _: False,
                                       writer="calibrate, which never replaces a file")
    out = Path(out_arg).expanduser().resolve() if out_arg else None
    if problem or (out is not None and not out.parent.is_dir()):
        raise ConfigError("command line", "out", out_arg, problem or f"is in a folder that does not exist ({out.parent})",
                          "choose a new path in a folder that exists")
    resolved, data = check_inputs(resolved)  # its ranks read the recipe's rows: one line here, not a traceback there
    root = RunDir.create(RUNS_FOLDER).root  # only once the arguments are known good
    if data is not None:
        data.save(RunDir(root).data, write_atomic)  # every pass maps the one tokenized corpus
    out = out or root / FILE_NAME
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    gpn = resolved.recipe.hardware.gpus_per_node
    expected = cal.expected_s(resolved.world_size, gpn, len(a.backends), a.iters)
    every, passes = cal.launches(resolved.world_size, gpn, len(a.backends))
    print(f"calibrate: {resolved.recipe_name} ({resolved.model.name}, {resolved.recipe.precision.dtype}, seq_len "
          f"{resolved.recipe.batch.seq_len}) on {resolved.world_size} {resolved.hardware.name} rank(s); work in {root}",
          flush=True)
    print(f"calibrate: about {expected / 60:.0f} min ({every} launches of ranks, {passes} of them timing {a.iters} "
          f"iterations per pass; as measured on a 2-core CPU machine: fewer backends= or iters= take less)", flush=True)
    notes: list[str] = []
    # The collectives are swept before the compute figures and again after them, and fitted on both: one sweep
    # measures each size within ~50 ms, one phase of gloo's latency, which moves from second to second on a shared
    # machine (here all_gather's α came out 393 µs in one calibration and 627 µs in the next, and the engine costs
    # taken against it moved with it); the two sweeps span the minutes the compute figures took.
    clock = _Stages(3)
    clock.next("collectives, first sweep")
    try:
        first = _collectives(recipe, overrides, resolved, root, "first", notes)
        clock.next(f"compute: {', '.join(a.backends)} passes and whole steps ({a.iters} timed iterations each)")
        compute, samples = _compute(recipe, overrides, resolved, root, a.backends, a.iters, notes)
        clock.next("collectives, second sweep")
        last = _collectives(recipe, overrides, resolved, root, "last", notes)
    except MeasurementFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    clock.done(expected)
    calib = Calibration(created=started, machine_kind=envinfo.machine_kind(),
                        versions={k: v for k, v in envinfo.package_versions().items() if k in MEASURED_PACKAGES},
                        base_profile=resolved.hardware.name, world_size=resolved.world_size,
                        ranks_per_node=resolved.recipe.hardware.gpus_per_node, collectives=tuple(_fit(first, last)),
                        compute=compute)
    calib = dataclasses.replace(calib, compute=dataclasses.replace(compute, engine=_engine_costs(calib, samples, notes)),
                                notes=tuple(notes))
    # Written whole, then linked into place: a file that appeared at `out` meanwhile stays.
    text = (json.dumps(calib.to_dict(), indent=2) + "\n").encode("utf-8")
    if not write_new(out, lambda f: f.write(text)):
        write_new(root / FILE_NAME, lambda f: f.write(text))
        raise ConfigError("command line", "out", str(out), "appeared while calibrating; calibrate never replaces a file",
                          f"the measurements are kept in {root / FILE_NAME}: move it where you want it")
    _print_figures(calib)
    noise = [n for n in notes if n.endswith(NOISE)]
    for n in notes:
        if not n.endswith(NOISE):
            print(f"  note: {n}")
    engine_terms = 3 * len(calib.compute.engine) if calib.compute else 0
    for line in verdict(first, last, len(noise), engine_terms).lines():
        print(line)
    print(f"wrote {out}\nuse it: hardware.profile={out}")
    return 0


def _print_figures(calib: Calibration) -> None:
    """What the calibration measured, a line a figure: the collectives' α and β, every pass, the engine costs, the
    compute model's fitted rates."""
    for c in calib.collectives:
        beta = "∞" if c.beta_Bps == float("inf") else f"{c.beta_Bps / 1e9:.3f} GB/s"
        print(f"  {c.op:<15} {c.group_size} ranks: α = {c.alpha_s * 1e6:8.1f} µs, β = {beta}")
    if calib.compute:  # the engine costs are calib's: `compute` still holds the zeros they were fitted from
        for p in calib.compute.passes:
            print(f"  {p.backend} pass tp={p.tp}{' sp' if p.sp else ''} micro_batch_size={p.micro_batch_size} ac={p.activation_checkpointing:<4}: "
                  f"forward {p.forward_s * 1e3:7.2f} ms, backward {p.backward_s * 1e3:7.2f} ms")
        for e in calib.compute.engine:
            print(f"  {e.backend} engine ZeRO-{e.zero_stage}: +{e.micro_step_s * 1e3:.2f} ms per micro-step, "
                  f"+{e.step_s * 1e3:.2f} ms per step, +{e.recompute_s * 1e3:.2f} ms per micro-step under full "
                  "checkpointing")
        f = calib.compute.fitted
        print(f"  compute model's figures at {f.dtype}: GEMMs up to {f.gemm_tflops:.3g} TFLOP/s (each dimension at "
              f"{f.gemm_half_dim:.0f} halves it), streaming {f.memory_GBps:.3g} GB/s, sdpa forward "
              f"{f.attention_forward_tflops:.3g} / backward {f.attention_backward_tflops:.3g} TFLOP/s")


class _Stages:
    """Progress a person waits minutes for: which of the stages runs, and the time so far."""

    def __init__(self, total: int) -> None:
        self.total, self.index, self.start = total, 0, time.monotonic()

    def next(self, what: str) -> None:
        self.index += 1
        print(f"[{self.index}/{self.total}] {what} ({time.monotonic() - self.start:.0f} s so far)", flush=True)

    def done(self, expected_s: float) -> None:
        print(f"measured in {time.monotonic() - self.start:.0f} s (expected about {expected_s:.0f} s)", flush=True)


STEADY_SPREAD = 0.15  # the two collective sweeps agree within this (median over sizes) on a quiet machine


@dataclass(frozen=True)
class Verdict:
    """How far to trust a calibration: how much its repeated collective sweeps disagree (the same sizes measured
    minutes apart), and how many engine-cost terms came out negative (noise, taken as 0)."""

    spread_median: float | None  # |first - second| / mean over every size both sweeps timed
    spread_worst: float | None
    worst: str  # the collective and size of the worst disagreement
    noise_terms: int
    engine_terms: int

    @property
    def steady(self) -> bool:
        return ((self.spread_median is None or self.spread_median <= STEADY_SPREAD)
                and self.noise_terms * 4 <= self.engine_terms)

    def lines(self) -> list[str]:
        spread = ("the two collective sweeps agree within a median "
                  f"{self.spread_median:.0%} (worst {self.spread_worst:.0%}, {self.worst})"
                  if self.spread_median is not None else "no collective was swept twice")
        noise = (f"{self.noise_terms} of {self.engine_terms} engine-cost terms came out negative (noise) and were "
                 "taken as 0 (the file's notes list them)")
        head = ("verdict: steady" if self.steady else
                "verdict: noisy: re-run on a quiet machine, or with more iterations (iters=)")
        return [f"{head}; {spread}; {noise}"]


def verdict(first: Sequence[Sweep], last: Sequence[Sweep], noise_terms: int, engine_terms: int) -> Verdict:
    """The Verdict of a calibration from its two sweeps (matched by collective, group size, link and message size)."""
    later = {(s.op, s.group_size, s.link): dict(s.points) for s in last}
    spreads = []
    for s in first:
        again = later.get((s.op, s.group_size, s.link), {})
        for size, t in s.points:
            if size in again and t + again[size] > 0:
                spreads.append((abs(t - again[size]) / ((t + again[size]) / 2), f"{s.op} {s.group_size} ranks {size} B"))
    if not spreads:
        return Verdict(None, None, "", noise_terms, engine_terms)
    worst = max(spreads)
    return Verdict(statistics.median(x for x, _ in spreads), worst[0], worst[1], noise_terms, engine_terms)


# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Sweep:
    """One commbench sweep of one collective on one group size: its measured (bytes, seconds per call) points."""

    op: str
    group_size: int
    link: str
    points: tuple[tuple[int, float], ...]
    how: str


def _fit(*sweeps: list[Sweep]) -> list[AlphaBeta]:
    """α–β per collective, group size and link over the points of every sweep of it."""
    keys = list(dict.fromkeys((s.op, s.group_size, s.link) for sw in sweeps for s in sw))
    out = []
    for key in keys:
        same = [s for sw in sweeps for s in sw if (s.op, s.group_size, s.link) == key]
        points = tuple(pt for s in same for pt in s.points)
        alpha, beta = fit_alpha_beta(points)
        out.append(AlphaBeta(*key, alpha, beta, points, "; ".join(s.how for s in same)
                             + f"; least-squares fit of relative error over the {len(same)} sweeps' points"))
    return out


def _collectives(recipe: str, overrides: list[str], resolved: Resolved, root: Path, when: str,
                 notes: list[str]) -> list[Sweep]:
    """Every collective on every group size of 2 or more that divides the world, from interleaved sweeps."""
    world, out = resolved.world_size, []
    sweep = ["run.mode=commbench", "commbench.ops=[" + ",".join(f'"{op}"' for op in OPS) + "]",
             f"commbench.interleave_us={INTERLEAVE_US:g}", "commbench.step_factor=4", "commbench.iters=30",
             "commbench.warmup_iters=3", "run.resume=never", "run.profile=none"]
    for n in [d for d in divisors(world) if d >= 2]:
        # Smaller groups as the TP groups of a layout (every group at once, consecutive ranks).
        group = ["commbench.group=world"] if n == world else [f"parallel.tp={n}", "commbench.group=tp"]
        try:
            r = resolve_path(recipe, [*overrides, *sweep, *group])
        except ConfigError as e:
            r = resolve_path(recipe, [*overrides, *sweep, "commbench.ranks=[" + ",".join(map(str, range(n))) + "]"])
            if when == "first":
                notes.append(f"{n}-rank groups measured one at a time ({e.problem})")
        run = RunDir.create(f"commbench_{n}_{when}", root=root)
        run.write_text_atomic(run.resolved, r.to_json() + "\n")
        cmd = launcher.build(r, str(run.root))
        print(f"calibrate: collectives on {n}-rank groups ({when} commbench sweep, {INTERLEAVE_US:g} µs of compute "
              f"between calls) -> {run.root}", flush=True)
        _launch(cmd, run.root / "calibrate.log", f"the commbench sweep on {n} ranks")
        for op in OPS:
            res = read_result(run.commbench_json(op))
            points = tuple((row["size_bytes"], row["time_us"] * 1e-6) for row in res["rows"])
            out.append(Sweep(op, n, "inter_node" if r.grid.spans_nodes(groups_of(r.recipe.commbench, r.grid)[0])
                             else "intra_node", points,
                             f"{when} commbench sweep {run.root.parent.name}/{run.root.name}: {res['iters']} calls per "
                             f"size after {res['warmup_iters']} warm-up, each after {INTERLEAVE_US:g} µs of matmul work "
                             f"(subtracted), both placements; mean over ranks"))
    return out


# --------------------------------------------------------------------------- compute


def _log_tail(log: Path, lines: int) -> list[str]:
    """The last `lines` non-blank lines of a log (none if it cannot be read)."""
    try:
        return [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-lines:]
    except OSError:
        return []


class MeasurementFailed(Exception):
    """A launch of measuring ranks that exited non-zero: what it measured, its exit code, and the log whose last lines
    say why (the ranks' own traceback; without them a user, or CI, sees only that it failed)."""

    TAIL_LINES = 25

    def __init__(self, what: str, rc: int, log: Path) -> None:
        super().__init__(f"{what} failed (exit {rc}); the end of {log}:"
                         + "".join(f"\n  | {line}" for line in _log_tail(log, self.TAIL_LINES)))


def _launch(cmd, log: Path, what: str, retry_notes: list[str] | None = None) -> None:
    """Run a launcher command (launcher.build's) to its end, its output into `log`. Given `retry_notes`, a launch that
    fails is made once more (measuring ranks write nothing until they end, and a shared machine can fail a launch
    that the same code then runs through), the first failure kept beside the log and named in those notes; a second
    failure is the error."""
    tries = 2 if retry_notes is not None else 1
    for attempt in range(1, tries + 1):
        with open(log, "w") as out:
            rc = subprocess.call(list(cmd.argv), env={**os.environ, **cmd.env}, stdout=out, stderr=subprocess.STDOUT)
        if rc == 0:
            return
        if attempt == tries:
            raise MeasurementFailed(what, rc, log)
        kept = log.with_name(f"{log.stem}.failed{log.suffix}")
        os.replace(log, kept)
        said = (_log_tail(kept, 1) or ["no output"])[0].strip()
        print(f"calibrate: {what} failed (exit {rc}: {said}); launching it once more (log: {kept})", flush=True)
        retry_notes.append(f"{what}: the first launch failed (exit {rc}: {said}; {kept}), the second measured")


@dataclass(frozen=True)
class StepSample:
    """The median train_step of the real trainer at one ZeRO stage (tp = 1, micro-batch 1, every rank of a node)."""

    backend: str
    zero_stage: int
    grad_accum: int
    activation_checkpointing: str
    step_s: float
    resolved: Resolved


STEP_VARIANTS = ((1, "none"), (2, "none"), (1, "full"))  # (micro-batches per step, checkpointing)
STEP_ITERS_FACTOR = 1.5  # whole steps are timed this many times as often as passes (they vary more)
ENGINE_FIT_ROUNDS = 4
NOISE = " (noise): taken as 0"  # how a negative engine-cost term is noted


def _in_situ(recipe: str, overrides: list[str], resolved: Resolved, root: Path, backends: Sequence[str],
             mbs: list[int], iters: int, notes: list[str]) -> tuple[tuple[Pass, ...], list[StepSample]]:
    """Per backend and TP degree, on every rank of one node at once (launch/ranks/calibrate_pass.py): forward and backward
    of the backend's own model per micro-batch, TP collectives included; and at tp = 1 whole train_steps per ZeRO
    stage (STEP_VARIANTS), from which `_engine_costs` takes the engine's own cost."""
    gpn = resolved.recipe.hardware.gpus_per_node
    passes, samples = [], []
    for name in backends:
        bt = traits(name)
        acs = ["none", "full", *(["selective"] if "selective" in bt.features else [])]
        for tp in divisors(gpn):
            modes = [(ac, sp) for ac in acs for sp in ((False, True) if tp > 1 and "sp" in bt.features else (False,))]
            base = [*overrides, f"backend={name}", f"parallel.tp={tp}", "parallel.pp=1", "parallel.vpp=1",
                    "parallel.dp=auto", "hardware.nodes=1", "batch.micro_batch_size=1",
                    "parallel.offload_optimizer=none", "parallel.offload_params=none", "run.resume=never",
                    "run.profile=none", "peft.method=none"]  # full training's passes, which a plan's calibration times
            # The passes time the model alone: ZeRO-0 where the backend builds it with this TP degree, else its lowest
            # stage that does (torch: FSDP2, whose gathers over dp = 1 within a node are local copies).
            lowest = min(bt.tp_zero_stages) if tp > 1 else min(bt.zero_stages)
            one = [f"batch.global_batch_size={gpn // tp}", f"parallel.zero_stage={lowest}"]
            variants = {}
            for ac, sp in modes:  # each on its own: one mode the resolver refuses leaves the others measured
                try:
                    variants[(ac, sp)] = resolve_path(recipe, [*base, *one, f"train.activation_checkpointing={ac}",
                                                               f"parallel.sp={str(sp).lower()}"])
                except ConfigError as e:
                    notes.append(f"no {name} passes at tp={tp}, activation_checkpointing={ac}, sp={sp}: {e.field} "
                                 f"{e.problem}")
            if not variants:
                continue
            modes = list(variants)
            steps = {}
            for z in bt.zero_stages if tp == 1 else ():
                try:
                    for ga, ac in STEP_VARIANTS:
                        steps[(z, ga, ac)] = resolve_path(recipe, [*base, "parallel.sp=false", f"parallel.zero_stage={z}",
                                                                   f"batch.global_batch_size={gpn * ga}",
                                                                   f"train.activation_checkpointing={ac}"])
                except ConfigError as e:
                    notes.append(f"no {name} engine cost at zero_stage={z}: {e.field} {e.problem}")
                    for key in [k for k in steps if k[0] == z]:
                        del steps[key]
            run = RunDir.create(f"in_situ_{name}_tp{tp}", root=root)
            first = variants[modes[0]]
            run.write_text_atomic(run.resolved, first.to_json() + "\n")
            spec = {"variants": [], "steps": [], "micro_batch_sizes": mbs, "warmup_iters": WARMUP_ITERS, "iters": iters,
                    "step_iters": int(iters * STEP_ITERS_FACTOR), "data": str(RunDir(root).data)}
            for (ac, sp), r in variants.items():
                path = run.root / f"resolved_{ac}_sp{int(sp)}.json"
                run.write_text_atomic(path, r.to_json() + "\n")
                spec["variants"].append({"activation_checkpointing": ac, "sp": sp, "resolved": str(path)})
            for (z, ga, ac), r in steps.items():
                path = run.root / f"resolved_zero{z}_ga{ga}_{ac}.json"
                run.write_text_atomic(path, r.to_json() + "\n")
                spec["steps"].append({"zero_stage": z, "grad_accum": ga, "activation_checkpointing": ac,
                                      "resolved": str(path)})
            run.write_text_atomic(run.root / cal.PASS_SPEC_FILE, json.dumps(spec, indent=1) + "\n")
            cmd = launcher.build(first, str(run.root), module="launch.ranks.calibrate_pass")
            print(f"calibrate: {name} at tp={tp} on {gpn} rank(s): passes at micro_batch_size {mbs}, "
                  f"activation_checkpointing {'/'.join(acs)}{', sp off/on' if len(modes) > len(acs) else ''}"
                  + (f"; train_step at ZeRO-{sorted({k[0] for k in steps})}" if steps else "") + f" -> {run.root}",
                  flush=True)
            _launch(cmd, run.root / "calibrate.log", f"the {name} measurements at tp={tp}", notes)
            doc = json.loads((run.root / cal.PASS_RESULT_FILE).read_text())
            for p in doc["passes"]:
                passes.append(Pass(name, tp, p["sp"], p["micro_batch_size"], p["activation_checkpointing"],
                                   p["forward_s"], p["backward_s"], p["embedding_forward_s"], p["layers_forward_s"],
                                   p["sd_s"]))
            for st in doc["steps"]:
                key = (st["zero_stage"], st["grad_accum"], st["activation_checkpointing"])
                samples.append(StepSample(name, *key, st["step_s"], steps[key]))
    return tuple(passes), samples


def _engine_costs(partial: Calibration, samples: list[StepSample], notes: list[str]) -> tuple[EngineCost, ...]:
    """The engine's own cost per backend and ZeRO stage: what of each measured train_step the planner does not
    explain without it (passes, data, Adam, the collectives on their α–β curves, the ranks' skew), split into a
    part per micro-step (one vs two micro-batches per step), one per step, and one per micro-step under full
    checkpointing (ZeRO-3 re-fetches during the recompute). Where collectives overlap compute (NCCL) the cost
    changes how much traffic hides, so the split is refined until the plans meet the measured steps."""
    from launch.plan.collectives import communication
    from launch.plan.layout import Layout
    from launch.plan.time import step_time
    from launch.plan.timing import Timing

    keys = sorted({(s.backend, s.zero_stage) for s in samples})
    costs = {k: {"micro_step_s": 0.0, "step_s": 0.0, "recompute_s": 0.0} for k in keys}
    by_key = {(s.backend, s.zero_stage, s.grad_accum, s.activation_checkpointing): s for s in samples}
    for _ in range(ENGINE_FIT_ROUNDS):  # one round is exact where nothing overlaps (gloo)
        engine = tuple(EngineCost(b, z, **costs[(b, z)]) for b, z in keys)
        calib = dataclasses.replace(partial, compute=dataclasses.replace(partial.compute, engine=engine))
        timing = Timing(calib)
        gap = {}
        for key, smp in by_key.items():
            layout = Layout.from_resolved(smp.resolved)
            gap[key] = smp.step_s - step_time(layout, communication(layout, timing), timing).total_s
        for b, z in keys:
            one, two, full = (gap[(b, z, ga, ac)] for ga, ac in STEP_VARIANTS)
            c = costs[(b, z)]
            c["micro_step_s"] += two - one
            c["step_s"] += 2 * one - two
            c["recompute_s"] += full - one
    out = []
    for b, z in keys:
        c = costs[(b, z)]
        for part, value in c.items():
            if value < 0:  # the engine cannot save time: noise around zero
                notes.append(f"{b} ZeRO-{z} engine {part[:-2].replace('_', '-')} cost came out "
                             f"{value * 1e3:.2f} ms{NOISE}")
                c[part] = 0.0
        out.append(EngineCost(b, z, **c))
    return tuple(out)


# What the compute model's figures are fitted to, per rank: square GEMMs from this side (a GPU's below 256 are all
# launch, no curve) up to this many FLOPs (the CPU's 2^10 square takes ~15 ms at fp32 on one core, a GPU's 2^14
# ~10 ms), besides the model's own; sdpa at the model's shapes, one sequence where the micro-batch would pass the same
# bound ×4; an add over this many elements (4× a CPU core's last-level cache share; a GPU's streams at full rate past
# ~1 GiB).
GEMM_SMALLEST_LOG2 = {"cpu": 5, "cuda": 8}
GEMM_FLOPS_MAX = {"cpu": 2.2e9, "cuda": 9e12}
MEMORY_NUMEL = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}


def fitted_spec(resolved: Resolved, micro_batch_size: int, iters: int) -> dict:
    """The GEMM shapes, add and attention calibrate_rank times for Fitted: squares for the curve's best rate, and every
    GEMM of a decoder layer and the output layer at the largest micro-batch and at tp = 1 and the node's largest TP
    degree (thin shapes, which set the half dimension)."""
    m, device = resolved.model, resolved.hardware.device_type
    tokens = micro_batch_size * resolved.recipe.batch.seq_len
    shapes = {(2**i,) * 3 for i in range(GEMM_SMALLEST_LOG2[device], 15) if 2.0 * 8**i <= GEMM_FLOPS_MAX[device]}
    for t in sorted({1, resolved.recipe.hardware.gpus_per_node}):
        q, kv, f = m.num_heads * m.head_dim // t, m.num_kv_heads * m.head_dim // t, m.intermediate_size // t
        for n, k in ((q, m.hidden_size), (kv, m.hidden_size), (m.hidden_size, q), (f, m.hidden_size),
                     (m.hidden_size, f), (m.vocab_size // t, m.hidden_size)):
            if 2.0 * tokens * n * k <= GEMM_FLOPS_MAX[device]:
                shapes.add((tokens, n, k))
    seq = resolved.recipe.batch.seq_len
    forward, _ = flash_attention_flops(micro_batch_size, m.num_heads, seq, m.head_dim)
    batch = micro_batch_size if forward <= 4 * GEMM_FLOPS_MAX[device] else 1
    return {"dtype": resolved.recipe.precision.dtype, "gemm_shapes": sorted(shapes), "fitted_iters": iters,
            "memory_numel": MEMORY_NUMEL[device],
            "attention": {"batch": batch, "heads": m.num_heads, "seq": seq, "head_dim": m.head_dim}}


def fit_figures(spec: dict, docs: list[dict]) -> Fitted:
    """The compute model's figures from every rank's timings (the ranks ran at once, as training ranks do): per shape
    the mean over ranks, then fit_gemm; the add's bytes over its mean time; sdpa's FLOPs (the compute model's count)
    over its mean times."""
    points = [GemmPoint(*shape, statistics.fmean(d["gemms"][i]["seconds"] for d in docs))
              for i, shape in enumerate(map(tuple, spec["gemm_shapes"]))]
    rate, half_dim = fit_gemm(points)
    att = spec["attention"]
    forward, backward = flash_attention_flops(att["batch"], att["heads"], att["seq"], att["head_dim"])
    return Fitted(dtype=spec["dtype"], gemm_tflops=rate / 1e12, gemm_half_dim=half_dim,
                  memory_GBps=docs[0]["memory_bytes"] / statistics.fmean(d["add_s"] for d in docs) / 1e9,
                  attention_forward_tflops=forward / statistics.fmean(d["attention_forward_s"] for d in docs) / 1e12,
                  attention_backward_tflops=backward / statistics.fmean(d["attention_backward_s"] for d in docs) / 1e12,
                  gemm_points=tuple(points))


def _compute(recipe: str, overrides: list[str], resolved: Resolved, root: Path, backends: Sequence[str], iters: int,
             notes: list[str]) -> tuple[Compute, list[StepSample]]:
    """The compute figures with engine costs of 0, and the whole steps that `_engine_costs` takes them from (against
    the collectives, which are swept again after these)."""
    m, r = resolved.model, resolved.recipe
    gpn = r.hardware.gpus_per_node
    mbs = [b for b in divisors(r.batch.global_batch_size) if b <= max(MAX_MICRO_BATCH, r.batch.micro_batch_size)]
    total = m.param_counts().total
    cuda = resolved.hardware.device_type == "cuda"
    spec = {"resolved": str(root / "resolved.json"), "micro_batch_sizes": mbs, "data": str(RunDir(root).data),
            "adam_numels": [max(1, total // d) for d in (1, 2, 4, 8)], "warmup_iters": WARMUP_ITERS, "iters": iters,
            **fitted_spec(resolved, max(mbs), max(1, iters // 4))}
    (root / "resolved.json").write_text(resolved.to_json() + "\n")
    (root / cal.RANK_SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    threads = launcher.cpu_threads(gpn)
    print(f"calibrate: Adam and making the micro-batches on {gpn} concurrent world-1 process(es), {threads} "
          "thread(s) each", flush=True)
    procs = []
    for i in range(gpn):
        # The training launch's environment (DS_ACCELERATOR, threads per rank, extensions), as a world of 1.
        env = {**os.environ, **launcher.build(resolved, str(root)).env, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(launcher.free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        log = open(root / "logs" / f"compute_{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "launch.ranks.calibrate_rank", str(root), str(i)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:  # every probe to its end: none is left running behind an error
        codes.append(p.wait())
        log.close()
    for i, rc in enumerate(codes):
        if rc != 0:
            raise MeasurementFailed(f"compute probe {i}", rc, root / "logs" / f"compute_{i}.log")
    docs = [json.loads(cal.compute_file(root, i).read_text()) for i in range(gpn)]
    passes, samples = _in_situ(recipe, overrides, resolved, root, backends, mbs, iters, notes)
    compute = Compute(model=m.name, dtype=r.precision.dtype, seq_len=r.batch.seq_len, threads_per_rank=docs[0]["threads"],
                      passes=passes, engine=tuple(EngineCost(b, z, 0.0, 0.0, 0.0) for b in backends
                                   for z in traits(b).zero_stages),
                      adam_alpha_s=statistics.fmean(d["adam_alpha_s"] for d in docs),
                      adam_s_per_param=statistics.fmean(d["adam_s_per_param"] for d in docs),
                      data_s={b: statistics.fmean(d["data_s"][b] for d in docs) for b in docs[0]["data_s"]},
                      fitted=fit_figures(spec, [d["fitted"] for d in docs]),
                      how=(f"passes: each backend's own model on all {gpn} ranks of a node at once, in tp-rank groups "
                           f"(TP collectives included, no gradient reduction or step), medians of {iters} iterations after "
                           f"{WARMUP_ITERS} warm-up, mean over ranks; engine costs: the real trainer's train_step at each ZeRO stage "
                           f"(tp=1, micro_batch_size=1, (micro-batches per step, checkpointing) in {list(STEP_VARIANTS)} "
                           f"in turn; medians of {int(iters * STEP_ITERS_FACTOR)}), less "
                           f"what the planner explains without the engine; Adam and data: {gpn} concurrent world-1 "
                           f"processes ({docs[0]['threads']} threads each), torch Adam fitted over {spec['adam_numels']} "
                           f"elements; measured {dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"))
    return compute, samples
