"""The exact command (argv + environment) that starts the trainer ranks for a resolved recipe."""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Mapping

TRAIN_MODULE = "launch.train"


@dataclass(frozen=True)
class LaunchCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the caller's environment

    def shell(self) -> str:
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assigns} {shlex.join(self.argv)}".strip()


def cpu_threads(ranks_per_node: int, cores: int | None = None) -> int:
    """OMP threads per rank so that ranks × threads fit the cores (oversubscription slows gloo ranks badly)."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, ranks_per_node))


def build(resolved, run_dir: str, *, environ: Mapping[str, str] | None = None, module: str = TRAIN_MODULE) -> LaunchCommand:
    """The command that starts `module` (a rank program taking RUN_DIR) on every rank of the recipe."""
    environ = os.environ if environ is None else environ
    r = resolved.recipe
    hw = r.hardware
    from launch.extensions import extensions_dir

    env: dict[str, str] = {"LAYOUTLAB_RUN_DIR": run_dir, "TORCH_EXTENSIONS_DIR": str(extensions_dir())}
    if resolved.hardware.name == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["OMP_NUM_THREADS"] = str(cpu_threads(hw.gpus_per_node))
    else:
        # The trainer points NCCL_DEBUG_FILE at nccl/rank{R}.log before the process group starts.
        env["NCCL_DEBUG"] = environ.get("NCCL_DEBUG", "INFO")
        env["NCCL_DEBUG_SUBSYS"] = environ.get("NCCL_DEBUG_SUBSYS", "INIT,NET,GRAPH,ENV")
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    master_addr = environ.get("MASTER_ADDR", "127.0.0.1")  # multi-node: preflight requires it
    # A fixed port would make two jobs on one host meet in the same rendezvous store.
    master_port = environ.get("MASTER_PORT") or str(free_port())
    py = sys.executable
    if r.run.launcher == "deepspeed":
        argv = [py, "-m", "deepspeed.launcher.runner", "--num_nodes", str(hw.nodes), "--num_gpus", str(hw.gpus_per_node),
                "--master_port", master_port]
        if environ.get("MASTER_ADDR"):  # otherwise DeepSpeed takes the first host of the hostfile
            argv += ["--master_addr", master_addr]
        if environ.get("LAYOUTLAB_HOSTFILE"):
            argv += ["--hostfile", environ["LAYOUTLAB_HOSTFILE"]]
        argv += ["--module", module, run_dir]
    else:
        argv = [py, "-m", "torch.distributed.run", "--nnodes", str(hw.nodes), "--nproc-per-node", str(hw.gpus_per_node)]
        if hw.nodes == 1:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{master_port}"]
        else:
            argv += ["--node-rank", environ.get("NODE_RANK", "0"), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", resolved.recipe_name]
        # A failed rank makes torchrun stop every other rank; restarts are resume=auto's job, not torchrun's.
        argv += ["--max-restarts", "0", "-m", module, run_dir]
    if r.run.profile == "nsys":
        # One report per node (it covers every rank on the node), exported to SQLite when profiling
        # ends so that the analysis reads it without nsys installed.
        env["NODE_RANK"] = environ.get("NODE_RANK", "0")
        argv = ["nsys", "profile", "--trace", "cuda,nvtx,osrt", "--sample", "none", "--force-overwrite", "true",
                "--export", "sqlite", "--output", f"{run_dir}/traces/nsys_node%q{{NODE_RANK}}", *argv]
    return LaunchCommand(tuple(argv), env)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_gpu_count() -> int:
    """NVIDIA devices on this machine, without importing torch (the driver creates /dev/nvidiaN)."""
    import glob

    return len(glob.glob("/dev/nvidia[0-9]*"))


def preflight(resolved, *, which=None, gpus: int | None = None) -> None:
    """What must exist on this machine before ranks start (the dry-run shows the command regardless)."""
    import shutil

    from launch.errors import ConfigError

    which = which or shutil.which
    r = resolved.recipe
    gpus = local_gpu_count() if gpus is None else gpus
    if resolved.hardware.name != "cpu" and r.run.mode == "train" and gpus < r.hardware.gpus_per_node:
        # Without this, every rank would build the full-size model in host memory before failing.
        raise ConfigError(resolved.recipe_path, "hardware.profile", r.hardware.profile,
                          f"needs {r.hardware.gpus_per_node} GPU(s) per node; this machine has {gpus}",
                          "run it on the GPU machine (--dry-run shows the plan anywhere), or train on CPU ranks "
                          "with hardware.profile=cpu and a tiny model")
    if r.run.profile == "nsys" and which("nsys") is None:
        raise ConfigError(resolved.recipe_path, "run.profile", "nsys", "needs Nsight Systems' `nsys` on PATH",
                          'install Nsight Systems (it ships with the CUDA toolkit) or set run.profile="torch"')
    if r.run.launcher == "torchrun" and r.hardware.nodes > 1 and not os.environ.get("MASTER_ADDR"):
        raise ConfigError(resolved.recipe_path, "hardware.nodes", r.hardware.nodes,
                          "needs MASTER_ADDR (node 0's address) for torchrun's rendezvous",
                          "on every node: export MASTER_ADDR=<node 0> NODE_RANK=<n>, and on nodes > 0 also "
                          "LAYOUTLAB_RUN_DIR=<the run directory node 0 printed>")
    if r.run.launcher == "deepspeed" and r.hardware.nodes > 1 and not os.environ.get("LAYOUTLAB_HOSTFILE"):
        raise ConfigError(resolved.recipe_path, "run.launcher", "deepspeed",
                          f"needs a hostfile for {r.hardware.nodes} nodes",
                          "export LAYOUTLAB_HOSTFILE=/path/to/hostfile (lines `host slots=N`), or use run.launcher=torchrun")
