"""Step time of layoutlab's torch trainer vs a bare FSDP2 loop (bench/bare_fsdp2.py), same model, weights, batches
and layout, measured in one invocation. Prints the ratio (target <= 1.05).

    python bench/bench_torch.py [steps=60] [rounds=2] [recipe=recipes/tiny_fsdp2] [key=value overrides...]

Default layout: FSDP2 full sharding over 4 gloo ranks (hardware.gpus_per_node=4) with batch.seq_len=128, so that a
step is long enough to time; measured and checked as bench/compare_bare.py says.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import sys

from compare_bare import compare

if __name__ == "__main__":
    compare(sys.argv[1:], recipe="recipes/tiny_fsdp2",
            default_overrides=("hardware.gpus_per_node=4", "batch.micro_batch_size=1", "batch.seq_len=128"),
            bare_script="bare_fsdp2.py", ours_label="layoutlab torch", bare_label="bare FSDP2")
