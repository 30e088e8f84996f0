"""Where this node sits in a multi-node job, and the hosts it runs on.

The node rank, rendezvous address and port come from what the user exported (`NODE_RANK`, `MASTER_ADDR`,
`MASTER_PORT`) or, inside a SLURM allocation, from SLURM's own variables (`SLURM_NODEID`, `SLURM_NNODES`,
`SLURM_JOB_NODELIST`, `SLURM_JOB_ID`), so that `srun` needs no exports; so do the GPUs a SLURM job was granted. A
DeepSpeed hostfile (`host slots=N` lines, DeepSpeed's own format) is read and checked against the layout here too.
Imports no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from launch.errors import ConfigError
from launch.run.rundir import runs_root

# torchrun's and DeepSpeed's default: without a scheduler, every node must arrive at the same port on its own.
DEFAULT_PORT = 29500
# Under SLURM the port follows the job id, so that two jobs sharing their first node do not meet in one store; below
# Linux's ephemeral range (32768 and up), where no other process's port-0 or outgoing socket can hold it.
# Ports layoutlab picks start here (below the ephemeral range): SLURM's derived ones and launcher.free_port's.
CHOSEN_PORTS_FROM = 20000
SLURM_PORT_BASE, SLURM_PORT_SPAN = CHOSEN_PORTS_FROM, 12000


@dataclass(frozen=True)
class Placement:
    node_rank: int
    node_rank_from: str  # the variable it was read from ("NODE_RANK", "SLURM_NODEID"), or "default"
    master_addr: str | None  # None: nobody said (fine on one node)
    master_port: str | None  # None: nobody said; one node then takes a free port
    scheduler_nodes: int | None  # how many nodes the scheduler gave the job (SLURM_NNODES), when known
    job_id: str | None  # SLURM_JOB_ID


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside a SLURM job (its step's variables are set): the one test every launch-side
    decision about SLURM asks."""
    return bool(environ.get("SLURM_JOB_ID"))


