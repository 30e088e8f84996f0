"""Hardware profiles: the nominal ones shipped in launch/config/catalogue/hardware (peak FLOP/s, device memory, link
speeds from data sheets), or a calibration file `python -m launch calibrate` wrote (`hardware.profile=PATH`):
the nominal profile it was measured against, with the measured figures attached."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from launch.errors import ConfigError

_DIR = Path(__file__).parent / "catalogue" / "hardware"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str
    memory_bytes: int  # per device (on the CPU profile: per rank)
    peak_tflops: Mapping[str, float]  # dense, by dtype
    hbm_GBps: float
    intra_node_busbw_GBps: float  # nccl-tests all_reduce busbw inside one node
    inter_node_busbw_GBps: float  # all_reduce busbw of a collective spanning nodes (all devices taking part)
    nic_GBps_per_device: float  # one device's share of the node's network
    intra_node_link: str
    inter_node_link: str
    achievable_mfu: float  # the fraction of peak the step-time prediction assumes
    host_memory_bytes: int
    sources: str
    # Per collective call: a small message's time in nccl-tests (gloo: commbench). 0 in files written before
    # they existed (resolved.json of older runs); every shipped profile sets them.
    intra_node_latency_us: float = 0.0
    inter_node_latency_us: float = 0.0
    calibration: Mapping | None = None  # launch/config/calibration.py's document; None: a nominal profile
    # What runs on this profile measured against its nominal figures, said beside every nominal prediction ('' where
    # nothing was measured): a newcomer's first predicted step should not read as a measurement
    nominal_measured: str = ""

    @property
    def nominal(self) -> bool:
        return self.calibration is None

    def peak_flops(self, dtype: str) -> float:
        return self.peak_tflops.get(dtype, self.peak_tflops.get("fp32", 0.0)) * 1e12

    @property
    def device_type(self) -> str:
        """Where a rank computes: "cpu" on the CPU profile (gloo ranks), "cuda" on every GPU profile (NCCL). The one
        decision, made from the resolved recipe (never from what the machine happens to have): the ranks, the
        launcher, Megatron's CPU redirects and the planner all ask it."""
        return "cpu" if self.name == "cpu" else "cuda"

    def supports(self, dtype: str) -> bool:
        return dtype in self.peak_tflops

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["peak_tflops"] = dict(self.peak_tflops)
        if d["calibration"] is None:
            del d["calibration"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "HardwareProfile":
        return cls(**{**d, "peak_tflops": dict(d["peak_tflops"])})


def profile_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def is_profile_path(value: str) -> bool:
    """A calibration file rather than a shipped profile's name."""
    return value.endswith(".json") or "/" in value


def load_profile(name: str, *, context: str = "", field: str = "hardware.profile",
                 path: Path | None = None) -> HardwareProfile:
    """A shipped profile by name, or (with `path`) a calibration file on top of the profile it names."""
    if path is None and name not in profile_names():
        import difflib

        close = difflib.get_close_matches(name, profile_names(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(context or "command line", field, name, "is not a shipped hardware profile",
                          f"{hint}use one of: {', '.join(profile_names())}, or the path of a calibration file (*.json)")
    if path is not None:
        from launch.config.calibration import read_calibration

        calib = read_calibration(path, context=context or "command line", field_name=field)
        if calib.base_profile not in profile_names():  # a name, never a path: the catalogue is the only source
            raise ConfigError(str(path), "base_profile", calib.base_profile, "is not a shipped hardware profile",
                              f"use one of: {', '.join(profile_names())}")
        base = load_profile(calib.base_profile, context=str(path), field="base_profile")
        return HardwareProfile(**{**base.__dict__, "calibration": {**calib.to_dict(), "source_path": str(path.resolve())},
                                  "sources": f"calibrated {calib.created} on {calib.machine_kind} ({path}); "
                                             f"memory and links from the nominal {base.name} profile: {base.sources}"})
    return HardwareProfile.from_dict(json.loads((_DIR / f"{name}.json").read_text()))
