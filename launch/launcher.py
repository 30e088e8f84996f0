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


def build(resolved, run_dir: str, *, environ: Mapping[str, str] | None = None) -> LaunchCommand:
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
    master_addr = environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = environ.get("MASTER_PORT", "29500")
    py = sys.executable
    if r.run.launcher == "deepspeed":
        argv = [py, "-m", "deepspeed.launcher.runner", "--num_nodes", str(hw.nodes), "--num_gpus", str(hw.gpus_per_node),
                "--master_addr", master_addr, "--master_port", master_port]
        if environ.get("LAYOUTLAB_HOSTFILE"):
            argv += ["--hostfile", environ["LAYOUTLAB_HOSTFILE"]]
        argv += ["--module", TRAIN_MODULE, run_dir]
    else:
        argv = [py, "-m", "torch.distributed.run", "--nnodes", str(hw.nodes), "--nproc-per-node", str(hw.gpus_per_node)]
        if hw.nodes == 1:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{master_port}"]
        else:
            argv += ["--node-rank", environ.get("NODE_RANK", "0"), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", resolved.recipe_name]
        # A failed rank makes torchrun stop every other rank; restarts are resume=auto's job, not torchrun's.
        argv += ["--max-restarts", "0", "-m", TRAIN_MODULE, run_dir]
    if r.run.profile == "nsys":
        argv = ["nsys", "profile", "--trace", "cuda,nvtx,osrt", "--sample", "none", "--force-overwrite", "true",
                "--output", f"{run_dir}/traces/nsys_node%q{{NODE_RANK}}", *argv]
    return LaunchCommand(tuple(argv), env)