def placement(environ: Mapping[str, str], nodes: int = 2) -> Placement:
    """This node's place, from the environment; a value that cannot be a node rank or node count is refused.
    SLURM's variables count only for a multi-node layout (`nodes` > 1): a one-node run inside an allocation takes
    node rank 0, a free port and its own run directory, as outside one."""
    slurm = in_slurm_job(environ) and nodes > 1
    name = "NODE_RANK" if environ.get("NODE_RANK") else "SLURM_NODEID" if slurm and environ.get("SLURM_NODEID") else None
    node_rank = _int(environ, name, "a node rank, 0 for the first node") if name else 0
    count = None
    if slurm:
        key = "SLURM_NNODES" if environ.get("SLURM_NNODES") else "SLURM_JOB_NUM_NODES"
        count = _int(environ, key, "a node count") if environ.get(key) else None
    addr = environ.get("MASTER_ADDR") or None
    if addr is None and slurm and environ.get("SLURM_JOB_NODELIST"):
        addr = first_host(environ["SLURM_JOB_NODELIST"])
    port = environ.get("MASTER_PORT") or None
    if port is not None and not (re.fullmatch(r"[0-9]{1,5}", port.strip()) and 0 < int(port) < 65536):
        raise ConfigError("environment", "MASTER_PORT", port, "is not a TCP port", "set MASTER_PORT to 1..65535, or unset it")
    if port is None and slurm:
        port = str(SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID", "SLURM's job id") % SLURM_PORT_SPAN)
    return Placement(node_rank, name or "default", addr, port, count,
                     environ.get("SLURM_JOB_ID") if slurm else None)


def _int(environ: Mapping[str, str], name: str, what: str) -> int:
    raw = environ[name]
    if not re.fullmatch(r"[0-9]{1,18}", raw.strip()):
        raise ConfigError("environment", name, raw, f"is not {what}", f"set {name} to a whole number >= 0, or unset it")
    return int(raw)


def check(resolved, p: Placement) -> None:
    """The node rank and the scheduler's node count agree with `hardware.nodes` (before any rank starts)."""
    nodes = resolved.recipe.hardware.nodes
    if p.scheduler_nodes is not None and p.scheduler_nodes != nodes:
        raise ConfigError(resolved.recipe_path, "hardware.nodes", nodes,
                          f"does not match the {p.scheduler_nodes} node(s) SLURM gave this job (SLURM_NNODES)",
                          f"submit with sbatch --nodes={nodes}, or set hardware.nodes={p.scheduler_nodes} "
                          "(with a global batch that divides the new world size)")
    if p.node_rank >= nodes:
        raise ConfigError("environment", p.node_rank_from, p.node_rank,
                          f"is out of range for hardware.nodes={nodes} (node ranks 0..{nodes - 1})",
                          f"give each node its own rank below {nodes}, or raise hardware.nodes")


# What SLURM says of the GPUs a job was granted on a node, most direct first: SLURM_GPUS_ON_NODE (a step's tasks),
# SLURM_GPUS_PER_NODE (`[type:]N`, a job submitted with --gpus-per-node), CUDA_VISIBLE_DEVICES (the devices it bound).
SLURM_GPU_COUNTS = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")


def slurm_gpus(environ: Mapping[str, str]) -> tuple[int, str, str] | None:
    """(the GPUs SLURM granted this job on this node, the variable that says so, its value); None outside SLURM.
    Under SLURM the device files do not tell: every /dev/nvidiaN of the node exists whatever the job was granted
    (its cgroup decides which it may open). None of the variables set: the job was granted no GPU."""
    if not in_slurm_job(environ):
        return None
    for name in SLURM_GPU_COUNTS:
        raw = environ.get(name, "").strip()
        if raw:
            counts = [re.fullmatch(r"(?:[^:,]+:)?([0-9]{1,9})", item.strip()) for item in raw.split(",")]
            if not all(counts):
                raise ConfigError("environment", name, raw, "is not a GPU count ([type:]N, comma-separated)",
                                  f"leave {name} as SLURM sets it, or unset it")
            return sum(int(m.group(1)) for m in counts), name, raw
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # older SLURM releases write NoDevFiles there for a job granted no GPU
        devices = [d for d in visible.split(",") if d.strip() and d.strip() != "NoDevFiles"]
        return len(devices), "CUDA_VISIBLE_DEVICES", visible
    return 0, "SLURM_GPUS_ON_NODE", ""


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1", "r[1-2]n[1-2]") as host names, in SLURM's order."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        hosts += _expand_one(item)
    if not hosts:
        raise ConfigError("environment", "SLURM_JOB_NODELIST", nodelist, "names no host", "run inside an allocation")
    return hosts


def first_host(nodelist: str) -> str:
    """`expand_hostlist(nodelist)[0]`, the rendezvous host, with the same refusals, without expanding the list: one
    pass over the text, however many hosts it names (n[0-9999999] names ten million; 22 brackets of [1-2], 2^22)."""
    first = None
    for item in _split_top(nodelist.strip()):
        host = _first_of(item)  # every item checked, as expanding them all would
        first = first if first is not None else host
    if first is None:
        raise ConfigError("environment", "SLURM_JOB_NODELIST", nodelist, "names no host", "run inside an allocation")
    return first


def _first_of(pattern: str) -> str | None:
    """The first host `_expand_one(pattern)` gives (None: it gives none), its ranges checked in the order it checks
    them: each bracket's ranges up to its first non-empty one, bracket after bracket, then from the last bracket
    reached back to the first the rest of their ranges (nothing after a bracket without a non-empty range)."""
    groups = list(re.finditer(r"\[([^\]]*)\]", pattern))
    parts, rest, reached_all = [], [], True
    start = 0
    for m in groups:
        tail = pattern[start:]  # what _expand_one is given when it reaches this bracket: its errors name it
        parts.append(pattern[start:m.start()])
        ranges = m.group(1).split(",")
        for k, rng in enumerate(ranges):
            lo, hi = _bounds(rng, tail)
            if hi >= lo:
                parts.append(str(lo).zfill(len(rng.partition("-")[0])))
                rest.append((ranges[k + 1:], tail))
                break
        else:
            reached_all = False
            break
        start = m.end()
    for ranges, tail in reversed(rest):
        for rng in ranges:
            _bounds(rng, tail)
    return "".join(parts) + pattern[start:] if reached_all else None


def _bounds(rng: str, pattern: str) -> tuple[int, int]:
    lo, _, hi = rng.partition("-")
    if not re.fullmatch(r"\d+", lo) or (hi and not re.fullmatch(r"\d+", hi)):
        raise ConfigError("environment", "SLURM_JOB_NODELIST", pattern, f"has a range {rng!r} that is not N or N-M",
                          "pass SLURM's own SLURM_JOB_NODELIST unchanged")
    return int(lo), int(hi or lo)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    out = []
    for rng in m.group(1).split(","):
        lo, hi = _bounds(rng, pattern)
        for n in range(lo, hi + 1):
            out += [head + str(n).zfill(len(rng.partition("-")[0])) + rest for rest in _expand_one(tail)]
    return out


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int  # 1-based line of the hostfile


HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=([0-9]{1,9})(?![0-9])")  # DeepSpeed's pattern (launcher/runner.py), slots bounded


def read_hostfile(path: str) -> list[Host]:
    """A DeepSpeed hostfile as DeepSpeed reads it (comments and blank lines skipped), refused in one line where
    DeepSpeed would raise."""
    from launch.inputs import read_text

    hosts: list[Host] = []
    seen: set[str] = set()
    for n, raw in enumerate(read_text(path, context="environment", field="LAYOUTLAB_HOSTFILE",
                                              fix="export LAYOUTLAB_HOSTFILE=<a hostfile of `host slots=N` lines>").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if m is None:
            raise ConfigError(f"{path}:{n}", "line", line, "is not `host slots=N`", "write one `hostname slots=N` per line")
        if m.group(1) in seen:
            raise ConfigError(f"{path}:{n}", "host", m.group(1), "is listed twice", "list each host once")
        seen.add(m.group(1))
        hosts.append(Host(m.group(1), int(m.group(2)), n))
    if not hosts:
        raise ConfigError(path, "hosts", 0, "are listed nowhere in it (DeepSpeed refuses an empty hostfile too)",
                          "write one `hostname slots=N` per line")
    return hosts


def check_hostfile(resolved, path: str) -> list[Host]:
    """The hosts the layout runs on: the first `hardware.nodes` of the hostfile, each with enough slots."""
    hw = resolved.recipe.hardware
    hosts = read_hostfile(path)
    if len(hosts) < hw.nodes:
        raise ConfigError(path, "hosts", len(hosts), f"are fewer than hardware.nodes={hw.nodes}",
                          f"list {hw.nodes} hosts (`host slots={hw.gpus_per_node}`), or lower hardware.nodes")
    for h in hosts[:hw.nodes]:
        if h.slots < hw.gpus_per_node:
            raise ConfigError(f"{path}:{h.line}", f"{h.name} slots", h.slots,
                              f"is fewer than hardware.gpus_per_node={hw.gpus_per_node}",
                              f"give the host slots={hw.gpus_per_node}, or lower hardware.gpus_per_node")
    return hosts[:hw.nodes]


def shared_run_dir(resolved, environ) -> str | None:
    """The run directory every node of a job writes: the one the user gave (LAYOUTLAB_RUN_DIR), or under SLURM one
    named after the job, which every node derives alike; None: this node creates a new one."""

    if environ.get("LAYOUTLAB_RUN_DIR"):
        return environ["LAYOUTLAB_RUN_DIR"]
    p = placement(environ, resolved.recipe.hardware.nodes)
    if p.job_id:
        return str(runs_root() / resolved.recipe_name / f"slurm-{p.job_id}")
    return None
