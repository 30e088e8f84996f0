"""Where the time of one collective call comes from: a calibration that covers the layout, or the nominal profile."""
from __future__ import annotations

import math
from dataclasses import dataclass

from launch.comm import nccl_format
from launch.config import calibration as cal


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor for one of our collective names (launch/comm/nccl_format, its one home); 0 for a group of one,
    which moves nothing."""
    return 0.0 if n <= 1 else nccl_format.bus_factor(nccl_format.NCCL_TESTS_OP[collective], n)


@dataclass(frozen=True)
class Timing:
    """Where a plan's times come from: a calibration that covers the layout (its measured passes, engine costs and
    collectives); else, when one was measured on this machine at the layout's dtype (`fitted_on`), the compute model
    on its fitted figures (the calibrated profile's efficiency) and its collectives' α–β curves where it measured
    the group; else the nominal profile. `why_nominal`: what of the layout the calibration does not time (its
    passes, or collectives it did not measure, which take the nominal figures)."""

    calibration: cal.Calibration | None = None
    why_nominal: tuple[str, ...] = ()
    fitted_on: cal.Calibration | None = None

    @property
    def label(self) -> str:
        """StepTime.timing: "calibrated", "fitted" or "nominal"."""
        return "calibrated" if self.calibration else "fitted" if self.fitted_on else "nominal"

    def call(self, collective: str, n: int, link: str, nominal_busbw: float, nominal_latency_us: float,
             nbytes: float) -> tuple[float, float, float]:
        """(seconds per call, latency µs, busbw GB/s) of one call moving an nbytes message (nccl-tests' size)."""
        measured = self.calibration or self.fitted_on
        fit = measured.alpha_beta(collective, n, link) if measured else None
        if fit is not None:
            busbw = fit.beta_Bps * bus_factor(collective, n) / 1e9 if math.isfinite(fit.beta_Bps) else math.inf
            return fit.seconds(nbytes), fit.alpha_s * 1e6, busbw
        moved = nbytes * bus_factor(collective, n)
        return (nominal_latency_us * 1e-6 + (moved / (nominal_busbw * 1e9) if nominal_busbw else 0.0),
                nominal_latency_us, nominal_busbw)

