"""Measured hardware figures: the calibration file `python -m launch calibrate` writes and the planner reads.

A calibration is a hardware profile (`hardware.profile=PATH`) whose time figures were measured on the machine
that trains, at the model's shapes: per collective and group size a latency + bandwidth (α–β) fit of calls
interleaved with compute as in a training step, and per op class (forward and backward in situ, Adam, making
the micro-batches, the engine's own work per backend and ZeRO stage from real steps) a measured time. Every figure says how and when it
was measured. The nominal profiles in launch/config/catalogue/hardware stay for hardware one does not have.

No torch import: the planner, the resolver and the analysis read this module.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from launch import inputs, sense
from launch.config.grid import divisors
from launch.errors import ConfigError

KIND = "layoutlab-calibration"

# The files `python -m launch calibrate` and its rank programs (launch/ranks/calibrate_*.py) exchange in its working
# folders: one home, so that the command never imports the rank side for a name.
PASS_SPEC_FILE = "calibrate_pass.json"  # what the in-situ pass times, written by the command
PASS_RESULT_FILE = "passes.json"  # what it measured, written by rank 0
RANK_SPEC_FILE = "calibrate_spec.json"  # what the per-rank probes time


@dataclass(frozen=True)
class Machine:
    """The machine a plan is for, as data: its kind (launch.run.envinfo.machine_kind) and installed package versions.
    The planner never probes a machine itself: the command that plans passes the one it runs on, the report the one a
    run's env.json recorded. A calibration times a layout only on a machine like the one it was measured on."""

    kind: str
    versions: Mapping[str, str | None]


def compute_file(calib_dir: Path, index: int) -> Path:
    """What the per-rank probe of local rank `index` measured."""
    return calib_dir / f"compute_{index}.json"
VERSION = 4  # 2: passes timed in situ per backend, TP collectives included; 3: where the forward goes, send_recv;
# 4: the compute model's figures (GEMM curve, bandwidth, attention) fitted on the machine
# The collectives the planner times from a calibration (pipeline stages send and receive, and the last one
# broadcasts the loss); calibrate measures each on every group size a layout of the world can use.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")
# The packages whose speed a calibration measured: another version of either makes it stale.
MEASURED_PACKAGES = ("torch", "deepspeed")
# Where `calibrate` writes by default: runs_root()/RUNS_FOLDER/<stamp>/FILE_NAME; `recommend verify=true` writes its
# fed-back copies beside the file it used, as <stem>.verified-<stamp>.json.
RUNS_FOLDER = "calibration"
FILE_NAME = "calibration.json"
ITERS = 20  # timed iterations per pass, calibrate's default (whole steps: 1.5 × as many), after its warm-up ones

# What calibrate took on the 2-core, 24 GiB CPU machine this project is tested on (tiny_zero2's model, 2 ranks, three
# backends; bench/results/calibrate.txt): each launch of ranks (torchrun, imports, the model built, a sweep or the
# passes' warm-up) and each timed iteration of one pass launch (every micro-batch size and checkpointing mode of it).
LAUNCH_S = 10.0
PASS_ITER_S = 1.15


def launches(world_size: int, gpus_per_node: int, backends: int) -> tuple[int, int]:
    """(every launch of ranks calibrate makes, those that time passes): two collective sweeps per group size of 2 or
    more dividing the world, one Adam and data probe, one pass launch per backend and TP degree of a node."""
    sweeps = 2 * sum(1 for d in divisors(world_size) if d >= 2)
    passes = backends * len(divisors(gpus_per_node))
    return sweeps + 1 + passes, passes


def expected_s(world_size: int, gpus_per_node: int, backends: int, iters: int = ITERS) -> float:
    """About how long calibrate takes on a machine like the one LAUNCH_S and PASS_ITER_S were measured on."""
    every, passes = launches(world_size, gpus_per_node, backends)
    return every * LAUNCH_S + passes * iters * PASS_ITER_S


