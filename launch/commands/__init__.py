"""One module per subcommand of `python -m launch` (and of run.sh / sweep.sh). Torch-free: ranks are started as
processes, never imported."""
