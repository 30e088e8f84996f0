"""`python -m launch run RECIPE [key=value ...] [--dry-run]`, `python -m launch plan key=value ...`,
`python -m launch export RUN_DIR [step=N] [out=DIR]`,
`python -m launch export-accelerate (RUN_DIR | RECIPE [key=value ...]) [out=DIR]`, `python -m launch calibrate [RECIPE] [key=value ...] [out=PATH]`,
`python -m launch recommend RECIPE [key=value ...] [top=K] [verify=true] [steps=N]`,
`python -m launch sweep RECIPE RECIPE ... [key=value ...] [--dry-run]` (what launch/sweep.sh runs).

Every user error is a `ConfigError`: one line on stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launch import envinfo, launcher, nodes
from launch.backends import traits
from launch.checkpoints import ResumeError
from launch.errors import ConfigError, printable
from launch.grid import shown_nodes
from launch.planner import GiB, Plan, chunk_layers, plan_resolved
from launch.resolve import Resolved, resolve_path
from launch.rundir import RunDir, runs_root


def _console():
    from rich.console import Console

    return Console(width=int(os.environ.get("COLUMNS", "120")), highlight=False, soft_wrap=True)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _safe(text: str) -> str:
    """The user's text (names, paths, overrides) for a rich console: printed as text, never read as rich markup,
    its control characters shown as escapes (launch.errors.printable)."""
    from rich.markup import escape

    return escape(printable(text))


def render(resolved: Resolved, plan: Plan, cmd: launcher.LaunchCommand, console,
           per_node: Sequence[launcher.NodeCommand] = ()) -> None:
    from rich.table import Table

    r = resolved.recipe
    # Names, paths and overrides are the user's text: printed as text, never read as rich markup.
    console.print(f"[bold]recipe[/bold] {_safe(resolved.recipe_name)}  ({_safe(resolved.recipe_path)})")
    console.print(f"  chain: {_safe(' -> '.join(resolved.chain))}")
    if resolved.overrides:
        console.print(f"  overrides: {_safe(' '.join(resolved.overrides))}")
    pc = resolved.model.param_counts()
    console.print(f"  backend={r.backend}  model={_safe(resolved.model.name)} ({pc.total / 1e9:.3f}B params)  "
                  f"dtype={r.precision.dtype}  zero_stage={r.parallel.zero_stage}  sp={str(r.parallel.sp).lower()}  "
                  f"activation_checkpointing={r.train.activation_checkpointing}")
    console.print(f"  batch: micro_batch_size={r.batch.micro_batch_size} × grad_accum={resolved.grad_accum} × "
                  f"dp={r.parallel.dp} = global_batch_size={r.batch.global_batch_size}, seq_len={r.batch.seq_len} "
                  f"({resolved.tokens_per_step} tokens/step)")
    console.print(f"  hardware: {_safe(resolved.hardware.name)} ({_safe(resolved.hardware.device)}), "
                  f"{r.hardware.nodes} node(s) × {r.hardware.gpus_per_node}")
    if resolved.ds_base:
        console.print(f"  deepspeed base: {_safe(resolved.ds_base)}")
    for w in resolved.warnings:
        console.print(f"[yellow]warning:[/yellow] {_safe(w)}")
    console.print()
    for line in resolved.grid.describe():
        console.print(line)
    if r.parallel.pp > 1:
        for stage in range(r.parallel.pp):
            chunks = chunk_layers(resolved.model.num_layers, r.parallel.pp, r.parallel.vpp, stage)
            console.print(f"  pp stage {stage}: " + ", ".join(f"chunk {v} layers {c[0]}-{c[-1]}" for v, c in enumerate(chunks)))
    console.print()

    t = Table(title="memory per rank (GiB)", title_justify="left")
    t.add_column("ranks")
    t.add_column("accounting")
    for col in ("weights", "grads", "optimizer", "activations", "buffers", "allowance", "total", "host"):
        t.add_column(col, justify="right")
    t.add_column("fits")
    for rp in plan.ranks:
        for acc, mem in rp.memory.items():
            mark = acc + (" *" if acc == rp.implementation else "")
            fits = ("yes" if mem.total <= rp.usable_bytes else "NO") if acc == rp.implementation else ""
            t.add_row(f"{rp.kind} {_ranks(rp.ranks)}", mark, _gib(mem.weights), _gib(mem.grads), _gib(mem.optimizer),
                      _gib(mem.activations), _gib(mem.buffers), _gib(mem.allowance), _gib(mem.total),
                      _gib(mem.host_bytes), fits)
    console.print(t)
    worst = plan.worst()
    console.print(f"  * = accounting used by the fit check; usable device memory {_gib(worst.usable_bytes)} GiB of "
                  f"{_gib(worst.device_memory_bytes)} (headroom {r.plan.headroom:.0%})")

    c = Table(title="communication per step (per rank)", title_justify="left")
    for col in ("parallelism", "collective", "link", "group", "calls", "message", "sent/rank", "busbw GB/s", "time ms"):
        c.add_column(col, justify="right" if col not in ("parallelism", "collective", "link") else "left")
    for item in plan.comm:
        c.add_row(item.parallelism, item.collective, item.link, str(item.group_size), str(item.calls_per_step),
                  _bytes(item.message_bytes), _bytes(item.bytes_per_rank), f"{item.busbw_GBps:.3g}", f"{item.time_s * 1e3:.2f}")
    if not plan.comm:
        c.add_row("-", "none (one rank per group)", "", "", "", "", "", "", "")
    console.print(c)
    s = plan.step
    console.print(f"predicted step: {s.total_s * 1e3:.1f} ms = compute {s.compute_s * 1e3:.1f} + bubble "
                  f"{s.bubble_s * 1e3:.1f} + tp/sp {s.tp_comm_s * 1e3:.1f} + pp {s.pp_comm_s * 1e3:.1f} + exposed dp "
                  f"{s.dp_exposed_s * 1e3:.1f} (of {s.dp_comm_s * 1e3:.1f}) + offload {s.offload_s * 1e3:.1f}; "
                  f"{s.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {s.mfu:.1%}")
    console.print(f"  model FLOPs/step {s.model_flops_per_step:.3e} (6·N + 12·L·h·s per token, torchtitan); {_safe(s.assumptions)}")
    for n in plan.notes:
        console.print(f"  note: {_safe(n)}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if r.run.mode == "commbench":
        refusal = " (run.mode=commbench measures collectives only: no fit check)"
    elif plan.fits or r.plan.ignore_fit:
        refusal = ""
    else:
        refusal = " — a real run is refused; lower memory (zero_stage, tp, activation_checkpointing) or set plan.ignore_fit=true"
    console.print(f"[bold]plan: {verdict}[/bold]{refusal}")
    console.print()
    if r.run.launcher == "deepspeed" and per_node:
        console.print("[bold]launch command[/bold] (on the first host; DeepSpeed's runner starts each node over pdsh/ssh)")
        console.print(printable(cmd.shell()), markup=False)
        console.print("[bold]per node[/bold] (what the runner starts there; the environment reaches it through "
                      "DS_ENV_FILE)")
    elif per_node:
        console.print("[bold]launch command per node[/bold] (start each on its node; nodes > 0 join node 0's run directory)")
    else:
        console.print("[bold]launch command[/bold]")
        console.print(printable(cmd.shell()), markup=False)
    for line in node_lines(per_node):
        console.print(line, markup=False)


def node_lines(per_node: Sequence[launcher.NodeCommand]) -> list[str]:
    """One line per node listed (launch.grid.shown_nodes), each naming its node rank, and a count of the rest."""
    lines = []
    for i, nc in enumerate(per_node):
        if i and nc.node_rank != per_node[i - 1].node_rank + 1:
            lines.append(f"  ... nodes {per_node[i - 1].node_rank + 1}-{nc.node_rank - 1}: the same with their own "
                         "node rank")
        host = f" ({nc.host})" if nc.host else ""
        lines.append(printable(f"  node {nc.node_rank}{host}: {nc.command.shell()}"))
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def split_dry_run(args: Sequence[str], script: str, fix: str) -> tuple[bool, list[str]]:
    """(whether --dry-run was given, the other arguments); any other flag is refused in one line."""
    rest = [a for a in args if a != "--dry-run"]
    flags = [a for a in rest if a.startswith("--")]
    if flags:
        raise ConfigError("command line", flags[0], flags[0], f"is not a flag of {script} (--dry-run is the only one)", fix)
    return len(rest) != len(args), rest


def cmd_run(args: Sequence[str]) -> int:
    dry, rest = split_dry_run(args, "run.sh", "use dotted key=value overrides, e.g. parallel.tp=2")
    if not rest:
        raise ConfigError("command line", "recipe", None, "is missing", "usage: bash launch/run.sh recipes/NAME [key=value ...] [--dry-run]")
    recipe, overrides = rest[0], rest[1:]
    resolved = resolve_path(recipe, overrides)
    plan = plan_resolved(resolved)
    console = _console()
    if dry:
        run_dir = str(runs_root() / resolved.recipe_name / "<UTC yyyymmdd-hhmmss>")  # where the real run would go
        cmd = launcher.build(resolved, run_dir)
        nodes_n = resolved.recipe.hardware.nodes
        per_node = launcher.node_commands(resolved, run_dir, node_ranks=shown_nodes(nodes_n)) if nodes_n > 1 else []
        render(resolved, plan, cmd, console, per_node)
        return 0
    bench = resolved.recipe.run.mode == "commbench"  # the collective sweep needs no trainer, memory fit or checkpoint
    missing = [] if bench else traits(resolved.recipe.backend).missing_packages()
    if missing:
        raise ConfigError(resolved.recipe_path, "backend", resolved.recipe.backend,
                          f"needs {', '.join(missing)}, which is not installed",
                          'install the project as README says (pip install -e ".[test]")')
    if not bench and not plan.host_fits and not resolved.recipe.plan.ignore_fit:
        raise ConfigError(resolved.recipe_path, "plan", f"{_gib(plan.host_bytes_per_node)} GiB host",
                          f"of host memory per node (each rank's model built on the host, offloaded state) exceeds the usable "
                          f"{_gib(plan.host_usable_bytes)} GiB",
                          "offload less (parallel.offload_params/offload_optimizer), use more nodes, or set plan.ignore_fit=true")
    if not bench and not plan.fits and not resolved.recipe.plan.ignore_fit:
        worst = plan.worst()
        raise ConfigError(resolved.recipe_path, "plan", f"{_gib(worst.memory[worst.implementation].total)} GiB",
                          f"exceeds the usable {_gib(worst.usable_bytes)} GiB on {worst.kind}",
                          "lower memory (zero_stage, tp, activation_checkpointing, micro_batch_size) or set plan.ignore_fit=true")
    launcher.preflight(resolved)
    if not bench and resolved.recipe.run.resume == "auto":
        done = _check_resume(resolved)
        if done is not None and done.step >= resolved.recipe.train.steps:
            print(f"nothing to do: {done.dir} already holds step {done.step} of train.steps="
                  f"{resolved.recipe.train.steps}; set run.resume=never to train again from scratch, or raise train.steps")
            return 0
    joined = shared_run_dir(resolved, os.environ)
    run = RunDir.join(joined) if joined else RunDir.create(resolved.recipe_name)
    cmd = launcher.build(resolved, str(run.root))
    if joined and run.resolved.is_file():
        if Resolved.load(run.resolved).to_json() != resolved.to_json():
            raise ConfigError(str(run.resolved), "LAYOUTLAB_RUN_DIR", joined, "was resolved differently on node 0",
                              "run the same recipe and overrides on every node")
    else:
        run.write_text_atomic(run.resolved, resolved.to_json() + "\n")
        run.write_text_atomic(run.plan, plan.to_json() + "\n")
    node = nodes.placement(os.environ, resolved.recipe.hardware.nodes).node_rank
    run.write_text_atomic(run.env if node == 0 else run.root / f"env_node{node}.json",
                          json.dumps(envinfo.capture(), indent=2) + "\n")
    run.write_text_atomic(run.launch_cmd if node == 0 else run.root / f"launch_cmd_node{node}.txt", cmd.shell() + "\n")
    for path, text in cmd.files.items():
        run.write_text_atomic(Path(path), text)
    render(resolved, plan, cmd, console)
    console.print(f"[bold]run directory[/bold] {_safe(str(run.root))}")
    from launch.extensions import ensure_op, needed_ops

    for op in [] if bench else needed_ops(resolved):
        ensure_op(op, console, env=dict(cmd.env))
    if bench:
        from launch.nccl_tests_runner import run_nccl_tests

        run_nccl_tests(resolved, run, console, env=dict(cmd.env))
    rc = _execute(cmd)
    if rc != 0:
        for line in failure_summary(run, resolved.world_size):
            print(line, file=sys.stderr)
    return rc


def shared_run_dir(resolved: Resolved, environ) -> str | None:
    """The run directory every node of a job writes: the one the user gave (LAYOUTLAB_RUN_DIR), or under SLURM one
    named after the job, which every node derives alike; None: this node creates a new one."""

    if environ.get("LAYOUTLAB_RUN_DIR"):
        return environ["LAYOUTLAB_RUN_DIR"]
    p = nodes.placement(environ, resolved.recipe.hardware.nodes)
    if p.job_id:
        return str(runs_root() / resolved.recipe_name / f"slurm-{p.job_id}")
    return None


def failure_summary(run: RunDir, world_size: int) -> list[str]:
    """After a failed run: what each rank recorded about its failure (RunDir.failure), and the last step it
    recorded."""
    from launch.metrics import read_metrics

    lines = [f"error: the run failed; per-rank logs are in {run.logs}"]
    for rank in range(world_size):
        said = ""
        try:
            record = json.loads(run.failure(rank).read_text())
            said = str(record.get("message", "")) if isinstance(record, dict) else ""
        except (OSError, ValueError):
            pass
        step = ""
        if run.metrics(rank).is_file():
            steps = read_metrics(run.metrics(rank)).steps
            step = f"last recorded step {steps[-1].step if steps else 0}"
        lines.append(f"  rank {rank}: " + "; ".join(x for x in (step, said) if x) if (step or said) else
                     f"  rank {rank}: no failure recorded (killed, or stopped by torchrun); see {run.stderr(rank)}")
    return lines


def _check_resume(resolved: Resolved):
    """Refuse an impossible resume before any rank starts (the trainer checks again, for the record)."""
    from launch.checkpoints import check_resume_compatible, find_resume, to_universal

    ckpt, notes = find_resume(runs_root() / resolved.recipe_name, resolved)
    for note in notes:
        print(f"note: {note}")
    first_node = nodes.placement(os.environ, resolved.recipe.hardware.nodes).node_rank == 0
    # raises ResumeError: one line, exit 2; only node 0 converts (the nodes share the folder it writes)
    if ckpt is not None and check_resume_compatible(ckpt, resolved) and first_node:
        from rich.console import Console

        # Before any rank starts: converting a large checkpoint takes minutes, longer than the watchdog allows.
        with Console().status(f"converting {ckpt.dir} to DeepSpeed's universal format for the new layout"):
            to_universal(ckpt)
    return ckpt


def _term_with_parent() -> None:
    """In the launcher child: SIGTERM when this CLI dies, so torchrun can stop its ranks in order."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _execute(cmd: launcher.LaunchCommand) -> int:
    """Run the launcher in our process group: a Ctrl-C or a kill of the group reaches every rank, and
    torchrun (which stops all ranks when one fails) gets SIGTERM if we are killed alone."""
    proc = subprocess.Popen(list(cmd.argv), env={**os.environ, **cmd.env}, preexec_fn=_term_with_parent)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    # Ctrl-C already reaches torchrun through the terminal's process group; do not die before it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "run":
            return cmd_run(rest)
        if command == "plan":
            from launch.compare import cmd_plan

            return cmd_plan(rest)
        if command == "recommend":
            from launch.recommend import cmd_recommend

            return cmd_recommend(rest)
        if command == "sweep":
            from launch.sweep import cmd_sweep

            return cmd_sweep(rest)
        if command == "calibrate":
            from launch.calibrate import cmd_calibrate

            return cmd_calibrate(rest)
        if command == "export":
            from launch.export import cmd_export

            return cmd_export(rest)
        if command == "export-accelerate":
            from launch.export_accelerate import cmd_export_accelerate

            return cmd_export_accelerate(rest)
        raise ConfigError("command line", "command", command, "is not a command", "use `run`, `plan`, `calibrate`, `recommend`, `sweep`, `export` or `export-accelerate`")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ResumeError as e:
        print(f"error: resume: {e}", file=sys.stderr)
        return 2
