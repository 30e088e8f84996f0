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
class AttentionEfficiency:
    """A fused attention kernel's share of the dtype's dense peak, on its own FLOP count (the causal half)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Efficiency:
    """What the compute model (launch/plan/compute.py) needs beyond peak and bandwidth, each a share measured on the
    device by its source: the best GEMM's share of dense peak, the matrix dimension at which a GEMM runs at half that
    (the efficiency curve: thin and small matrices run further from peak), the share of memory bandwidth streaming
    kernels reach, and each fused attention kernel's (by `train.attention`: sdpa, te) forward and backward."""

    gemm: float
    gemm_half_dim: float
    memory: float
    attention: Mapping[str, AttentionEfficiency]
    sources: str

    FIELDS = ("gemm", "gemm_half_dim", "memory", "attention", "sources")

    def to_dict(self) -> dict:
        return {"gemm": self.gemm, "gemm_half_dim": self.gemm_half_dim, "memory": self.memory,
                "attention": {k: {"forward": a.forward, "backward": a.backward} for k, a in self.attention.items()},
                "sources": self.sources}

    @classmethod
    def from_dict(cls, d: Mapping, where: str, most: float = 1.0) -> "Efficiency":
        """`where`: the profile, named in the one line a missing or impossible number gets; `most`: the largest share
        of the data sheet's figures it may claim (above 1 only where calibrate measured the machine beating them)."""
        def share(field: str, value, high: float = most) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
                raise ConfigError(where, f"efficiency.{field}", value, f"is not a number in (0, {high:g}]",
                                  "set it from a measurement on the device (launch/config/catalogue/hardware/*.json "
                                  "name theirs in efficiency.sources)")
            return float(value)

        if not isinstance(d, Mapping):
            raise ConfigError(where, "efficiency", d, "is not an object", f"give it the fields {', '.join(cls.FIELDS)}")
        for field in cls.FIELDS:
            if field not in d:
                raise ConfigError(where, f"efficiency.{field}", "(missing)", "is needed by the step-time model",
                                  "add it, as the shipped profiles do (launch/config/catalogue/hardware/h100-sxm.json)")
        attention = d["attention"]
        if not isinstance(attention, Mapping):
            raise ConfigError(where, "efficiency.attention", attention, "is not an object",
                              'map each fused kernel to its shares: {"sdpa": {"forward": 0.4, "backward": 0.3}}')
        kernels = {}
        for kernel, a in attention.items():
            a = a if isinstance(a, Mapping) else {}
            kernels[str(kernel)] = AttentionEfficiency(*(share(f"attention.{kernel}.{k}", a.get(k))
                                                         for k in ("forward", "backward")))
        return cls(share("gemm", d["gemm"]), share("gemm_half_dim", d["gemm_half_dim"], 1e6),
                   share("memory", d["memory"]), kernels, str(d["sources"]))


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
    efficiency: Efficiency | None = None  # from_dict always sets it (resolved.json of older runs: the shipped one's)
    # Checkpoint saves (launch/plan/checkpoint.py): one device's copy of its state into host memory (DCP's async
    # staging), and one node's write to the checkpoint's file system. 0: not known (older files); the plan then
    # states the bytes without a time.
    host_copy_GBps: float = 0.0
    checkpoint_write_GBps: float = 0.0
    # Whether scaled_dot_product_attention's fused kernel on this device takes grouped-query attention (fewer K/V heads
    # than query heads). torch 2.13.0 (built 2026-07-03): the flash kernel does (sm 8.0 and later); the memory-efficient
    # kernel, all an sm 7.5 T4 has, does not (pytorch#191085 added it on 2026-07-25), so SDPA would fall to the math
    # kernel and its s × s scores: there the Hugging Face backends repeat the K/V heads first (launch.ranks.trainers.
    # common.repeat_kv_for_fused_attention) and the plan keeps the repeated K and V (launch.plan.memory.sdpa_kernel).
    fused_attention_gqa: bool = True

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
        d["efficiency"] = self.efficiency.to_dict() if self.efficiency else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "") -> "HardwareProfile":
        """`where`: the file, named when its efficiency block lacks a number. A profile written before the compute
        model (resolved.json of older runs: `achievable_mfu`, no efficiency) reads with the shipped profile's."""
        d = {k: v for k, v in d.items() if k != "achievable_mfu"}
        eff = d.get("efficiency")
        if eff is None and d.get("name") in profile_names():
            eff = json.loads((_DIR / f"{d['name']}.json").read_text()).get("efficiency")
        where = where or f"hardware profile {d.get('name')}"
        if eff is None:
            raise ConfigError(where, "efficiency", "(missing)",
                              "is needed by the step-time model, and no shipped profile of that name has it",
                              "resolve the recipe again with this checkout, or add an efficiency block as the shipped "
                              "profiles have (launch/config/catalogue/hardware/h100-sxm.json)")
        most = FITTED_MOST[d.get("name") == "cpu"] if d.get("calibration") else 1.0  # device_type's rule
        return cls(**{**d, "peak_tflops": dict(d["peak_tflops"]),
                      "efficiency": Efficiency.from_dict(eff, where, most)})


