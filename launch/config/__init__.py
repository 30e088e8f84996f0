"""Recipe loading and resolution: schema, resolver, DeepSpeed config composition, backend registry, rank grid,
hardware profiles (nominal and calibrated), model catalogue. Torch-free."""
