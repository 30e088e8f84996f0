"""Everything that runs on a rank: the train entry point, the training loop and backends, data, the commbench
and calibration rank programs. With launch.torchtools (the torch programs of the driver) the only rooms that import
torch, deepspeed, megatron or transformers. The driver starts it as processes (`python -m launch.ranks.train`) and
never imports it; of the driver's torch programs only export does (each backend's own export, through the registry)."""
