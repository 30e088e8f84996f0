"""Step time of layoutlab's Megatron-Core trainer vs a bare Megatron-Core loop (bench/bare_megatron.py), same
model, weights, batches and layout, measured in one invocation. Prints the ratio (target <= 1.05).

    python bench/bench_megatron.py [steps=60] [rounds=2] [recipe=recipes/tiny_tp2_zero3] [key=value overrides...]

Default layout: TP 2 × DP 2 on 4 gloo ranks with parallel.zero_stage=0 (the baseline has no ZeRO) and
batch.seq_len=128, so that a step is long enough to time; measured and checked as bench/compare_bare.py says.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import sys

from compare_bare import compare

if __name__ == "__main__":
    compare(sys.argv[1:], recipe="recipes/tiny_tp2_zero3", default_overrides=("parallel.zero_stage=0", "batch.seq_len=128"),
            bare_script="bare_megatron.py", ours_label="layoutlab megatron", bare_label="bare Megatron-Core")
