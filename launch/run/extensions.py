"""DeepSpeed's JIT-compiled C++ ops, built once per machine into a stated cache outside the clone.

Only offload needs them: DeepSpeedCPUAdam runs the Adam step on the host (optimizer offload) and async_io
swaps to NVMe (ZeRO-Infinity). Default runs use torch's AdamW and build nothing. The build runs before
any rank starts, so ranks never compile in parallel (or under the stall watchdog) and the wait shows a
spinner instead of a silent minute.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from launch.errors import ConfigError

# op name -> (DeepSpeed builder class, what to install when the build fails)
OPS = {
    "cpu_adam": ("CPUAdamBuilder", "a C++ compiler and the Python headers"),
    "async_io": ("AsyncIOBuilder", "libaio (apt-get install libaio-dev) and a C++ compiler"),
}


def extensions_dir() -> Path:
    """`$TORCH_EXTENSIONS_DIR` when set, else ~/.cache/layoutlab/torch_extensions."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "layoutlab" / "torch_extensions"


def needed_ops(resolved) -> list[str]:
    zo = resolved.ds_config.get("zero_optimization", {})
    opt = resolved.ds_config.get("optimizer", {}).get("params", {})
    devices = {zo.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    ops = []
    if zo.get("offload_optimizer", {}).get("device", "none") != "none" and not opt.get("torch_adam", False):
        ops.append("cpu_adam")
    if "nvme" in devices:
        ops.append("async_io")
    return ops


def ensure_op(op: str, console, *, env: dict[str, str]) -> float:
    """Build (or load from the cache) one DeepSpeed op; returns the seconds it took."""
    builder, needs = OPS[op]
    code = f"from deepspeed.ops.op_builder import {builder}; {builder}().load()"
    t0 = time.perf_counter()
    where = env["TORCH_EXTENSIONS_DIR"]
    with console.status(f"DeepSpeed {op}: building once per machine into {where} (1-3 min the first time)"):
        p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    if p.returncode != 0:
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit code {p.returncode}"
        raise ConfigError(where, op, "build failed", f"({last})", f"install {needs}, or run without that offload")
    seconds = time.perf_counter() - t0
    console.print(f"{op} ready in {seconds:.1f} s ({where})")
    return seconds
