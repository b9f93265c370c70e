#!/usr/bin/env bash
# The GPU check (docs/results/precision.md): the test suite, then `ouroboros bench` in bf16 with the MFU
# of backprop, the best exact pipeline and Ouroboros, on every GPU of this machine.
#
#   bash experiments/gpu_check.sh                 # from the repository root; OUT=runs/gpu_check
#
# Needs a CUDA jax (`pip install -e ".[test]" "jax[cuda12]"`). The suite runs on 8 simulated CPU
# devices as in CI (its multi-device tests need 8); the bench runs on the GPUs. One GPU times
# backprop only: the pipelines and Ouroboros need --stages devices, one per stage.
set -euo pipefail
OUT=${OUT:-runs/gpu_check}
GPUS=$(python -c "import jax; print(jax.device_count('gpu'))")
nvidia-smi --query-gpu=name,memory.total --format=csv
pytest -n 2 -q
if [ "$GPUS" -ge 2 ]; then
  STAGES=$(( GPUS < 4 ? GPUS : 4 )) ONLY='backprop,1f1b M=8,zb_h1 M=8,ouroboros'
else
  STAGES=2 ONLY=backprop
fi
ouroboros bench --preset gpt2-small --dtype bfloat16 --batch-size 32 --stages "$STAGES" \
  --only "$ONLY" --bench-steps 20 --warmup 3 --out "$OUT"
cat "$OUT/bench.md"   # step ms, tokens/s and MFU of each setting
