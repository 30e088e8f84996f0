"""`bash launch/run.sh recipes/NAME [key=value ...] [--dry-run]` (`python -m launch run`): resolve, plan, check every
input, create the run directory and start the ranks."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launch.commands.args import read
from launch.commands.render import gib, make_console, render, summary
from launch.config import adapters
from launch.config.backends import traits
from launch.config.grid import shown_nodes
from launch.config.resolve import Resolved, resolve_path
from launch.data.check import DataCheck
from launch.data.check import check as check_data
from launch.errors import ConfigError
from launch.inputs import weights_fingerprint
from launch.plan.build import plan_resolved
from launch.plan.layout import Plan
from launch.run import envinfo, launcher, nodes
from launch.run.failures import failure_summary, users_to_mend
from launch.run.nodes import shared_run_dir
from launch.outputs import write_atomic
from launch.run.rundir import RunDir, runs_root
from launch.run.timesource import time_source

USAGE = "usage: bash launch/run.sh recipes/NAME [dotted.key=value ...] [--dry-run]"


def cmd_run(args: Sequence[str]) -> int:
    if nodes.in_slurm_job(os.environ):
        # SLURM's time-limit warning (launch/slurm.sbatch) may come before the ranks start: it would end this process
        # and the job's step with it; launcher.execute turns it into the ranks' stop request once they run
        signal.signal(launcher.STOP_SIGNAL, signal.SIG_IGN)
    a = read(args, command="run.sh", usage=USAGE, positional=(1, 1), overrides=True, dry_run=True)
    dry, recipe, overrides = a.dry_run, a.positional[0], list(a.overrides)
    machine = envinfo.machine()
    resolved = resolve_path(recipe, overrides)
    source = time_source(resolved, overrides, machine)
    if source.calibration:
        resolved = resolve_path(recipe, source.overrides)
    for line in source.lines:
        print(line)
    plan = plan_resolved(resolved, machine)
    console = make_console()
    resolved, data = check_inputs(resolved)
    for line in data.lines if data else ():
        print(line)
    if dry:
        run_dir = str(runs_root() / resolved.recipe_name / "<UTC yyyymmdd-hhmmss>")  # where the real run would go
        cmd = launcher.build(resolved, run_dir)
        nodes_n = resolved.recipe.hardware.nodes
        per_node = launcher.node_commands(resolved, run_dir, node_ranks=shown_nodes(nodes_n)) if nodes_n > 1 else []
        render(resolved, plan, cmd, console, per_node)
        return 0
    bench = resolved.recipe.run.mode == "commbench"  # the collective sweep needs no trainer, memory fit or checkpoint
    if not bench:
        _refuse_what_cannot_train(resolved, plan)
    launcher.preflight(resolved)
    four_bit_preflight([resolved])
    joined = shared_run_dir(resolved, os.environ)
    _refuse_a_wrong_start(resolved, joined, bench)
    resumed = None
    if not bench and resolved.recipe.run.resume != "never":
        resumed = check_resume(resolved, joined)
        if resumed is not None and resumed.step >= resolved.recipe.train.steps:
            print(f"nothing to do: {resumed.dir} already holds step {resumed.step} of train.steps="
                  f"{resolved.recipe.train.steps}; set run.resume=never to train again from scratch, or raise train.steps (a run on a constant "
                  "train.lr_schedule continues; a cosine or linear one is laid over its steps)")
            return 0
    run = RunDir.join(joined) if joined else RunDir.create(resolved.recipe_name)
    # the checkpoint checked above is the one the ranks load (a concurrent run's newer one is not picked up)
    cmd = launcher.build(resolved, str(run.root), resume="" if bench or resumed is None else str(resumed.dir))
    _write_records(run, joined, resolved, plan, data, cmd)
    summary(resolved, plan, cmd, str(run.root), console)
    from launch.run.extensions import ensure_op, needed_ops

    for op in [] if bench else needed_ops(resolved):
        ensure_op(op, console, env=dict(cmd.env))
    if bench:
        from launch.run.nccl_tests_runner import run_nccl_tests

        run_nccl_tests(resolved, run, console, env=dict(cmd.env))
    rc = launcher.execute(cmd)
    if rc != 0:
        for line in failure_summary(run, resolved.world_size):
            print(line, file=sys.stderr)
        if users_to_mend(run, resolved.world_size):
            return 2
    return rc


def _refuse_what_cannot_train(resolved: Resolved, plan: Plan) -> None:
    """A backend whose packages are missing, or a plan that does not fit (host or device) unless plan.ignore_fit."""
    missing = traits(resolved.recipe.backend).missing_packages()
    if missing:
        raise ConfigError(resolved.recipe_path, "backend", resolved.recipe.backend,
                          f"needs {', '.join(missing)}, which is not installed",
                          'install the project as README says (pip install -e ".[test]")')
    if not plan.host_fits and not resolved.recipe.plan.ignore_fit:
        raise ConfigError(resolved.recipe_path, "plan", f"{gib(plan.host_bytes_per_node)} GiB host",
                          f"of host memory per node (each rank's model built on the host, offloaded state) exceeds the usable "
                          f"{gib(plan.host_usable_bytes)} GiB",
                          "offload less (parallel.offload_params/offload_optimizer), use more nodes, or set plan.ignore_fit=true")
    if not plan.fits and not resolved.recipe.plan.ignore_fit:
        worst = plan.worst()
        shown = "" if resolved.recipe.plan.expect_fit else " (this recipe is shipped to show a layout that does not fit)"
        raise ConfigError(resolved.recipe_path, "plan", f"{gib(worst.memory[worst.implementation].total)} GiB",
                          f"exceeds the usable {gib(worst.usable_bytes)} GiB on {worst.kind}{shown}",
                          "lower memory (zero_stage, tp, activation_checkpointing, micro_batch_size) or set plan.ignore_fit=true")


def _refuse_a_wrong_start(resolved: Resolved, joined: str | None, bench: bool) -> None:
    """Node 0 joining a run that already started, or a requeued SLURM job that would train again from step 0."""
    node_rank = nodes.placement(os.environ, resolved.recipe.hardware.nodes).node_rank
    if joined and node_rank == 0 and os.environ.get("LAYOUTLAB_RUN_DIR") and RunDir.is_run_dir(joined):
        # Node 0 starts a run; only the other nodes join one. A LAYOUTLAB_RUN_DIR left in the shell from an earlier
        # launch would otherwise append this run's steps to that run's records and replace its launch command.
        raise ConfigError("environment", "LAYOUTLAB_RUN_DIR", joined, "names a run that already started (it holds "
                          "resolved.json); node 0 never joins one", "unset LAYOUTLAB_RUN_DIR (it is for nodes > 0 of a "
                          "multi-node job, which join the directory node 0 printed)")
    if not bench and resolved.recipe.run.resume == "never" and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        # a requeued job (launch/slurm.sbatch requeues at the time limit) that trained again from scratch would be
        # stopped and requeued again at the same point, for ever
        raise ConfigError(resolved.recipe_path, "run.resume", "never", "in a requeued SLURM job would train again "
                          "from step 0 and be requeued again at its time limit", "set run.resume=auto (the default)")


def _write_records(run: RunDir, joined: str | None, resolved: Resolved, plan: Plan, data: DataCheck | None,
                   cmd: launcher.LaunchCommand) -> None:
    """The run directory's records of this launch: resolved.json and plan.json (node 0's; a joining node checks it
    resolved the same), the data check, this node's environment and launch command, the command's files."""
    if joined and run.resolved.is_file():
        if Resolved.load(run.resolved).to_json() != resolved.to_json():
            raise ConfigError(str(run.resolved), "LAYOUTLAB_RUN_DIR", joined, "was resolved differently on node 0",
                              "run the same recipe and overrides on every node")
    else:
        run.write_text_atomic(run.resolved, resolved.to_json() + "\n")
        run.write_text_atomic(run.plan, plan.to_json() + "\n")
    if data is not None:
        data.save(run.data, write_atomic)  # on every node: a node without the shared folder still finds its copy
    node = nodes.placement(os.environ, resolved.recipe.hardware.nodes).node_rank
    run.write_text_atomic(run.env if node == 0 else run.root / f"env_node{node}.json",
                          json.dumps(envinfo.capture(), indent=2) + "\n")
    run.write_text_atomic(run.launch_cmd if node == 0 else run.root / f"launch_cmd_node{node}.txt", cmd.shell() + "\n")
    for path, text in cmd.files.items():
        run.write_text_atomic(Path(path), text)


def check_inputs(resolved: Resolved) -> tuple[Resolved, DataCheck | None]:
    """The one check of the files a run's ranks read, before any rank starts and on a dry run too (recipes and
    configs are checked as they are resolved; a resume's checkpoint once it is chosen): model.weights (its
    safetensors headers against the model; a fine-tune's record gains their fingerprint, which its checkpoints'
    identity holds) and the training data, whose digest the resolved record gains."""
    if resolved.recipe.model.weights:
        launcher.weights_preflight(resolved.recipe_path, Path(resolved.recipe.model.weights), resolved.model)
        if adapters.adapted(resolved.recipe.peft):
            resolved = dataclasses.replace(resolved, weights_fingerprint=weights_fingerprint(
                Path(resolved.recipe.model.weights)))
    if resolved.recipe.run.mode == "commbench":  # the collective sweep reads neither
        return resolved, None
    data = check_data(resolved)
    return (resolved if data is None else dataclasses.replace(resolved, data_fingerprint=data.fingerprint)), data


# The 4-bit check's limit: it imports torch and bitsandbytes and runs one small layer (3 s here); a wedged driver
# must not hang the CLI.
FOUR_BIT_CHECK_TIMEOUT_S = 300


def four_bit_preflight(runs: Sequence[Resolved]) -> None:
    """QLoRA: that bitsandbytes trains a 4-bit NF4 layer on the device this machine's ranks use (launch.torchtools.
    four_bit), in a process of its own (it needs torch), once per device and dtype among `runs`. Before ranks start on
    this machine, not on a dry run: CPU ranks, or a GPU recipe on a machine with GPUs."""
    asked = {}
    for r in runs:
        hw = r.hardware
        if r.recipe.peft.method == "qlora" and not (hw.device_type == "cuda" and not launcher.local_gpu_count()):
            asked.setdefault((hw.device_type, r.recipe.precision.dtype), r)
    for (device_type, dtype), r in asked.items():
        try:
            p = subprocess.run([sys.executable, "-m", "launch.torchtools.four_bit", device_type, dtype],
                               capture_output=True, text=True, timeout=FOUR_BIT_CHECK_TIMEOUT_S)
            said = p.stderr.strip().splitlines()
            why = None if p.returncode == 0 else (said[-1].removeprefix("error: ") if said else
                                                  f"the 4-bit check failed (exit {p.returncode})")
        except subprocess.TimeoutExpired:
            why = f"the 4-bit check did not finish within {FOUR_BIT_CHECK_TIMEOUT_S} s (a device that does not answer?)"
        if why:
            raise ConfigError(r.recipe_path, "peft.method", "qlora", f"cannot train here: {why}",
                              "install bitsandbytes as constraints.txt pins it, in a build for this machine's device, "
                              'or set peft.method="lora"')


def untrusted_files(path: Path, resolved: Resolved | None = None) -> str | None:
    """What launch.torchtools.untrusted says of the checkpoint files under `path` (None: nothing that would run code
    and, with `resolved` on the torch backend, every model tensor a DCP checkpoint holds in the model's shape). A
    process of its own: it needs torch, which the CLI never imports."""
    shapes = ({p.name: list(p.shape) for p in adapters.checkpointed_parameters(resolved.model, resolved.recipe.peft)}
              if resolved is not None and traits(resolved.recipe.backend).checkpoint_format == "dcp" else None)
    p = subprocess.run([sys.executable, "-m", "launch.torchtools.untrusted", *(["--shapes=-"] if shapes else []),
                        str(path)], input=json.dumps(shapes) if shapes else None, capture_output=True, text=True)
    if p.returncode == 0:
        return None
    said = p.stderr.strip().splitlines()  # one line: the check's own, or the last of whatever ended it
    return said[-1].removeprefix("error: ") if said else f"the check of {path} failed (exit {p.returncode})"


def check_resume(resolved: Resolved, joined: str | None):
    """Refuse an impossible resume before any rank starts (the trainer checks again, for the record). A run directory
    this node joins that holds checkpoints of its own (a requeued SLURM job keeps its id, so its directory) continues
    from its newest, as its rank 0 will, whatever newer checkpoint another run of the recipe wrote meanwhile."""
    from launch.run.checkpoints import (
        ResumeChoice,
        ResumeError,
        check_resume_compatible,
        choose_resume,
        complete_checkpoints,
        to_universal,
    )

    own = complete_checkpoints(Path(joined) / "checkpoints") if joined else []
    choice = (ResumeChoice(own[-1], (f"continuing {joined} at step {own[-1].step}, its newest checkpoint",)) if own
              else choose_resume(resolved, runs_root() / resolved.recipe_name))
    for line in choice.lines:
        print(line)
    ckpt = choice.checkpoint
    if ckpt is not None:
        refused = untrusted_files(ckpt.dir, resolved)
        if refused:
            raise ResumeError(refused)
    first_node = nodes.placement(os.environ, resolved.recipe.hardware.nodes).node_rank == 0
    # raises ResumeError: one line, exit 2; only node 0 converts (the nodes share the folder it writes)
    if ckpt is not None and check_resume_compatible(ckpt, resolved) and first_node:
        from rich.console import Console

        # Before any rank starts: converting a large checkpoint takes minutes, longer than the watchdog allows.
        with Console().status(f"converting {ckpt.dir} to DeepSpeed's universal format for the new layout"):
            to_universal(ckpt)
    return ckpt
