"""Everything that runs on a rank: the train entry point, the training loop and backends, data, the commbench
and calibration rank programs. The only room that imports torch, deepspeed, megatron or transformers; nothing
outside it imports it except by starting a process (`python -m launch.ranks.train`)."""
