#!/usr/bin/env bash
# Run a set of recipes with everything else held equal, one after another, then write their comparative report.
#   bash launch/sweep.sh recipes/A recipes/B ... [dotted.key=value ...] [--dry-run]
set -euo pipefail
exec "${PYTHON:-python3}" -m launch sweep "$@"
