"""NVIDIA nccl-tests beside the built-in sweep: the reference our busbw is compared with.

Before the ranks of a `run.mode = "commbench"` run start (the GPUs are still free), the CLI runs
`all_reduce_perf`, `all_gather_perf`, `reduce_scatter_perf`, `alltoall_perf`, `broadcast_perf` and
`sendrecv_perf` (those of `commbench.ops`) with the recipe's topology and the sweep's sizes, dtype
and iteration counts, and stores each output in `commbench/nccl-tests/<op>.txt` (NCCL's INFO log
beside it as `<op>.nccl.<host>.<pid>.log`: what NCCL chose). Invocations:

  one node:   all_reduce_perf -b MIN -e MAX -f F -d TYPE -w W -n N -c 1 -g GPUS_PER_NODE
  many nodes: srun --overlap --nodes NODES --ntasks WORLD --ntasks-per-node GPUS_PER_NODE
                   --cpus-per-task CPUS --mpi=pmix all_reduce_perf ... -g 1
              (inside a Slurm allocation, from within its running step: --overlap shares the step's CPUs, memory
              and GPUs instead of waiting for them, and the counts are given because srun would take the step's
              own from SLURM_NTASKS / SLURM_CPUS_PER_TASK), else
              mpirun -np WORLD --map-by ppr:GPUS_PER_NODE:node [--hostfile $LAYOUTLAB_HOSTFILE]
                     -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS -x NCCL_DEBUG_FILE [-x NCCL_...] all_reduce_perf ... -g 1
              (every NCCL_* / UCX_* variable set here travels along: srun carries the whole environment, mpirun only
              what -x names) from node 0 only; the binaries must be built with `make MPI=1`.

`commbench.group = "inter_node"` runs one process per node; tp/dp/pp groups and explicit `ranks`
have no nccl-tests equivalent here, so nccl-tests measures the whole world and says so. Missing
binaries, a CPU profile or a missing MPI launcher are one printed line each, never an error: the
built-in sweep runs regardless.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from launch.comm.commbench_spec import DTYPES
from launch.comm.nccl_format import NCCL_TESTS_OP
from launch.run import nodes
from launch.run.rundir import RunDir

HOW_TO_GET = ("build them from https://github.com/NVIDIA/nccl-tests with `make MPI=1 MPI_HOME=... CUDA_HOME=... "
              "NCCL_HOME=...` and put nccl-tests/build on PATH (or use the project's container once it exists)")
NCCL_ENV = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")
# The network's variables (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, UCX_NET_DEVICES, ...: docs/multinode.md), which mpirun
# passes to the processes it starts on other nodes only when named.
PASS_THROUGH = ("NCCL_", "UCX_")


@dataclass(frozen=True)
class Invocation:
    op: str  # our name (all_to_all), which names the output file
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the caller's environment
    output: Path

    def shell(self) -> str:
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assigns} {shlex.join(self.argv)}".strip()


def binary(op: str) -> str:
    return f"{NCCL_TESTS_OP[op]}_perf"


def invocations(resolved, run: RunDir, *, launch_env: Mapping[str, str], environ: Mapping[str, str],
                which: Callable[[str], str | None]) -> tuple[list[Invocation], list[str]]:
    """What to run for this recipe, and the lines to print about what will not run (pure)."""
    cb, grid = resolved.recipe.commbench, resolved.grid
    if resolved.hardware.device_type == "cpu":
        return [], ["commbench: nccl-tests skipped: the CPU profile runs gloo ranks, and nccl-tests need NVIDIA GPUs"]
    if not cb.nccl_tests:
        return [], []
    missing = [binary(op) for op in cb.ops if which(binary(op)) is None]
    notes = []
    if missing:
        notes.append(f"commbench: nccl-tests not found on PATH ({', '.join(missing)}); {HOW_TO_GET}; "
                     "continuing with the built-in sweep")
    ops = [op for op in cb.ops if binary(op) not in missing]
    if not ops:
        return [], notes
    per_node = 1 if cb.group == "inter_node" else grid.gpus_per_node
    if cb.ranks or cb.group in ("tp", "dp", "pp"):
        chosen = f"commbench.ranks={list(cb.ranks)}" if cb.ranks else f'commbench.group="{cb.group}"'
        notes.append(f"commbench: nccl-tests measure all {grid.world} ranks; the built-in sweep measures {chosen}")
    if grid.nodes == 1:
        prefix: list[str] = []
        gpus = per_node
    else:
        if environ.get("NODE_RANK", "0") != "0":
            return [], notes + ["commbench: nccl-tests run from node 0 only"]
        gpus = 1  # one process per GPU, started by the MPI launcher
        if nodes.in_slurm_job(environ) and which("srun"):
            cpus = environ.get("SLURM_CPUS_ON_NODE", "")  # this step's CPUs on the node, shared by its processes
            per_task = max(1, int(cpus) // per_node) if cpus.isdigit() else 1
            prefix = ["srun", "--overlap", "--nodes", str(grid.nodes), "--ntasks", str(grid.nodes * per_node),
                      "--ntasks-per-node", str(per_node), "--cpus-per-task", str(per_task), "--mpi=pmix"]
        elif which("mpirun"):
            prefix = ["mpirun", "-np", str(grid.nodes * per_node), "--map-by", f"ppr:{per_node}:node"]
            if environ.get("LAYOUTLAB_HOSTFILE"):
                prefix += ["--hostfile", environ["LAYOUTLAB_HOSTFILE"]]
            own = (*NCCL_ENV, "NCCL_DEBUG_FILE")
            for name in (*own, *sorted(k for k in environ if k.startswith(PASS_THROUGH) and k not in own)):
                prefix += ["-x", name]
        else:
            return [], notes + [f"commbench: nccl-tests on {grid.nodes} nodes need mpirun (Open MPI) or srun on PATH; "
                                "skipped"]
    common = ["-b", str(cb.min_bytes), "-e", str(cb.max_bytes), "-f", str(cb.step_factor),
              "-d", DTYPES[cb.dtype].nccl_tests_name, "-w", str(cb.warmup_iters), "-n", str(cb.iters), "-c", "1",
              "-g", str(gpus)]
    out = []
    for op in ops:
        env = {k: launch_env[k] for k in NCCL_ENV if k in launch_env}
        env["NCCL_DEBUG_FILE"] = str(run.nccl_tests / f"{op}.nccl.%h.%p.log")  # NCCL expands host and pid
        out.append(Invocation(op, (*prefix, binary(op), *common), env, run.nccl_tests_text(op)))
    return out, notes


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first, so that mpirun/srun can stop the *_perf processes they started on other nodes (a SIGKILL
    would leave them holding the GPUs); SIGKILL only if they do not go."""
    import signal

    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_nccl_tests(resolved, run: RunDir, console, *, env: Mapping[str, str]) -> None:
    """Run what `invocations` says, each within run.timeout_s; failures are reported and skipped."""
    todo, notes = invocations(resolved, run, launch_env=env, environ=os.environ, which=shutil.which)
    for line in notes:
        console.print(line, markup=False)
    if not todo:
        return
    run.nccl_tests.mkdir(parents=True, exist_ok=True)
    run.write_text_atomic(run.nccl_tests / "commands.txt", "".join(inv.shell() + "\n" for inv in todo))
    timeout = resolved.recipe.run.timeout_s
    for inv in todo:
        console.print(f"nccl-tests: {inv.shell()}", markup=False)
        err = inv.output.with_suffix(".err")
        with inv.output.open("w") as stdout, err.open("w") as stderr:
            proc = subprocess.Popen(inv.argv, env={**os.environ, **inv.env}, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                console.print(f"nccl-tests: {binary(inv.op)} ran past run.timeout_s={timeout}; partial output in "
                              f"{inv.output}", markup=False)
                continue
        if rc:
            console.print(f"nccl-tests: {binary(inv.op)} exited with {rc}; see {err}", markup=False)
        else:
            console.print(f"nccl-tests: {inv.op} -> {inv.output}", markup=False)
