import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.run.metrics import read_metrics


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        skip = pytest.mark.skip(reason="needs CUDA (GPU checks run on a GPU machine: tests/gpu/run_checks.sh)")
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(skip)


# The plan is a check, not a range: a peak more than 15% off the plan's allocated bytes fails (a factor 0.3-3 once let a
# wrong plan pass).
MEMORY_TOLERANCE = 0.15


@dataclass(frozen=True)
class GpuFigures:
    """A GPU run's measured figures (median over the steps after warm-up, rank 0) beside its plan's."""

    tokens_per_s: float
    mfu: float
    peak_bytes: int  # torch.cuda.max_memory_allocated over the measured steps
    predicted_bytes: int  # the plan's total for rank 0 in its backend's own accounting, less its allowance (the CUDA
    # context, NCCL and fragmentation are never allocated tensors, so max_memory_allocated cannot see them)
    accounting: str
    plan_tokens_per_s: float
    plan_mfu: float
    loss_fell: bool  # the last measured step's loss below the first step's

    def memory_within(self, tolerance: float = MEMORY_TOLERANCE) -> bool:
        """The plan's allocated bytes within ±tolerance of the peak the run allocated."""
        return abs(self.peak_bytes / self.predicted_bytes - 1) <= tolerance

    def line(self, what: str) -> str:
        return (f"\n{what}: {self.tokens_per_s:,.0f} tokens/s/GPU (plan {self.plan_tokens_per_s:,.0f}), MFU {self.mfu:.1%} "
                f"(plan {self.plan_mfu:.1%}), peak allocated {self.peak_bytes / 2**30:.2f} GiB, predicted "
                f"{self.predicted_bytes / 2**30:.2f} GiB ({self.accounting} accounting, less the allowance; "
                f"measured/predicted {self.peak_bytes / self.predicted_bytes:.3f})")


def figures(run_root: Path) -> GpuFigures:
    m = read_metrics(run_root / "metrics" / "rank0.jsonl")
    measured = [s for s in m.steps if not s.warmup]
    plan = json.loads((run_root / "plan.json").read_text())
    rank = plan["ranks"][0]
    planned = rank["memory"][rank["implementation"]]
    return GpuFigures(
        tokens_per_s=sorted(s.tokens_per_s_per_device for s in measured)[len(measured) // 2],
        mfu=sorted(s.mfu for s in measured)[len(measured) // 2],
        peak_bytes=max(s.mem_max_allocated_bytes for s in measured),
        predicted_bytes=planned["total"] - planned["allowance"], accounting=rank["implementation"],
        plan_tokens_per_s=plan["step"]["tokens_per_s_per_device"], plan_mfu=plan["step"]["mfu"],
        loss_fell=measured[-1].loss < m.steps[0].loss)