def with_fitted(base: HardwareProfile, fitted, how: str) -> HardwareProfile:
    """`base` with the compute model's figures a calibration fitted (launch.config.calibration.Fitted): its GEMM
    curve, streaming bandwidth and sdpa attention rates as shares of the data sheet's peak and bandwidth, which stay
    the profile's (MFU's denominator has one home). A share above 1 says the machine beat the data sheet: this
    machine's cores reach 0.14 TFLOP/s at fp32 and ~1 TFLOP/s at bf16 on AMX, where the CPU profile guesses 0.05.
    The rates are measured at one dtype; the shares apply to the profile's other dtypes as the nominal ones do."""
    peak = base.peak_tflops[fitted.dtype]
    eff = base.efficiency
    attention = {**eff.attention, "sdpa": AttentionEfficiency(fitted.attention_forward_tflops / peak,
                                                              fitted.attention_backward_tflops / peak)}
    return HardwareProfile(**{**base.__dict__, "efficiency": Efficiency(
        gemm=fitted.gemm_tflops / peak, gemm_half_dim=fitted.gemm_half_dim, memory=fitted.memory_GBps / base.hbm_GBps,
        attention=attention,
        sources=f"{how}, at {fitted.dtype}, as shares of the data sheet's {peak:g} TFLOP/s and {base.hbm_GBps:g} GB/s; "
                f"kernels it did not time ({', '.join(sorted(set(attention) - {'sdpa'})) or 'none'}): nominal: "
                f"{eff.sources}")})


# How far a calibration's fitted rates may exceed the data sheet (GPU profiles, CPU profile): a GPU's data sheet is
# its peak, a fitted rate twice it is a broken probe; the CPU profile's is a guess for one AVX2 core that AMX beats
# twentyfold at bf16.
FITTED_MOST = {False: 2.0, True: 100.0}


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
        fitted = calib.compute.fitted if calib.compute else None
        if fitted is not None:
            if not base.supports(fitted.dtype):
                raise ConfigError(str(path), "compute.fitted.dtype", fitted.dtype,
                                  f"is not a dtype of its base profile {base.name}", "write a new one with `python -m "
                                  "launch calibrate` at a dtype the profile has")
            most = FITTED_MOST[base.device_type == "cpu"]
            over = {k: v for k, v in (("gemm", fitted.gemm_tflops), ("attention forward", fitted.attention_forward_tflops),
                                      ("attention backward", fitted.attention_backward_tflops))
                    if v > most * base.peak_tflops[fitted.dtype]}
            if fitted.memory_GBps > most * base.hbm_GBps:
                over["memory"] = fitted.memory_GBps
            if over:
                what, value = next(iter(over.items()))
                raise ConfigError(str(path), "compute.fitted", f"{what} {value:g}",
                                  f"is more than {most:g}x the {base.name} data sheet: the probe that measured it broke",
                                  "calibrate again on a quiet machine")
            base = with_fitted(base, fitted, f"fitted by `python -m launch calibrate` {calib.created} on "
                                             f"{calib.machine_kind}")
        return HardwareProfile(**{**base.__dict__, "calibration": {**calib.to_dict(), "source_path": str(path.resolve())},
                                  "sources": f"calibrated {calib.created} on {calib.machine_kind} ({path}); "
                                             f"memory and links from the nominal {base.name} profile: {base.sources}"})
    path = _DIR / f"{name}.json"
    return HardwareProfile.from_dict(json.loads(path.read_text()), str(path))
