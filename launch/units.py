"""Units: one home for the byte multiples every stage computes with, and for how sizes and counts are shown to a
person (adaptive: 512 KiB, 3.2 GiB; 4.2M, 6.74B parameters)."""
KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1, three significant figures."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def human_count(n: float) -> str:
    """A count (parameters, tokens) as 4.2M or 6.74B, three significant figures."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{int(n)}"
