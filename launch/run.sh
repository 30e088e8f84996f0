#!/usr/bin/env bash
# Resolve a recipe, plan it, create its run directory and start its ranks.
#   bash launch/run.sh recipes/NAME [dotted.key=value ...] [--dry-run]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" -m launch run "$@"
