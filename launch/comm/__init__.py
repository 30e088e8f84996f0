"""Collectives without torch: nccl-tests' text format and bus factors, the commbench description (its tables and
result file). Below config: nothing here knows a recipe. The nccl-tests runner starts processes and writes a run
directory, so it lives in launch/run/."""
