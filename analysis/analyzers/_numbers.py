"""Small helpers on numbers the analyzers share."""
from __future__ import annotations

import math
from typing import Any


def finite(x: Any) -> float | None:
    """`x` as a float when it is a finite real number (not a bool), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None
