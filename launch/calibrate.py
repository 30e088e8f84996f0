"""`python -m launch calibrate [recipes/NAME] [key=value ...] [out=PATH]`: measure this machine for the planner.

On the ranks the recipe would train on (CPU ranks here, GPUs there) it runs
  1. the commbench sweep (launch/commbench.py) once per group size the layouts of this world can use, every group
     at once, with compute interleaved between the calls as in a step (`commbench.interleave_us`), and fits a
     latency + bandwidth line per collective and group size (launch/calibration.py);
  2. one compute probe per local rank at the same time (launch/calibrate_rank.py): forward and backward at the
     model's shapes for every TP degree, micro-batch size and activation-checkpointing mode a layout can take,
     torch Adam over flat partitions, and the DeepSpeed engine's own cost at each ZeRO stage;
and writes a calibration file that `hardware.profile=PATH` accepts. Every figure says how and when it was
measured. Nothing existing is replaced: `out` must not exist.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launch import envinfo, launcher
from launch.calibrate_rank import SPEC, compute_file
from launch.recommend import MAX_MICRO_BATCH, ZERO_STAGES
from launch.calibration import OPS, AlphaBeta, Calibration, Compute, EngineCost, Pass, fit_alpha_beta
from launch.commbench_spec import groups_of, read_result
from launch.errors import ConfigError
from launch.grid import divisors
from launch.resolve import Resolved, resolve_path
from launch.rundir import RunDir

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_zero2"
INTERLEAVE_US = 500.0  # compute between calls: about one decoder layer's forward of a small model on a CPU rank


def parse(args: Sequence[str]) -> tuple[str, list[str], str | None]:
    recipe, overrides, out = str(DEFAULT_RECIPE), [], None
    for i, a in enumerate(args):
        if a.startswith("out="):
            out = a[4:]
        elif "=" in a:
            overrides.append(a)
        elif i == 0:
            recipe = a
        else:
            raise ConfigError("command line", "argument", a, "is neither the recipe (first) nor key=value",
                              "usage: python -m launch calibrate [recipes/NAME] [key=value ...] [out=PATH]")
    return recipe, overrides, out


def cmd_calibrate(args: Sequence[str]) -> int:
    recipe, overrides, out_arg = parse(args)
    resolved = resolve_path(recipe, overrides)
    if not resolved.hardware.nominal:
        raise ConfigError(resolved.recipe_path, "hardware.profile", resolved.recipe.hardware.profile,
                          "is already a calibration", "name the nominal profile to measure against, e.g. hardware.profile=cpu")
    out = Path(out_arg).expanduser().resolve() if out_arg else None
    if out is not None and out.exists():
        raise ConfigError("command line", "out", out_arg, "exists; calibrate never replaces a file",
                          "choose a new path, or move the old file away")
    if out is not None and not out.parent.is_dir():
        raise ConfigError("command line", "out", out_arg, f"is in a folder that does not exist ({out.parent})",
                          "create the folder first or choose another path")
    root = RunDir.create("calibration").root  # only once the arguments are known good
    out = out or root / "calibration.json"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"calibrate: {resolved.recipe_name} ({resolved.model.name}, {resolved.recipe.precision.dtype}, seq_len "
          f"{resolved.recipe.batch.seq_len}) on {resolved.world_size} {resolved.hardware.name} rank(s); work in {root}",
          flush=True)
    collectives, notes = _collectives(recipe, overrides, resolved, root)
    compute = _compute(recipe, overrides, resolved, root, notes)
    calib = Calibration(created=started, machine_kind=envinfo.machine_kind(),
                        versions={k: v for k, v in envinfo.package_versions().items() if k in ("torch", "deepspeed")},
                        base_profile=resolved.hardware.name, world_size=resolved.world_size,
                        ranks_per_node=resolved.recipe.hardware.gpus_per_node, collectives=tuple(collectives),
                        compute=compute, notes=tuple(notes))
    # Written whole under a name of our own, then linked into place: a file that appeared at `out` meanwhile stays.
    tmp = root / f".calibration-{os.getpid()}.json"
    tmp.write_text(json.dumps(calib.to_dict(), indent=2) + "\n")
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise ConfigError("command line", "out", str(out), "appeared while calibrating; calibrate never replaces a file",
                          f"the measurements are kept in {tmp}: move it where you want it")
    tmp.unlink()
    for c in collectives:
        beta = "∞" if c.beta_Bps == float("inf") else f"{c.beta_Bps / 1e9:.3f} GB/s"
        print(f"  {c.op:<15} {c.group_size} ranks: α = {c.alpha_s * 1e6:8.1f} µs, β = {beta}")
    if compute:
        for p in compute.passes:
            print(f"  pass tp={p.tp} micro_batch_size={p.micro_batch_size} ac={p.activation_checkpointing:<4}: "
                  f"forward {p.forward_s * 1e3:7.2f} ms, backward {p.backward_s * 1e3:7.2f} ms")
        for e in compute.engine:
            print(f"  DeepSpeed engine ZeRO-{e.zero_stage}: +{e.forward_s * 1e3:.2f} ms forward, +{e.backward_s * 1e3:.2f} "
                  f"ms backward, +{e.step_s * 1e3:.2f} ms step")
    for n in notes:
        print(f"  note: {n}")
    print(f"wrote {out}\nuse it: hardware.profile={out}")
    return 0


# --------------------------------------------------------------------------- collectives


def _collectives(recipe: str, overrides: list[str], resolved: Resolved, root: Path) -> tuple[list[AlphaBeta], list[str]]:
    """α–β per collective for every group size of 2 or more that divides the world, from interleaved sweeps."""
    world, out, notes = resolved.world_size, [], []
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
            notes.append(f"{n}-rank groups measured one at a time ({e.problem})")
        run = RunDir.create(f"commbench_{n}", root=root)
        run.write_text_atomic(run.resolved, r.to_json() + "\n")
        cmd = launcher.build(r, str(run.root))
        print(f"calibrate: collectives on {n}-rank groups (commbench sweep, {INTERLEAVE_US:g} µs of compute "
              f"between calls) -> {run.root}", flush=True)
        with open(run.root / "calibrate.log", "w") as log:
            rc = subprocess.call(list(cmd.argv), env={**os.environ, **cmd.env}, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise RuntimeError(f"the commbench sweep on {n} ranks failed (exit {rc}); see {run.root}")
        for op in OPS:
            res = read_result(run.commbench_json(op))
            points = tuple((row["size_bytes"], row["time_us"] * 1e-6) for row in res["rows"])
            alpha, beta = fit_alpha_beta(points)
            out.append(AlphaBeta(op, n, "inter_node" if r.grid.spans_nodes(groups_of(r.recipe.commbench, r.grid)[0])
                                 else "intra_node", alpha, beta, points,
                                 f"commbench sweep {run.root.name}: {res['iters']} calls per size after "
                                 f"{res['warmup_iters']} warm-up, each after {INTERLEAVE_US:g} µs of matmul work "
                                 f"(subtracted), both placements; mean over ranks; least-squares fit of relative error"))
    return out, notes


# --------------------------------------------------------------------------- compute


def _compute(recipe: str, overrides: list[str], resolved: Resolved, root: Path, notes: list[str]) -> Compute:
    m, r = resolved.model, resolved.recipe
    gpn = r.hardware.gpus_per_node
    tps = [t for t in divisors(gpn) if m.num_heads % t == 0 and m.num_kv_heads % t == 0 and m.intermediate_size % t == 0]
    mbs = [b for b in divisors(r.batch.global_batch_size) if b <= max(MAX_MICRO_BATCH, r.batch.micro_batch_size)]
    engine_b = r.batch.micro_batch_size
    single = ["backend=deepspeed", "parallel.tp=1", "parallel.pp=1", "parallel.dp=auto", "parallel.sp=false",
              "parallel.vpp=1", "hardware.nodes=1", "hardware.gpus_per_node=1", f"batch.micro_batch_size={engine_b}",
              f"batch.global_batch_size={engine_b}", "parallel.offload_optimizer=none", "parallel.offload_params=none"]
    engines = [{"zero_stage": z, "ds_config": resolve_path(recipe, [*overrides, *single, f"parallel.zero_stage={z}"]).ds_config}
               for z in ZERO_STAGES]
    total = m.param_counts().total
    cuda = resolved.hardware.name != "cpu"
    spec = {"resolved": str(root / "resolved.json"), "tps": tps, "micro_batch_sizes": mbs,
            "activation_checkpointing": ["none", "full"], "engine_micro_batch_size": engine_b, "engines": engines,
            "adam_numels": [max(1, total // d) for d in (1, 2, 4, 8)], "warmup_iters": 3, "iters": 20}
    (root / "resolved.json").write_text(resolved.to_json() + "\n")
    (root / SPEC).write_text(json.dumps(spec, indent=2) + "\n")
    threads = launcher.cpu_threads(gpn)
    print(f"calibrate: compute on {gpn} concurrent world-1 process(es), {threads} thread(s) each: tp {tps}, "
          f"micro_batch_size {mbs}, activation_checkpointing none/full, DeepSpeed ZeRO-{list(ZERO_STAGES)}", flush=True)
    procs = []
    for i in range(gpn):
        # The training launch's environment (DS_ACCELERATOR, threads per rank, extensions), as a world of 1.
        env = {**os.environ, **launcher.build(resolved, str(root)).env, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(launcher.free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        log = open(root / "logs" / f"compute_{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "launch.calibrate_rank", str(root), str(i)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    for i, (p, log) in enumerate(procs):
        rc = p.wait()
        log.close()
        if rc != 0:
            raise RuntimeError(f"compute probe {i} failed (exit {rc}); see {root / 'logs' / f'compute_{i}.log'}")
    docs = [json.loads(compute_file(root, i).read_text()) for i in range(gpn)]

    passes = tuple(Pass(p["tp"], p["micro_batch_size"], p["activation_checkpointing"],
                        *(statistics.fmean(d["passes"][k][part] for d in docs)
                          for part in ("forward_s", "backward_s", "sd_s")))
                   for k, p in enumerate(docs[0]["passes"]))
    engine = []
    for k, e in enumerate(docs[0]["engine"]):
        costs = {}
        for part in ("forward_s", "backward_s", "step_s"):
            value = statistics.fmean(d["engine"][k][part] for d in docs)
            if value < 0:  # the engine cannot cost less than the plain model: noise around zero
                notes.append(f"DeepSpeed ZeRO-{e['zero_stage']} {part[:-2]} cost measured {value * 1e3:.2f} ms (below "
                             "the plain model's, noise): taken as 0")
                value = 0.0
            costs[part] = value
        engine.append(EngineCost(e["zero_stage"], **costs))
    engine = tuple(engine)
    return Compute(backend="deepspeed", model=m.name, dtype=r.precision.dtype, seq_len=r.batch.seq_len,
                   threads_per_rank=docs[0]["threads"],
                   passes=passes, engine=engine, adam_alpha_s=statistics.fmean(d["adam_alpha_s"] for d in docs),
                   adam_s_per_param=statistics.fmean(d["adam_s_per_param"] for d in docs),
                   data_s={b: statistics.fmean(d["data_s"][b] for d in docs) for b in docs[0]["data_s"]},
                   how=(f"{gpn} concurrent world-1 processes ({docs[0]['threads']} threads each), the HF model of the "
                        f"deepspeed backend (TP shards: heads, key/value heads and MLP width / tp), "
                        f"{spec['iters']} timed iterations after {spec['warmup_iters']} warm-up, mean (and over "
                        f"processes); engine costs: "
                        f"DeepSpeed engine minus the plain model at micro_batch_size={engine_b} and torch Adam fitted "
                        f"over {spec['adam_numels']} elements; measured {dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"))
