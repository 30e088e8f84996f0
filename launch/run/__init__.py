"""What a run leaves on disk and how its ranks are started: run directory, metrics records, checkpoint
bookkeeping, environment record, launcher, nodes. Torch-free."""
