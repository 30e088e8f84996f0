#!/usr/bin/env bash
# The GPU checks as one prepared script, for a machine with NVIDIA GPUs.
#   bash tests/gpu/run_checks.sh [wheel_dir]          the part that fits 10 minutes of a lend: SDPA's memory-efficient
#                                                     kernel with grouped heads (the T4 ladder's attention, seconds),
#                                                     the 1.1B model on one GPU
#                                                     through each backend, side by side (tests/gpu/test_side_by_side.py),
#                                                     figures to $OUT/gpu_side_by_side.txt for bench/results/
#   FULL=1 bash tests/gpu/run_checks.sh [wheel_dir]   then calibrate + recommend verify on one GPU, DeepSpeed ZeRO-2/3 and
#                                                     Megatron-Core TP1 with each recompute policy on the 0.5B model, the
#                                                     torch backend's FSDP2 on the 1.1B model, and commbench vs nccl-tests
# The device tool's H200 has torch but neither deepspeed nor megatron-core, and a Python (3.12) that
# pyproject's requires-python refuses: carry the wheels (`pip wheel --no-deps deepspeed==0.19.8`, plus
# megatron-core, msgspec, hjson, pydantic, transformers, tokenizers and pyarrow for cp312) and the tree runs from
# PYTHONPATH. Each part has its own time limit (SIDE_BY_SIDE_SECONDS, default 480; with FULL: CALIBRATE_SECONDS, default
# 900: on one H200 calibrate took 6.6 min and recommend verify 2.4 min; TRAINING_SECONDS, default 1800); logs go to
# $OUT (else /tmp). Exit status: 1 if any part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
if [ -n "${1:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, deepspeed, megatron.core, transformers; print('torch', torch.__version__, 'deepspeed',
deepspeed.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" || exit 1
check() {  # name seconds pytest-args...; a part out of time is killed whole (-k), its ranks with it
  local name=$1 seconds=$2
  shift 2
  timeout -k 30 "$seconds" python3 -m pytest -q -s -p no:cacheprovider --basetemp="/tmp/gpu_$name" "$@" 2>&1 \
    | tee "$out/$name.log"
}
rc=0
check attention 120 tests/gpu/test_attention_kernels_gpu.py || rc=1  # the T4 ladder's kernel, seconds
check side_by_side "${SIDE_BY_SIDE_SECONDS:-480}" tests/gpu/test_side_by_side.py || rc=1
if [ -n "${FULL:-}" ]; then
  check calibrate "${CALIBRATE_SECONDS:-900}" tests/gpu/test_calibrate_gpu.py || rc=1
  cp /tmp/gpu_calibrate/*/cal*.json "$out/" 2>/dev/null
  check training "${TRAINING_SECONDS:-1800}" tests/gpu --ignore tests/gpu/test_calibrate_gpu.py \
    --ignore tests/gpu/test_side_by_side.py --ignore tests/gpu/test_attention_kernels_gpu.py || rc=1
fi
exit $rc
