#!/usr/bin/env bash
# The GPU checks as one prepared script (DeepSpeed ZeRO-2/3 and Megatron-Core TP1 with each recompute policy on the
# 0.5B model, commbench vs nccl-tests), for a machine with NVIDIA GPUs (the device tool's H200 lacks
# deepspeed and megatron-core: carry them as wheels built with `pip wheel --no-deps deepspeed==0.19.8`).
#   bash tests/gpu/run_checks.sh [wheel_dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -n "${1:-}" ]; then pip install --no-deps "$1"/*.whl; fi
pip install --no-deps -e . >/dev/null
python -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "${OUT:-/tmp}/gpu_checks.log"
