"""Physical sense for the numbers a log parser reads (one rule for every framework log): a count or an index is a
whole number below 2**63 and not negative; a duration is not negative and below MAX_DURATION_MS; every figure is
finite. A value outside that is removed from its row (None) and counted in one warning per column, never averaged
in; a number past 64 bits read where a count belongs would otherwise overflow every float that touches it."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

# No single iteration, step or timer of a training run lasts a week.
MAX_DURATION_MS = 7 * 24 * 3600 * 1e3


def clean(rows: list[dict[str, Any]], source: str, *, counts: Iterable[str] = (),
          durations_ms: Iterable[str] = (), durations_s: Iterable[str] = ()) -> list[str]:
    """Blank, in place, the values of `rows` that make no physical sense; a warning per column that had some."""
    rules = ([(c, _count) for c in counts] + [(c, _duration_ms) for c in durations_ms]
             + [(c, _duration_s) for c in durations_s])
    blanked: Counter[str] = Counter()
    for row in rows:
        for col, ok in rules:
            v = row.get(col)
            if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and not ok(v):
                row[col] = None
                blanked[col] += 1
    return [f"{source}: {n} value(s) of {col} dropped as physically impossible (negative, not finite, past 64 bits"
            f" or longer than a week)" for col, n in blanked.items()]


def _count(v: float) -> bool:
    return 0 <= v < 2**63


def _duration_ms(v: float) -> bool:
    return math.isfinite(v) and 0 <= v <= MAX_DURATION_MS


def _duration_s(v: float) -> bool:
    return _duration_ms(v * 1e3)
