"""What env.json records: code version, package versions, NCCL/CUDA variables, hosts and devices.

Versions come from package metadata so that capturing them never imports torch.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from launch import REPO_ROOT
from launch.config.calibration import Machine

PACKAGES = ("torch", "deepspeed", "megatron-core", "transformers", "accelerate", "numpy", "layoutlab")


def _git(args: list[str], cwd: Path) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _devices() -> list[str]:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            return [line for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return [f"CPU: {model or platform.processor()} × {os.cpu_count()} cores"]


@functools.cache  # the planner asks once per plan; nvidia-smi need not run once per recommend candidate
def machine_kind() -> str:
    """What kind of machine this is, for telling whether a calibration was measured on one like it: the device
    names with their counts (no indices, serial numbers or host names), e.g. "8 × NVIDIA H100 80GB HBM3" or
    "CPU: AMD EPYC 7B13 × 2 cores"."""
    import re

    names = [re.sub(r"^GPU \d+: | \(UUID: [^)]*\)$", "", d) for d in _devices()]
    if names and not names[0].startswith("CPU:"):
        return ", ".join(f"{names.count(n)} × {n}" for n in dict.fromkeys(names))
    return names[0] if names else platform.processor()


@functools.cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    out = []
    for p in PACKAGES:
        try:
            out.append((p, metadata.version(p)))
        except metadata.PackageNotFoundError:
            out.append((p, None))
    return tuple(out)


def package_versions() -> dict[str, str | None]:
    return dict(_versions())


def machine() -> Machine:
    """This machine, as the planner takes it."""
    return Machine(machine_kind(), package_versions())


def recorded_machine(env: dict) -> Machine | None:
    """The machine an env.json (`capture`) recorded; None where it predates `machine_kind` or is damaged."""
    kind, versions = env.get("machine_kind"), env.get("packages")
    if not isinstance(kind, str) or not isinstance(versions, dict):
        return None
    return Machine(kind, {str(k): v if isinstance(v, str) else None for k, v in versions.items()})


def capture(repo: Path | None = None) -> dict:
    repo = repo or REPO_ROOT
    versions = package_versions()
    return {
        "git_commit": _git(["rev-parse", "HEAD"], repo) or None,
        "git_dirty": bool(_git(["status", "--porcelain", "--untracked-files=no"], repo)),
        "python": sys.version.split()[0],
        "packages": versions,
        "machine_kind": machine_kind(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "CUDA_", "DS_", "OMP_", "TORCH_", "MASTER_", "SLURM_", "GLOO_"))},
        "host": socket.gethostname(),
        "hosts": _hosts(),
        "devices": _devices(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


def _hosts() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        return [nodelist]
    return [socket.gethostname()]
