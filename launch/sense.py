"""Physical sense for every number read from outside: framework logs, TensorBoard events, nccl-tests output, traces,
our metrics files and our resolved/plan documents read back, and the recipes, DeepSpeed JSON and model configs a user
gives (launch/inputs.py: NaN, infinities and integers past 64 bits). One rule each: a count or an index is not
negative and below 2**63; a duration is not negative and at most a week; a bandwidth, a FLOP rate and a throughput are
not negative and below what any machine reaches; a utilisation (MFU) is not negative and at most 10;
a loss scale is positive and at most 2**64; a finite loss, norm or learning rate lies within float32's range (NaN and
the infinities kept: a diverged step prints them); every other figure is finite. The parsers drop a value
outside that from its row (None) and count it in one warning per column, never averaging it in; the launch side
refuses it in one line. A number past 64 bits read where a count belongs would otherwise overflow every float that
touches it.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

# No single iteration, step, timer or profiled event of a training run lasts a week.
MAX_DURATION_S = 7 * 24 * 3600
# Counts are 64-bit signed integers wherever they end up (numpy, torch, SQLite, JSON readers).
COUNT_LIMIT = 2**63
# No link moves 100 TB/s (NVLink 5 moves 1.8 TB/s per GPU); a figure above is a misprint or garbage.
MAX_BANDWIDTH_GBPS = 1e5
# No device computes 100 PFLOP/s (a B200 does about 4.5 dense at FP8); nothing is processed 1e15 times a second
# (samples, tokens).
MAX_TFLOPS = 1e5
MAX_RATE_PER_S = 1e15
# A utilisation is the share of the device's peak a step used. Above 1 the profile's peak is below the machine's (the
# nominal cpu profile's 50 GFLOP/s per rank on a many-core host): a real figure, kept. No profile is ten times off.
MAX_UTILISATION = 10.0
# Dynamic loss scalers start at 2**16 to 2**32 and halve on overflow; a scale past 2**64 overflows every fp16
# gradient it touches.
MAX_LOSS_SCALE = 2.0**64
# Losses, norms and learning rates are computed in float32 at widest: a finite figure past its range no step
# computed. NaN and the infinities stay: a diverged step prints them, and the curves count them.
FLOAT32_MAX = 3.4028234663852886e38


def clean(rows: list[dict[str, Any]], source: str, *, counts: Iterable[str] = (), durations_us: Iterable[str] = (),
          durations_ms: Iterable[str] = (), durations_s: Iterable[str] = (),
          bandwidths_gbps: Iterable[str] = (), bandwidths_gbit_s: Iterable[str] = (), tflops: Iterable[str] = (),
          flop_per_s: Iterable[str] = (), rates_per_s: Iterable[str] = (), utilisations: Iterable[str] = (),
          loss_scales: Iterable[str] = (), figures: Iterable[str] = ()) -> list[str]:
    """Blank, in place, the values of `rows` that make no physical sense; a warning per column that had some."""
    rules = ([(c, _COUNT) for c in counts] + [(c, _DURATION_US) for c in durations_us]
             + [(c, _DURATION_MS) for c in durations_ms] + [(c, _DURATION_S) for c in durations_s]
             + [(c, _BANDWIDTH) for c in bandwidths_gbps] + [(c, _BANDWIDTH_GBIT) for c in bandwidths_gbit_s]
             + [(c, _TFLOPS) for c in tflops] + [(c, _FLOP_PER_S) for c in flop_per_s]
             + [(c, _RATE) for c in rates_per_s] + [(c, _UTILISATION) for c in utilisations]
             + [(c, _LOSS_SCALE) for c in loss_scales]
             + [(c, _FIGURE) for c in figures])
    blanked: Counter[str] = Counter()
    why: dict[str, str] = {}
    for row in rows:
        for col, rule in rules:
            v = row.get(col)
            if isinstance(v, dict):  # name -> figure (every loss a log printed): each entry by the same rule
                for name, x in list(v.items()):
                    if _judged(x) and not rule.ok(x):
                        del v[name]
                        blanked[f"{col}[{name}]"] += 1
                        why[f"{col}[{name}]"] = rule.impossible
            elif _judged(v) and not rule.ok(v):
                row[col] = None
                blanked[col] += 1
                why[col] = rule.impossible
    return [f"{source}: {n} value(s) of {col} dropped as physically impossible ({why[col]})"
            for col, n in blanked.items()]


def _judged(v: Any) -> bool:
    return v is not None and not isinstance(v, bool) and isinstance(v, (int, float))


def is_figure(v: float) -> bool:
    return not math.isfinite(v) or abs(v) <= FLOAT32_MAX


@dataclass(frozen=True)
class _Rule:
    ok: Callable[[float], bool]
    impossible: str  # what a value that fails `ok` is


def is_count(v: float) -> bool:
    return 0 <= v < COUNT_LIMIT


def is_duration_s(v: float) -> bool:
    return math.isfinite(v) and 0 <= v <= MAX_DURATION_S


def is_bandwidth_gbps(v: float) -> bool:
    return math.isfinite(v) and 0 <= v <= MAX_BANDWIDTH_GBPS


_COUNT = _Rule(is_count, "negative or past 64 bits")
_DURATION_S = _Rule(is_duration_s, "negative, not finite or longer than a week")
_DURATION_MS = _Rule(lambda v: is_duration_s(v * 1e-3), _DURATION_S.impossible)
_DURATION_US = _Rule(lambda v: is_duration_s(v * 1e-6), _DURATION_S.impossible)
_BANDWIDTH = _Rule(is_bandwidth_gbps, f"negative, not finite or above {MAX_BANDWIDTH_GBPS / 1e3:g} TB/s")
_BANDWIDTH_GBIT = _Rule(lambda v: is_bandwidth_gbps(v / 8), _BANDWIDTH.impossible)
_TFLOPS = _Rule(lambda v: math.isfinite(v) and 0 <= v <= MAX_TFLOPS,
                f"negative, not finite or above {MAX_TFLOPS / 1e3:g} PFLOP/s")
_FLOP_PER_S = _Rule(lambda v: _TFLOPS.ok(v * 1e-12), _TFLOPS.impossible)
_LOSS_SCALE = _Rule(lambda v: 0 < v <= MAX_LOSS_SCALE, "not positive or past 2**64")
_FIGURE = _Rule(is_figure, "finite but past float32's range")
_RATE = _Rule(lambda v: math.isfinite(v) and 0 <= v <= MAX_RATE_PER_S, f"negative, not finite or above {MAX_RATE_PER_S:g}/s")
_UTILISATION = _Rule(lambda v: math.isfinite(v) and 0 <= v <= MAX_UTILISATION,
                     f"negative, not finite or above {MAX_UTILISATION:g} times the device's peak")


def _leaves(doc: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field, value) of every scalar of a parsed JSON/TOML document (`a.b[2].c`)."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(doc))
    else:
        yield where or "(document)", doc
        return
    for key, value in items:
        yield from _leaves(value, f"{where}{key}" if str(key).startswith("[") else f"{where}.{key}" if where else str(key))


def _unrepresentable(v: Any) -> bool:
    """A float that is not finite, or an integer past 64 bits (signed or unsigned)."""
    if isinstance(v, float):
        return not math.isfinite(v)
    return isinstance(v, int) and not isinstance(v, bool) and not -COUNT_LIMIT <= v < 2 * COUNT_LIMIT


def bad_number(doc: Any) -> tuple[str, Any] | None:
    """The first (dotted field, value) of a parsed JSON/TOML document that no field can take: a float that is not
    finite, an integer past 64 bits; None when there is none. JSON readers accept NaN and Infinity, TOML has nan
    and inf; no recipe, DeepSpeed or model setting is meant to be one (a calibration is read by
    launch/config/calibration.py, whose fitted bandwidth may be infinite)."""
    return next(((where, v) for where, v in _leaves(doc) if _unrepresentable(v)), None)


def first_senseless(doc: Any) -> tuple[str, Any, str] | None:
    """The first (dotted field, value, what is wrong) of a document of ours (resolved.json, plan.json) read back
    from disk, judged by the unit its name carries: `*_bytes` is a count of bytes and `*_s` (not `*_per_s`) a
    finite, non-negative time; no number is NaN or an integer past 64 bits. An infinity elsewhere is meant: a
    calibrated link whose time showed no size dependence has an infinite bandwidth. A predicted time is not
    bounded by a week: a what-if plan may predict days per step. None when every number makes sense."""
    for where, v in _leaves(doc):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = where.rsplit(".", 1)[-1]
        if (isinstance(v, float) and math.isnan(v)) or (isinstance(v, int) and _unrepresentable(v)):
            return where, v, "is not a number within 64 bits"
        if (name == "bytes" or name.endswith("_bytes")) and not _COUNT.ok(v):
            return where, v, f"is {_COUNT.impossible} (a count of bytes)"
        if name.endswith("_s") and not name.endswith("_per_s") and not (math.isfinite(v) and v >= 0):
            return where, v, "is negative or not finite (seconds)"
    return None
