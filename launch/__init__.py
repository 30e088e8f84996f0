"""Resolve recipes, plan memory and communication, launch trainers.

Rooms, lowest first (import rules in pyproject.toml's `[tool.importlinter]`, checked by `lint-imports` in CI):
`errors`, `sense`, `units`, `inputs` (shared by all) < `comm` (nccl-tests format, commbench description) <
`config` (schema, resolve, backends, models, hardware) < `plan` (pure: memory, collectives, time) <
`run` (run directory, metrics, checkpoints, launcher) < `commands` (one module per subcommand).
`ranks` is everything that runs on a rank, the only room that imports torch; only the rank entry point
(`python -m launch.ranks.train`) and the rank programs reach it.
"""
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE.parent  # an editable install from the clone: recipes/ and ds_configs/ sit beside the package
