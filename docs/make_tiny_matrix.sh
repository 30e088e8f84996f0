#!/usr/bin/env bash
# Regenerates docs/tiny_matrix/: the tiny twins of the seed's 7B matrix (recipes/tiny_7b_*: every cell, its DeepSpeed
# and Megatron peers, and the layouts that do not fit at 7B) trained on 4 CPU ranks each in one sweep with everything
# else held equal, and their comparative report (loss curves, where the time went, predicted against measured,
# collectives against the layout, from a Kineto trace of each rank). About ten minutes on 2 cores; the runs stay under
# runs/sweeps/.
#   bash docs/make_tiny_matrix.sh [dotted.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# the seed's matrix: every 7B layout's twin, not the fine-tunes' (tiny_7b_*lora*: tests/dist/test_lora.py trains them)
matrix=()
for recipe in recipes/tiny_7b_*; do
  [[ $recipe == *lora* ]] || matrix+=("$recipe")
done
bash launch/sweep.sh "${matrix[@]}" run.profile=torch "$@" | tee "$log"
sweep=$(dirname "$(sed -n 's/^report: //p' "$log")")
# The report again, written into docs/ and naming the runs by their place in this repository.
runs=()
for resolved in "$sweep"/tiny_7b_*/*/resolved.json; do
  run=$(realpath --relative-to=. "$(dirname "$resolved")")
  runs+=("$(basename "$(dirname "$run")")=$run")
done
"${PYTHON:-python3}" -m analysis report "${runs[@]}" -o docs/tiny_matrix/report.md -o docs/tiny_matrix/report.html