@dataclass(frozen=True)
class AlphaBeta:
    """t(S) = alpha_s + S / beta_Bps for one call of `op` on `group_size` ranks moving an S-byte message (nccl-tests'
    size: the larger of send and receive buffers)."""

    op: str
    group_size: int
    link: str  # intra_node | inter_node: whether the measured groups spanned nodes
    alpha_s: float
    beta_Bps: float  # math.inf: no size dependence was measurable
    points: tuple[tuple[int, float], ...]  # (bytes, seconds per call) measured
    how: str

    def line(self, nbytes: float) -> float:
        """The fitted α + S/β."""
        return self.alpha_s + (nbytes / self.beta_Bps if math.isfinite(self.beta_Bps) else 0.0)

    def seconds(self, nbytes: float) -> float:
        """One call's time: on the measured curve (linear between the two nearest sizes, the placements averaged)
        inside the measured range, where gloo and NCCL switch algorithms with size and a single line misses by up
        to 2× (gloo, 128 KiB all_reduce on 2 CPU ranks); the fitted line outside it."""
        sizes: dict[float, list[float]] = {}
        for s, t in self.points:
            if t > 0:  # a call measured below the noise of the work around it says nothing about its size
                sizes.setdefault(s, []).append(t)
        curve = sorted((s, sum(ts) / len(ts)) for s, ts in sizes.items())
        if len(curve) < 2 or not curve[0][0] <= nbytes <= curve[-1][0]:
            return self.line(nbytes)
        for (s0, t0), (s1, t1) in zip(curve, curve[1:]):
            if s0 <= nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0) if s1 > s0 else t0
        return self.line(nbytes)


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha_s, beta_Bps) minimising the squared *relative* error over the points, so that 8-byte calls weigh as
    much as 4 MiB ones; alpha is kept >= 0 and beta > 0 (a fit without a positive slope has beta = inf)."""
    pts = [(float(s), float(t)) for s, t in points if t > 0 and math.isfinite(t)]
    if not pts:
        raise ValueError("no positive timings to fit")
    # Weighted least squares for t = a + b·S with weights 1/t²: the 2×2 normal equations.
    w = [1 / t**2 for _, t in pts]
    sw = sum(w)
    sx = sum(wi * s for wi, (s, _) in zip(w, pts, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
    sxx = sum(wi * s * s for wi, (s, _) in zip(w, pts, strict=True))
    sxy = sum(wi * s * t for wi, (s, t) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    a, b = (sy / sw, 0.0) if det <= 0 else ((sy * sxx - sx * sxy) / det, (sw * sxy - sx * sy) / det)
    if a < 0:  # refit through the origin
        a, b = 0.0, (sxy / sxx if sxx else 0.0)
    if b <= 0:  # no measurable size dependence: latency only
        return sy / sw, math.inf
    return a, 1 / b


@dataclass(frozen=True)
class Pass:
    """One rank's forward and backward of one micro-batch through the backend's own parallel model, timed in situ:
    every rank of a node at once, in tp-rank groups, the model's tensor-parallel collectives included (no gradient
    reduction, optimizer or engine hooks: those are timed apart)."""

    backend: str
    tp: int
    sp: bool  # sequence parallelism over the TP group
    micro_batch_size: int
    activation_checkpointing: str  # none | selective | full (full: the backward re-runs every layer's forward)
    forward_s: float
    backward_s: float
    # Of the forward: before the first decoder layer (the embedding) and inside the layers; the rest (final norm,
    # output layer, loss) is forward_s less both. What the planner splits into pipeline stages.
    embedding_forward_s: float
    layers_forward_s: float
    sd_s: float = 0.0  # standard deviation of forward + backward between iterations

    def stage_s(self, layers: float, first: bool, last: bool) -> float:
        """Forward and backward of one micro-batch on a pipeline stage holding `layers` of the layers' share (a
        fraction) and the embedding (`first`) or output layer and loss (`last`): the forward as measured in its
        parts, the backward split in the forward's proportions, except that under full checkpointing the layers'
        forward runs again inside the backward (the layers' alone)."""
        head = self.forward_s - self.embedding_forward_s - self.layers_forward_s
        forward = self.layers_forward_s * layers + self.embedding_forward_s * first + head * last
        rerun = self.layers_forward_s if self.activation_checkpointing == "full" else 0.0
        backward = rerun * layers + max(0.0, self.backward_s - rerun) * forward / self.forward_s
        return forward + backward


@dataclass(frozen=True)
class EngineCost:
    """What a backend's real train_step at one ZeRO stage costs beyond the passes, data, Adam, the collectives on
    their α–β curves and the ranks' skew, measured in situ (tp = 1, micro-batch 1, every rank of a node): the
    DeepSpeed engine's hooks, bucket copies and partition bookkeeping, the waits the α–β curves miss."""

    backend: str
    zero_stage: int
    micro_step_s: float  # per micro-batch
    step_s: float  # per optimizer step
    recompute_s: float  # per micro-batch more under full activation checkpointing (ZeRO-3 fetches again)


@dataclass(frozen=True)
class GemmPoint:
    """One (m × k) · (k × n) GEMM timed on a rank: seconds per call."""

    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class Fitted:
    """The compute model's figures (launch/plan/compute.py) measured on the machine at one dtype, every rank of a node
    at once: the GEMM curve (rate = gemm_tflops × Π x/(x + gemm_half_dim) over m, n, k, fitted to the timed GEMMs),
    the bandwidth an elementwise add streams at, and torch's fused attention (sdpa, causal) forward and backward on
    the kernel's own FLOP count. The calibrated profile carries them (launch.config.hardware.load_profile), so that a
    layout the measured passes do not cover (another model, micro-batch or checkpointing) is timed by the compute
    model on this machine's figures rather than the data sheet's."""

    dtype: str
    gemm_tflops: float
    gemm_half_dim: float
    memory_GBps: float
    attention_forward_tflops: float
    attention_backward_tflops: float
    gemm_points: tuple[GemmPoint, ...]

    RATES = ("gemm_tflops", "gemm_half_dim", "memory_GBps", "attention_forward_tflops", "attention_backward_tflops")

    def numbers(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.RATES}


@dataclass(frozen=True)
class Compute:
    model: str
    dtype: str
    seq_len: int
    threads_per_rank: int
    passes: tuple[Pass, ...]
    engine: tuple[EngineCost, ...]
    adam_alpha_s: float  # torch Adam step over one flat fp32 partition: alpha + numel × seconds_per_param
    adam_s_per_param: float
    how: str
    data_s: Mapping[str, float] = field(default_factory=dict)  # making one micro-batch, by micro-batch size
    fitted: Fitted | None = None  # every file of VERSION 4 has it (read_calibration); older runs' resolved.json not

    def find_pass(self, backend: str, tp: int, sp: bool, micro_batch_size: int,
                  activation_checkpointing: str) -> Pass | None:
        return next((p for p in self.passes if (p.backend, p.tp, p.sp, p.micro_batch_size, p.activation_checkpointing)
                     == (backend, tp, sp, micro_batch_size, activation_checkpointing)), None)

    def find_engine(self, backend: str, zero_stage: int) -> EngineCost | None:
        return next((e for e in self.engine if (e.backend, e.zero_stage) == (backend, zero_stage)), None)

    def adam_s(self, numel: float) -> float:
        return self.adam_alpha_s + numel * self.adam_s_per_param


@dataclass(frozen=True)
class Calibration:
    created: str  # UTC ISO 8601
    machine_kind: str  # envinfo.machine_kind() where it was measured
    versions: Mapping[str, str | None]  # torch, deepspeed at measurement
    base_profile: str  # the nominal profile whose memory and link names it keeps
    world_size: int
    ranks_per_node: int
    collectives: tuple[AlphaBeta, ...]
    compute: Compute | None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Real runs `recommend verify=true` measured with this calibration, and their geometric-mean measured/predicted
    # ratio, which the planner multiplies its calibrated step time by (1.0: none yet).
    verified: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    correction: float = 1.0

    def alpha_beta(self, op: str, group_size: int, link: str) -> AlphaBeta | None:
        return next((c for c in self.collectives if (c.op, c.group_size, c.link) == (op, group_size, link)), None)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        """Raises KeyError, TypeError or ValueError on a document of the wrong shape (numbers are made floats here,
        so that a string where a time belongs fails now rather than in the planner)."""
        comp = d.get("compute")
        compute = None if comp is None else Compute(
            model=str(comp["model"]), dtype=str(comp["dtype"]),
            seq_len=_whole(comp["seq_len"]), threads_per_rank=_whole(comp["threads_per_rank"]),
            passes=tuple(Pass(str(p["backend"]), _whole(p["tp"]), _bool(p["sp"]), _whole(p["micro_batch_size"]), str(p["activation_checkpointing"]),
                              _num(p["forward_s"]), _num(p["backward_s"]), _num(p["embedding_forward_s"]),
                              _num(p["layers_forward_s"]), _num(p.get("sd_s", 0.0)))
                         for p in comp["passes"]),
            engine=tuple(EngineCost(str(e["backend"]), _whole(e["zero_stage"]), _num(e["micro_step_s"]), _num(e["step_s"]),
                                    _num(e["recompute_s"])) for e in comp["engine"]),
            adam_alpha_s=_num(comp["adam_alpha_s"]), adam_s_per_param=_num(comp["adam_s_per_param"]),
            how=str(comp["how"]), data_s={str(b): _num(v) for b, v in dict(comp.get("data_s", {})).items()},
            fitted=_fitted(comp.get("fitted")))  # None in resolved.json of runs calibrated before VERSION 4
        return cls(created=str(d["created"]), machine_kind=str(d["machine_kind"]), versions=dict(d["versions"]),
                   base_profile=str(d["base_profile"]), world_size=_whole(d["world_size"]),
                   ranks_per_node=_whole(d["ranks_per_node"]),
                   collectives=tuple(AlphaBeta(str(c["op"]), _whole(c["group_size"]), str(c["link"]), _num(c["alpha_s"]),
                                               _num(c["beta_Bps"]),
                                               tuple((_num(s), _num(t)) for s, t in c["points"]), str(c["how"]))
                                     for c in d["collectives"]),
                   compute=compute, notes=tuple(map(str, d.get("notes", ()))),
                   verified=tuple(dict(v) for v in d.get("verified", ())), correction=_num(d.get("correction", 1.0)))


def _fitted(d: Mapping[str, Any] | None) -> Fitted | None:
    if d is None:
        return None
    return Fitted(dtype=str(d["dtype"]), **{k: _num(d[k]) for k in Fitted.RATES},
        gemm_points=tuple(GemmPoint(_whole(p["m"]), _whole(p["n"]), _whole(p["k"]), _num(p["seconds"]))
                          for p in d["gemm_points"]))


def _whole(value: Any) -> int:
    """A count of the file (ranks, a TP degree, a matrix dimension): a JSON integer within 64 bits, as every writer of
    the file writes it; 2.5, "3", true and 2**64 + 1 are damage (int() took the first three and kept the last)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < sense.COUNT_LIMIT:
        raise TypeError(f"{value!r} is not a whole number within 64 bits")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{value!r} is not true or false")
    return value


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def read_calibration(path: Path, *, context: str, field_name: str = "hardware.profile") -> Calibration:
    """A calibration file, or a ConfigError naming what is wrong with it."""
    def bad(problem: str, fix: str = "write a new one with `python -m launch calibrate`") -> ConfigError:
        return ConfigError(context, field_name, str(path), problem, fix)

    text = inputs.read_text(path, context=context, field=field_name,
                            fix="give the path of a file that `python -m launch calibrate` wrote, or a profile name")
    try:
        raw = json.loads(text)
    except (RecursionError, ValueError) as e:
        raise bad(f"cannot be read as JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise bad(f'is not a calibration file (no "kind": "{KIND}")')
    if type(raw.get("version")) is not int or raw["version"] != VERSION:
        raise bad(f"is calibration version {raw.get('version')!r}; this code reads {VERSION}")
    try:
        calib = Calibration.from_dict(raw)
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: 1e400 (inf) for a whole number
        raise bad(f"is damaged ({type(e).__name__}: {e})")
    for c in calib.collectives:
        # α = 0 with β = ∞ would make the collective free; β = ∞ alone is a latency-only fit (fit_alpha_beta), a
        # finite β past any link's speed is no measurement.
        if not (c.alpha_s >= 0 and math.isfinite(c.alpha_s) and c.beta_Bps > 0 and (c.alpha_s > 0 or math.isfinite(c.beta_Bps))
                and (math.isinf(c.beta_Bps) or c.beta_Bps <= sense.MAX_BANDWIDTH_GBPS * 1e9)):
            raise bad(f"has an impossible fit for {c.op} on {c.group_size} ranks (alpha {c.alpha_s}, beta {c.beta_Bps})")
        if not c.points or not all(math.isfinite(x) and math.isfinite(t) and x > 0 and t >= 0 for x, t in c.points):
            raise bad(f"has impossible measured points for {c.op} on {c.group_size} ranks")
    if not (calib.world_size >= 1 and calib.ranks_per_node >= 1):
        raise bad(f"has an impossible world ({calib.world_size} ranks, {calib.ranks_per_node} per node)")
    if not (math.isfinite(calib.correction) and 0.1 <= calib.correction <= 10):
        raise bad(f"has an impossible correction {calib.correction} (measured/predicted)")
    for p in calib.compute.passes if calib.compute else ():
        parts = (p.embedding_forward_s, p.layers_forward_s)
        if not (p.forward_s > 0 and p.backward_s > 0 and p.sd_s >= 0 and all(x >= 0 for x in parts)
                and sum(parts) <= p.forward_s and math.isfinite(p.forward_s + p.backward_s + p.sd_s + sum(parts))):
            raise bad(f"has an impossible pass time for {p.backend} at tp={p.tp}, micro_batch_size={p.micro_batch_size}")
    if calib.compute:
        c = calib.compute
        for what, value in [*((f"{e.backend} engine ZeRO-{e.zero_stage}", v) for e in c.engine
                              for v in (e.micro_step_s, e.step_s, e.recompute_s)),
                            ("adam_alpha_s", c.adam_alpha_s), ("adam_s_per_param", c.adam_s_per_param),
                            *((f"data_s[{b}]", v) for b, v in c.data_s.items())]:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise bad(f"has an impossible {what} time {value!r}")
        f = c.fitted
        if f is None:
            raise bad("has no fitted compute figures (compute.fitted)")
        if f.dtype != c.dtype:
            raise bad(f"fitted its compute figures at {f.dtype!r}, its passes at {c.dtype!r}")
        for what, value in f.numbers().items():
            if not (math.isfinite(value) and value > 0):
                raise bad(f"has an impossible fitted {what} {value!r}")
        if not f.gemm_points or not all(min(p.m, p.n, p.k) > 0 and math.isfinite(p.seconds) and p.seconds > 0
                                        for p in f.gemm_points):
            raise bad("has impossible timed GEMMs")
    return calib


def host_problems(calib: Calibration, *, machine_kind: str, versions: Mapping[str, str | None],
                  ranks_per_node: int) -> list[str]:
    """Why this calibration measured another machine than the one a layout runs on (empty: this one): another kind of
    machine, ranks per node (each rank's threads and share of the machine follow from it), or versions of the
    packages whose speed it measured."""
    out = []
    if calib.machine_kind != machine_kind:
        out.append(f"it was measured on {calib.machine_kind!r}, this machine is {machine_kind!r}")
    if calib.ranks_per_node != ranks_per_node:
        out.append(f"it was measured with {calib.ranks_per_node} ranks per node sharing the machine, the layout has "
                   f"{ranks_per_node}")
    for pkg in MEASURED_PACKAGES:
        if calib.versions.get(pkg) != versions.get(pkg):
            out.append(f"it was measured with {pkg} {calib.versions.get(pkg)}, {versions.get(pkg)} is installed")
    return out


def machine_problems(calib: Calibration, *, machine_kind: str, versions: Mapping[str, str | None], model: str,
                     dtype: str, seq_len: int, ranks_per_node: int) -> list[str]:
    """Why this calibration's measured passes time nothing of a recipe on this machine (empty: they may time some of
    its layouts): another machine (host_problems), or model shapes."""
    out = host_problems(calib, machine_kind=machine_kind, versions=versions, ranks_per_node=ranks_per_node)
    c = calib.compute
    if c is None:
        out.append("it has no compute figures")
    elif (c.model, c.dtype, c.seq_len) != (model, dtype, seq_len):
        out.append(f"its compute was measured for {c.model} {c.dtype} seq_len={c.seq_len}, "
                   f"the layout trains {model} {dtype} seq_len={seq_len}")
    return out


def missing_collectives(calib: Calibration, needs: Sequence[tuple[str, int, str]]) -> list[str]:
    """The (collective, group size, link) calls of a layout the calibration did not measure, in words: those are
    timed on the nominal figures, the rest of the layout on the calibration."""
    measured = ", ".join(sorted({f"{c.op}/{c.group_size}/{c.link}" for c in calib.collectives}))
    return [f"it has no {op} on {n} ranks {link.replace('_', '-')} (measured: {measured or 'none'})"
            for op, n, link in needs if calib.alpha_beta(op, n, link) is None]


def problems(calib: Calibration, *, machine_kind: str, versions: Mapping[str, str | None], model: str, dtype: str,
             seq_len: int, ranks_per_node: int, backend: str, tp: int, sp: bool, micro_batch_size: int,
             activation_checkpointing: str, zero_stage: int) -> list[str]:
    """Why this calibration's measured passes cannot time a layout (empty: they can); `ranks_per_node`: the
    layout's."""
    out = machine_problems(calib, machine_kind=machine_kind, versions=versions, model=model, dtype=dtype,
                           seq_len=seq_len, ranks_per_node=ranks_per_node)
    c = calib.compute
    if c is None:
        return out  # machine_problems said so
    if (c.model, c.dtype, c.seq_len) == (model, dtype, seq_len) and \
            c.find_pass(backend, tp, sp, micro_batch_size, activation_checkpointing) is None:
        out.append(f"it has no {backend} pass at tp={tp}{', sp' if sp else ''}, micro_batch_size={micro_batch_size}, "
                   f"activation_checkpointing={activation_checkpointing}")
    if c.find_engine(backend, zero_stage) is None:
        out.append(f"it has no {backend} engine cost at zero_stage={zero_stage}")
    return out


@dataclass(frozen=True)
class Newest:
    """What `newest_for` found: the file to use (None: none applies) and the candidates it could not read, each as
    "path: problem", so that a damaged calibration is said rather than silently replaced by nominal figures."""

    path: Path | None
    unreadable: tuple[str, ...]


def newest_for(root: Path, *, machine_kind: str, versions: Mapping[str, str | None], base_profile: str,
               world_size: int, ranks_per_node: int, model: str, dtype: str, seq_len: int) -> Newest:
    """The newest calibration under `root` (runs_root()) that `calibrate` measured on a machine of this kind, with
    these package versions, for this world, ranks per node, model, dtype and sequence length, on top of
    `base_profile`: the file a user means after `calibrate` without naming it. Newest by when it was measured;
    of one calibration's files (the fed-back copies `recommend verify=true` writes beside it) the one with the most
    verified runs, then the latest-named (their names carry the UTC stamp). Unreadable or damaged files are passed
    over and listed; files for other machines, models or worlds are simply not candidates."""
    found, unreadable = [], []
    for path in sorted((root / RUNS_FOLDER).glob(f"*/{Path(FILE_NAME).stem}*.json")):
        try:
            calib = read_calibration(path, context=str(path))
        except ConfigError as e:
            unreadable.append(f"{path}: {e.problem}")
            continue
        if (calib.base_profile, calib.world_size) != (base_profile, world_size) or machine_problems(
                calib, machine_kind=machine_kind, versions=versions, model=model, dtype=dtype, seq_len=seq_len,
                ranks_per_node=ranks_per_node):
            continue
        found.append(((calib.created, len(calib.verified), path.name, str(path)), path))
    return Newest(max(found)[1] if found else None, tuple(unreadable))
