"""Units: one home for the byte and time multiples every stage prints or computes with."""
KiB = 1024
MiB = 1024**2
GiB = 1024**3
MS_PER_S = 1e3
US_PER_S = 1e6
