"""`python -m launch rehearse recipes/NAME [key=value ...] [out=DIR]`: the recipe's own training step at its real
shapes, on this CPU, without a GPU, held against the plan.

This side resolves and plans the recipe (the plan is launch/plan's, as `run --dry-run` prints it), refuses what it
cannot rehearse, and writes resolved.json and plan.json into a rehearsal directory (runs/rehearsals/<recipe>/<UTC
stamp>, or out=DIR) through the one guarded writer. It then starts the rank program, `python -m launch.ranks.rehearse
DIR RANK` (launch/ranks/rehearse.py: the torch backend's trainer on a fake process group under FakeTensorMode), once
for the first rank of each distinct role in the plan, and writes rehearsal.json: each rank's measured peak memory,
FLOPs and collectives per step beside the plan's, and planned / measured (launch/run/rehearsal.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from launch.commands.args import Option, read, text
from launch.commands.render import make_console, safe
from launch.config.resolve import Resolved, resolve_path
from launch.errors import ConfigError
from launch.outputs import claim_folder, folder_problem, write_text_atomic
from launch.plan.build import plan_resolved
from launch.run import envinfo
from launch.run.rehearsal import DDP_BUCKETS, REHEARSAL, SCHEMA, Measured, is_our_rehearsal, measured_path, rehearsal_record
from launch.run.rundir import RunDir, runs_root
from launch.units import human_bytes

USAGE = "usage: python -m launch rehearse recipes/NAME [key=value ...] [out=DIR]"
OPTIONS = (Option("out", "the folder to write (default runs/rehearsals/<recipe>/<UTC stamp>)", text),)
WRITER = "`python -m launch rehearse`"
# Why a backend's step is not rehearsed: the rank program builds the torch backend's trainer only.
UNREHEARSED_BACKENDS = {
    "deepspeed": "DeepSpeed 0.19.8's engine, tried on a fake process group under FakeTensorMode, stops in its "
                 "module cast (RuntimeError: _apply(): Couldn't swap Linear.weight: nn.Module._apply swaps fake "
                 "parameters); its memory estimators stay the plan's check",
    "megatron": "Megatron-Core 0.16.1, tried on a fake process group under FakeTensorMode (parallel_state without "
                "gloo groups), stops in its rotary embedding, which moves inv_freq to torch.cuda.current_device() "
                "(AssertionError: Torch not compiled with CUDA enabled), and its data parallelism here is "
                "DeepSpeed's engine, whose module cast fails on fake parameters; its accounting stays checked by the tiny twins",
}


def cmd_rehearse(args: Sequence[str]) -> int:
    a = read(args, command="rehearse", usage=USAGE, options=OPTIONS, positional=(1, 1), overrides=True)
    # compile off: the rehearsal measures the eager step (torch.compile on fake tensors compiles nothing it could run)
    resolved = resolve_path(a.positional[0], [*a.overrides, "train.compile=false"])
    _refuse_what_cannot_be_rehearsed(resolved)
    plan = plan_resolved(resolved, envinfo.machine())
    root = _folder(a.options["out"], resolved)
    _write_status(root, resolved, "running")
    run = RunDir(root)
    run.write_text_atomic(run.resolved, resolved.to_json() + "\n")
    run.write_text_atomic(run.plan, plan.to_json() + "\n")
    run.logs.mkdir(exist_ok=True)
    console = make_console()
    console.print(f"rehearsing {safe(resolved.recipe_name)} in {safe(str(root))}: world size {resolved.world_size}, "
                  f"{len(plan.ranks)} distinct rank role(s); half a minute or more at full size", soft_wrap=True)
    start = time.perf_counter()
    measured = []
    for rank_plan in plan.ranks:
        rank = rank_plan.ranks[0]
        rank_program = [sys.executable, "-m", "launch.ranks.rehearse", str(root), str(rank)]
        rc = subprocess.run(rank_program, check=False).returncode
        if rc != 0:
            _write_status(root, resolved, f"rank {rank} stopped (exit {rc}); see {run.stderr(rank)}")
            return rc
        measured.append(Measured.from_json(measured_path(root, rank).read_text(encoding="utf-8")))
    ddp = resolved.recipe.parallel.zero_stage == 0 and resolved.grid.dp > 1
    record = rehearsal_record(resolved.recipe_name, plan, resolved.world_size, measured, time.perf_counter() - start,
                              [DDP_BUCKETS] if ddp else [])
    write_text_atomic(root / REHEARSAL, json.dumps({**record, "status": "done"}, indent=1) + "\n")
    _table(record, console)
    console.print(f"wrote {safe(str(root / REHEARSAL))}", soft_wrap=True)
    return 0


def rehearsable(resolved: Resolved) -> bool:
    """Whether `python -m launch rehearse` takes the recipe (the catalogue rehearses every torch GPU recipe it takes)."""
    try:
        _refuse_what_cannot_be_rehearsed(resolved)
    except ConfigError:
        return False
    return True


def _refuse_what_cannot_be_rehearsed(resolved: Resolved) -> None:
    r, path = resolved.recipe, resolved.recipe_path
    why = UNREHEARSED_BACKENDS.get(r.backend)
    if why:
        raise ConfigError(path, "backend", r.backend, f"cannot be rehearsed: {why}",
                          "rehearse a torch-backend recipe (e.g. recipes/7b_fsdp2)")
    if r.parallel.pp > 1:
        raise ConfigError(path, "parallel.pp", r.parallel.pp, "cannot be rehearsed: the trainer's pipeline stages "
                          "receive their input shapes from the previous stage over the process group at the first "
                          "step, which a fake process group never delivers", "rehearse the layout with parallel.pp=1")
    if r.parallel.offload_params != "none":
        raise ConfigError(path, "parallel.offload_params", r.parallel.offload_params, "cannot be rehearsed: on this "
                          "CPU the offloaded and the device-resident state land on one device, which the memory "
                          "tracker cannot tell apart", "rehearse the layout with parallel.offload_params=none")


def _folder(out: str | None, resolved: Resolved) -> Path:
    """out=DIR (absent, empty, or an earlier rehearsal's; never the recipe's folder or one holding it), else a new
    runs/rehearsals/<recipe>/<UTC stamp>."""
    if out is None:
        return claim_folder(runs_root() / "rehearsals" / resolved.recipe_name, field="LAYOUTLAB_RUNS")
    problem = folder_problem(Path(out), ours=is_our_rehearsal, writer=WRITER, inputs=(Path(resolved.recipe_path),))
    if problem:
        raise ConfigError("command line", "out", out, problem, "name a new folder, or an earlier rehearsal's")
    Path(out).mkdir(parents=True, exist_ok=True)
    return Path(out)


def _write_status(root: Path, resolved: Resolved, status: str) -> None:
    """rehearsal.json from the start (it marks the folder as ours), its numbers once every rank has finished."""
    write_text_atomic(root / REHEARSAL, json.dumps({"schema": SCHEMA, "recipe": resolved.recipe_name,
                                                    "status": status}, indent=1) + "\n")


def _table(record: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"{safe(record['recipe'])}: rehearsed (torch, fake process group) vs planned, per rank and step",
              title_justify="left")
    for col in ("rank", "figure", "rehearsed", "planned", "planned / rehearsed"):
        t.add_column(col, justify="left" if col in ("rank", "figure") else "right")
    for r in record["ranks"]:
        who = f"{r['rank']} ({safe(r['role'])})"
        t.add_row(who, "peak memory, before the allowance", human_bytes(r["peak_bytes_measured"]), human_bytes(r["peak_bytes_planned"]),
                  _ratio(r["peak_ratio"]))
        for ph in r["phases"]:
            t.add_row("", f"  at its {ph['phase']}", _bytes(ph["bytes_measured"]), _bytes(ph["bytes_planned"]),
                      _ratio(ph["ratio"]))
        t.add_row("", "  + allowance (planned)", "", human_bytes(r["allowance_planned"]), "")
        t.add_row("", "FLOPs", f"{r['flops_measured']:.4g}", f"{r['flops_planned']:.4g}", _ratio(r["flops_ratio"]))
        for kind in sorted(set(r["collectives_measured"]) | set(r["collectives_planned"])):
            got, want = r["collectives_measured"].get(kind, 0), r["collectives_planned"].get(kind, 0)
            t.add_row("", f"{kind} calls", str(got), str(want), "equal" if got == want else f"{want - got:+d}")
    console.print(t)
    for r in record["ranks"]:
        kinds = ", ".join(f"{safe(k)} {human_bytes(n)}" for k, n in sorted(r["peak_by_kind_measured"].items(),
                                                                          key=lambda kv: -kv[1]))
        console.print(f"rank {r['rank']}: peak ({safe(r['tracker'])}) {kinds}; at {safe(r['peak_at'])}; planned at "
                      f"its {safe(r['peak_phase_planned'] or 'each kind’s own peak, added')}", soft_wrap=True)
        console.print(f"  FLOPs: {r['flops_counted']:.4g} counted by FlopCounterMode + "
                      f"{r['flops_attention_formula']:.4g} attention from the formula (the CPU attention kernel is not "
                      "counted)", soft_wrap=True)
        console.print(f"  {r['micro_batches_run']} of {r['micro_batches_per_step']} micro-batches run, "
                      f"{safe(r['optimizer'])}, {r['seconds']:.0f} s", soft_wrap=True)
    for note in record["notes"]:
        console.print(f"  note: {safe(note)}", soft_wrap=True)


def _bytes(x: int | None) -> str:
    return "n/a" if x is None else human_bytes(x)


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
