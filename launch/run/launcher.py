"""The exact command (argv + environment) that starts the trainer ranks for a resolved recipe."""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from launch.config.backends import traits
from launch.run import nodes
from launch.run.rankenv import RESUME_PINNED, STOP_REQUEST, STOP_SIGNAL
from launch.run.rundir import RunDir

TRAIN_MODULE = "launch.ranks.train"


@dataclass(frozen=True)
class LaunchCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the caller's environment
    # Written into the run directory before the command starts (path -> text): what the launcher reads.
    files: Mapping[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assigns} {shlex.join(self.argv)}".strip()


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one node of a job: the launcher there (torchrun), or what DeepSpeed's runner starts there."""

    node_rank: int
    host: str | None  # the hostfile's name for it, when one says
    command: LaunchCommand


# Shown in a dry run of a multi-node layout when nothing names node 0 yet (a real run refuses to start then).
NODE0_PLACEHOLDER = "<node 0 address>"


def cpu_threads(ranks_per_node: int, cores: int | None = None) -> int:
    """OMP threads per rank so that ranks × threads fit the cores (oversubscription slows gloo ranks badly).
    The ranks are not bound to cores: bound one core each (as DeepSpeed's --bind_cores_to_rank does), 2 gloo ranks
    of a 2-core machine ran an 8-byte all_reduce 2.5x faster but TP2 and ZeRO-3 steps of tiny_zero2 ~25% slower
    (2026-12-03; the rank's gloo and helper threads then share its one core)."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, ranks_per_node))


def rank_env(resolved, run_dir: str, environ: Mapping[str, str], resume: str | None = None) -> dict[str, str]:
    """What every rank needs in its environment, whichever launcher starts it; `resume`: the checkpoint the CLI
    chose for it (RESUME_PINNED), None where nobody chose yet."""
    from launch.run.extensions import extensions_dir

    # Every torch.load weights-only, whatever the caller asks (torch honours it over weights_only=False): a second
    # wall behind launch.torchtools.untrusted's guard, for loads that do not go through torch.load's attribute.
    env: dict[str, str] = {"LAYOUTLAB_RUN_DIR": run_dir, "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
                           "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
    if resume is not None:
        env[RESUME_PINNED] = resume
    if resolved.hardware.device_type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["OMP_NUM_THREADS"] = str(cpu_threads(resolved.recipe.hardware.gpus_per_node))
    else:
        # The trainer points NCCL_DEBUG_FILE at nccl/rank{R}.log before the process group starts.
        env["NCCL_DEBUG"] = environ.get("NCCL_DEBUG", "INFO")
        env["NCCL_DEBUG_SUBSYS"] = environ.get("NCCL_DEBUG_SUBSYS", "INIT,NET,GRAPH,ENV")
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        env.update({k: environ.get(k, v) for k, v in traits(resolved.recipe.backend).gpu_env(resolved.recipe).items()})
    return env


def _rendezvous(resolved, environ: Mapping[str, str]) -> tuple[nodes.Placement, str, str]:
    """(this node's placement, node 0's address, the port) as every node of the job derives them."""
    p = nodes.placement(environ, resolved.recipe.hardware.nodes)
    multi = resolved.recipe.hardware.nodes > 1
    addr = p.master_addr or (NODE0_PLACEHOLDER if multi else "127.0.0.1")
    # One node: a fixed port would make two jobs on one host meet in the same rendezvous store. torchrun binds port
    # 0 itself (its --standalone form): a port chosen here and bound seconds later was taken in between by another
    # job's gloo connection, and torch's rendezvous then joined that socket as a client and failed. Several nodes
    # must agree on it without talking, hence the default.
    if p.master_port or multi:
        return p, addr, p.master_port or str(nodes.DEFAULT_PORT)
    return p, addr, "0" if resolved.recipe.run.launcher == "torchrun" else str(free_port())


def build(resolved, run_dir: str, *, environ: Mapping[str, str] | None = None, module: str = TRAIN_MODULE,
          resume: str | None = None) -> LaunchCommand:
    """The command that starts `module` (a rank program taking RUN_DIR) on every rank of the recipe: on this node
    (torchrun), or on every host from the first one (DeepSpeed's runner with a hostfile)."""
    environ = os.environ if environ is None else environ
    r = resolved.recipe
    hw = r.hardware
    env = rank_env(resolved, run_dir, environ, resume)
    p, master_addr, master_port = _rendezvous(resolved, environ)
    files: dict[str, str] = {}
    py = sys.executable
    if r.run.launcher == "deepspeed":
        argv = [py, "-m", "deepspeed.launcher.runner", "--num_nodes", str(hw.nodes), "--num_gpus", str(hw.gpus_per_node),
                "--master_port", master_port]
        if hw.nodes > 1:
            # pdsh carries only NCCL*/PYTHON*-like variables to the other hosts; DeepSpeed also exports every
            # line of DS_ENV_FILE, so the ranks' environment travels in a file of the run directory.
            hostfile = environ.get("LAYOUTLAB_HOSTFILE")
            addr = p.master_addr or (nodes.read_hostfile(hostfile)[0].name if hostfile else NODE0_PLACEHOLDER)
            env_file = str(RunDir(Path(run_dir)).deepspeed_env)
            files[env_file] = "".join(f"{k}={v}\n" for k, v in env.items())
            env["DS_ENV_FILE"] = env_file
            # Given, so that DeepSpeed does not ssh to the first host to ask `hostname -I`.
            argv += ["--master_addr", addr, "--hostfile", hostfile or "<LAYOUTLAB_HOSTFILE>"]
        argv += ["--module", module, run_dir]
    else:
        argv = [py, "-m", "torch.distributed.run", "--nnodes", str(hw.nodes), "--nproc-per-node", str(hw.gpus_per_node)]
        if hw.nodes == 1:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{master_port}"]
        else:
            env.update(NODE_RANK=str(p.node_rank), MASTER_ADDR=master_addr, MASTER_PORT=master_port)
            argv += ["--node-rank", str(p.node_rank), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", p.job_id or resolved.recipe_name]
        # A failed rank makes torchrun stop every other rank, then start the group again while restarts are left:
        # the restarted ranks resume from the run's last complete checkpoint (run.resume=auto).
        argv += ["--max-restarts", str(r.run.max_restarts), "-m", module, run_dir]
    if r.run.profile == "nsys":
        # One report per node (it covers every rank on the node), exported to SQLite when profiling
        # ends so that the analysis reads it without nsys installed.
        env["NODE_RANK"] = str(p.node_rank)
        # It records only the profiled steps: the ranks open and close the capture range (cudaProfilerStart/Stop).
        argv = ["nsys", "profile", "--trace", "cuda,nvtx,osrt", "--sample", "none", "--force-overwrite", "true",
                "--capture-range", "cudaProfilerApi", "--capture-range-end", "stop",
                "--export", "sqlite", "--output", f"{run_dir}/traces/nsys_node%q{{NODE_RANK}}", *argv]
    return LaunchCommand(tuple(argv), env, files)


def node_commands(resolved, run_dir: str, *, environ: Mapping[str, str] | None = None, module: str = TRAIN_MODULE,
                  node_ranks: Sequence[int] | None = None) -> list[NodeCommand]:
    """One command per node (of `node_ranks`, default all), each naming its node rank: what to start on each node
    (torchrun), or what DeepSpeed's runner starts on each host over pdsh (the argv its PDSHRunner builds, `%n`
    filled in)."""
    environ = os.environ if environ is None else environ
    hw = resolved.recipe.hardware
    node_ranks = range(hw.nodes) if node_ranks is None else node_ranks
    if resolved.recipe.run.launcher != "deepspeed":
        return [NodeCommand(n, None, build(resolved, run_dir, environ={**environ, "NODE_RANK": str(n)}, module=module))
                for n in node_ranks]
    runner = build(resolved, run_dir, environ=environ, module=module)
    hostfile = environ.get("LAYOUTLAB_HOSTFILE")
    hosts = [h.name for h in nodes.check_hostfile(resolved, hostfile)] if hostfile else [f"node{n}" for n in range(hw.nodes)]
    argv = list(runner.argv)
    addr = argv[argv.index("--master_addr") + 1] if "--master_addr" in argv else "127.0.0.1"  # one node: local
    port = argv[argv.index("--master_port") + 1]
    world_info = base64.urlsafe_b64encode(json.dumps({h: list(range(hw.gpus_per_node)) for h in hosts})
                                          .encode("utf-8")).decode("utf-8")
    return [NodeCommand(n, host, LaunchCommand(
        (sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", f"--node_rank={n}",
         # DeepSpeed 0.19.8's PDSHRunner passes its argument's default, the string "None", along.
         f"--master_addr={addr}", f"--master_port={port}", "--module", "--enable_each_rank_log=None", module, run_dir),
        runner.env))
        for n, host in ((n, hosts[n]) for n in node_ranks)]


def free_port() -> int:
    """A port free now, for a launcher that must be told one (DeepSpeed's runner, Accelerate, a one-rank group).
    Chosen below the kernel's ephemeral range, where no process's outgoing or port-0 socket (gloo opens dozens) can
    take it before the launcher binds it; at random there, so two jobs starting together rarely pick the same."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = random.sample(range(nodes.CHOSEN_PORTS_FROM, low), min(64, max(0, low - nodes.CHOSEN_PORTS_FROM)))
    for port in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def local_gpu_count() -> int:
    """NVIDIA devices on this machine, without importing torch (the driver creates /dev/nvidiaN)."""
    import glob

    return len(glob.glob("/dev/nvidia[0-9]*"))


PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")


def weights_preflight(recipe_path: str, folder: Path, model) -> None:
    """A model.weights folder the ranks may read: safetensors (read as they are; a pickle-based .bin runs whatever
    it names when unpickled), no custom code (auto_map asks transformers to import the folder's own Python,
    which layoutlab never does: trust_remote_code stays off), and every tensor `model` needs, whole and of its
    shape: without this, a folder of other weights trained from random initialisation and exited 0."""
    from launch.errors import ConfigError
    from launch.inputs import parse_json, safetensors_header

    files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if not any(f.endswith(".safetensors") for f in files):
        pickled = [f for f in files if f.endswith(PICKLED_WEIGHTS)]
        raise ConfigError(recipe_path, "model.weights", str(folder),
                          f"holds {'pickle-based weights (' + pickled[0] + ')' if pickled else 'no weights'} and no "
                          "*.safetensors file; layoutlab reads safetensors only, never unpickles weights",
                          "convert them once, where you trust them: python -c \"from transformers import "
                          "AutoModelForCausalLM as M; M.from_pretrained('IN').save_pretrained('OUT')\", then set "
                          "model.weights=OUT")
    for name in ("config.json", "tokenizer_config.json"):
        if not os.path.lexists(folder / name):
            continue
        # numbers unchecked: transformers writes model_max_length = 1e30 there; only auto_map is read
        doc = parse_json(folder / name, context=recipe_path, field="model.weights", numbers=False)
        if isinstance(doc, dict) and doc.get("auto_map"):
            raise ConfigError(str(folder / name), "auto_map", sorted(doc["auto_map"])[:3],
                              "asks transformers to run the folder's own Python code, which layoutlab never does",
                              "use a model whose architecture transformers ships (remove auto_map if it is one)")
    stored = {}
    for f in sorted(folder.glob("*.safetensors")):
        stored.update(safetensors_header(f))
    need = model.parameters()
    missing = [p for p in need if p.name not in stored]
    if missing:
        raise ConfigError(recipe_path, "model.weights", str(folder),
                          f"lacks {len(missing)} of the {len(need)} tensors {model.name} needs (first: {missing[0].name})"
                          + ("; it holds none of them" if len(missing) == len(need) else ""),
                          "point model.weights at this model's own weights, or leave it unset to train from scratch")
    for p in need:
        if stored[p.name].shape != p.shape:
            raise ConfigError(str(folder / stored[p.name].file), p.name, list(stored[p.name].shape),
                              f"is not the shape {model.name} needs ({list(p.shape)})",
                              "point model.weights at weights of the model the recipe names (model.name / model.config)")


def preflight(resolved, *, which=None, gpus: int | None = None, environ: Mapping[str, str] | None = None) -> None:
    """What must exist on this machine before ranks start (the dry-run shows the command regardless)."""
    import shutil

    from launch.errors import ConfigError

    which = which or shutil.which
    r = resolved.recipe
    environ = os.environ if environ is None else environ
    need = r.hardware.gpus_per_node
    # Without this, every rank would build the full-size model in host memory before failing. Under SLURM the job's
    # grant counts, not the node's device files (nodes.slurm_gpus).
    if resolved.hardware.device_type == "cuda" and r.run.mode == "train":
        granted = nodes.slurm_gpus(environ) if gpus is None else None
        if granted is not None:
            count, name, value = granted
            if count < need:
                raise ConfigError("environment", name, value,
                                  f"gives this SLURM job {count} GPU(s) on this node, fewer than "
                                  f"hardware.gpus_per_node={need}", f"submit with sbatch --gpus-per-node={need} "
                                  "launch/slurm.sbatch ..., or lower hardware.gpus_per_node")
        elif (gpus := local_gpu_count() if gpus is None else gpus) < need:
            raise ConfigError(resolved.recipe_path, "hardware.profile", r.hardware.profile,
                              f"needs {need} GPU(s) per node; this machine has {gpus}",
                              "run it on the GPU machine (--dry-run shows the plan anywhere), or train on CPU ranks "
                              "with hardware.profile=cpu and a tiny model")
    if (resolved.hardware.device_type == "cuda" and environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
            and (r.parallel.zero_stage == 3 or (r.backend == "torch" and r.parallel.zero_stage == 2))):
        # The launcher keeps a value the user's environment sets; this one breaks what the plan assumes of the layout.
        raise ConfigError("environment", "CUDA_DEVICE_MAX_CONNECTIONS", "1",
                          f"puts every kernel on one hardware queue, so each of {r.backend}'s prefetched parameter "
                          "gathers (ZeRO-3, FSDP2) waits behind the compute issued before it, which the plan counts as "
                          "hidden (Megatron-LM refuses it with FSDP)",
                          "unset it: the launcher sets it where the layout needs it (Megatron TP without ZeRO-3)")
    if r.run.profile == "nsys" and which("nsys") is None:
        raise ConfigError(resolved.recipe_path, "run.profile", "nsys", "needs Nsight Systems' `nsys` on PATH",
                          'install Nsight Systems (it ships with the CUDA toolkit) or set run.profile="torch"')
    if r.train.attention == "te" and importlib.util.find_spec("transformer_engine") is None:
        # looked up, not imported: importing TE imports torch, which the launching side never does
        raise ConfigError(resolved.recipe_path, "train.attention", "te", "needs Transformer Engine, which is not "
                          "installed here", 'pip install "transformer-engine[pytorch]" on the GPU machine, or set '
                          'train.attention="sdpa"')
    p = nodes.placement(environ, r.hardware.nodes)
    nodes.check(resolved, p)
    if r.run.launcher == "deepspeed" and p.job_id:
        # srun starts one launcher per node, and DeepSpeed's runner would start every node again from each.
        raise ConfigError(resolved.recipe_path, "run.launcher", "deepspeed",
                          "under SLURM starts the job once per node (srun runs one launcher on each)",
                          "use run.launcher=torchrun with launch/slurm.sbatch")
    if r.run.launcher == "torchrun" and r.hardware.nodes > 1 and p.master_addr is None:
        raise ConfigError(resolved.recipe_path, "hardware.nodes", r.hardware.nodes,
                          "needs MASTER_ADDR (node 0's address) for torchrun's rendezvous",
                          "on every node: export MASTER_ADDR=<node 0> NODE_RANK=<n>, and on nodes > 0 also "
                          "LAYOUTLAB_RUN_DIR=<the run directory node 0 printed> (under SLURM: sbatch launch/slurm.sbatch)")
    if r.run.launcher == "deepspeed" and r.hardware.nodes > 1:
        if not environ.get("LAYOUTLAB_HOSTFILE"):
            raise ConfigError(resolved.recipe_path, "run.launcher", "deepspeed",
                              f"needs a hostfile for {r.hardware.nodes} nodes",
                              "export LAYOUTLAB_HOSTFILE=/path/to/hostfile (lines `host slots=N`), or use run.launcher=torchrun")
        nodes.check_hostfile(resolved, environ["LAYOUTLAB_HOSTFILE"])


def _in_launcher_child() -> None:
    """In the launcher child: SIGTERM when this CLI dies, so torchrun can stop its ranks in order; STOP_SIGNAL
    ignored, by it and (the disposition survives exec and fork) by the ranks and whatever they start: SLURM may signal
    every process of the step, and a process that SIGUSR1 ended would take the job down with it."""
    import ctypes

    signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def execute(cmd: LaunchCommand) -> int:
    """Run the launcher in our process group: a Ctrl-C or a kill of the group reaches every rank, and
    torchrun (which stops all ranks when one fails) gets SIGTERM if we are killed alone. Under SLURM, STOP_SIGNAL
    creates the file STOP_REQUEST names, which this node's ranks look for at every step boundary; it goes with its
    folder when the launcher ends, so that a requeued job never finds an old request. Outside SLURM no STOP_REQUEST
    is given, and the ranks post no vote: every node of a job is alike in this, as they must be to meet in the vote's
    collective."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="layoutlab-") as folder:
        stop = Path(folder) / "stop"
        slurm = nodes.in_slurm_job(os.environ)
        if slurm:
            signal.signal(STOP_SIGNAL, lambda _signum, _frame: stop.touch())
        inherited = {k: v for k, v in os.environ.items() if k != STOP_REQUEST}  # only this launcher's request counts
        proc = subprocess.Popen(list(cmd.argv), env={**inherited, **cmd.env, **({STOP_REQUEST: str(stop)} if slurm else {})},
                                preexec_fn=_in_launcher_child)

        def forward(signum, _frame):
            if proc.poll() is None:
                proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        # Ctrl-C already reaches torchrun through the terminal's process group; do not die before it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return proc.wait()
        finally:
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # the ranks are gone, and so goes the folder
