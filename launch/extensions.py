"""DeepSpeed's JIT-compiled C++ ops, built once per machine into a stated cache outside the clone.

Only optimizer offload needs one (DeepSpeedCPUAdam runs the Adam step on the host); default runs use
torch's AdamW and build nothing. The build runs before any rank starts, so ranks never compile in
parallel and the wait shows a spinner instead of a silent minute.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from launch.errors import ConfigError


def extensions_dir() -> Path:
    """`$TORCH_EXTENSIONS_DIR` when set, else ~/.cache/layoutlab/torch_extensions."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "layoutlab" / "torch_extensions"


def needs_cpu_adam(resolved) -> bool:
    opt = resolved.ds_config.get("optimizer", {}).get("params", {})
    off = resolved.ds_config.get("zero_optimization", {}).get("offload_optimizer", {})
    return bool(off) and off.get("device", "none") != "none" and not opt.get("torch_adam", False)


def ensure_cpu_adam(console, *, env: dict[str, str]) -> float:
    """Build (or load from the cache) DeepSpeedCPUAdam; returns the seconds it took."""
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    t0 = time.perf_counter()
    where = env["TORCH_EXTENSIONS_DIR"]
    with console.status(f"DeepSpeed cpu_adam: building once per machine into {where} (1-3 min the first time)"):
        p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(where, "cpu_adam", "build failed", p.stderr.strip().splitlines()[-1] if p.stderr else "",
                          "install a C++ compiler and python headers, or set parallel.offload_optimizer=\"none\"")
    seconds = time.perf_counter() - t0
    console.print(f"cpu_adam ready in {seconds:.1f} s ({where})")
    return seconds
