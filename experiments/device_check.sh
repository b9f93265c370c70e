#!/usr/bin/env bash
# The device check (docs/device.md): everything this project needs a GPU machine for, in one
# script that runs offline in under 8 minutes on the lent machine (one H100/H200, 16 CPU cores).
#
#   bash experiments/device_check.sh                       # from the repository root
#   QUICK=1 PROCESSES=2 bash experiments/device_check.sh   # the dry run (tests/test_device_check.py)
#
# Steps, each with its own time limit, so that one broken step costs only itself:
#   smoke    versions, devices, and a seconds-long step of every path below (device_smoke.py)
#   gpu      (one GPU) the GPU correctness tests (tests/test_gpu.py); per-layer forward,
#            backward and update times at the GPT-2-small and 1B shapes for the simulator
#            (layer_costs.py); backprop's bf16 MFU at GPT-2-small with cuDNN attention
#            (`ouroboros bench`, the largest batch that fits; at that batch once more with
#            --loss-chunk-tokens 0, the unchunked head)
#   mfu_levers  (one GPU, not in the default PARTS) the MFU step at batch 64 once per lever
#            (MFU_LEVERS below: each default off, cuBLAS GEMMs, Muon)
#   cpu      real concurrency: `ouroboros launch --processes P --pin-cpus -- bench` for each P in
#            $PROCESSES, one core per process, every schedule at its default streamed flow
# The cpu benches run side by side on disjoint cores, the gpu steps on the cores left. At the end
# summary.md (printed) and device_check.tar.gz (every log, CSV and table) go to $OUT.
#
# On the device machine: carry `.whl` (experiments/device_wheels.sh) for the data stack; the
# check installs it with no index into /tmp/site. No GPU: the gpu steps are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device_check}
WORK=${WORK:-$(mktemp -d /tmp/device_check.XXXX)}
PROCESSES=${PROCESSES:-4 8}
QUICK=${QUICK:-0}
PARTS=${PARTS:-smoke gpu_tests layer_costs train_gpu mfu cpu}  # which steps run
DEADLINE=${DEADLINE:-560}  # seconds: the last cpu bench is cut short to leave time to pack up
# seconds: the most one cpu bench may take (run 7: 346 s at G = 8, before each bench also timed
# its settings' one-device programs, ~10 s each then and now 9 steps each instead of 3, alone and
# beside copies of themselves, and the collective wait, ~15 s; a cut-short bench keeps its rows)
BENCH_LIMIT=${BENCH_LIMIT:-460}
# bench --rounds: 1 times the settings one after another (a bench cut short keeps its rows);
# R > 1 compiles them all first and interleaves their timed steps (drift falls on all alike).
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 OUROBOROS_DATA_DIR=${OUROBOROS_DATA_DIR:-$WORK/data}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
CORES=$(nproc)
echo "step,seconds,status" >"$WORK/steps.csv"

# step NAME LIMIT_S COMMAND...: runs it with a time limit, its output to NAME.log and the screen.
step() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local status=$?
  tail -n 25 "$WORK/$name.log"
  echo "$name,$((SECONDS - start)),$status" >>"$WORK/steps.csv"
  echo "=== $name: exit $status after $((SECONDS - start))s"
  return $status
}

if [ "$QUICK" = 1 ]; then
  SHAPE=(--d-model 64 --num-heads 2 --d-ff 256 --seq-len 32)
  TIMED=(--bench-steps 1 --warmup 0)
else
  # Compute-dominated on one core per process: ~0.35 GFLOP per token and layer pair of passes.
  SHAPE=(--d-model 512 --num-heads 8 --d-ff 2048 --seq-len 64)
  TIMED=(--bench-steps 3 --warmup 1)
fi

# AdamW, not Muon: at 512 tokens a step, Muon's Newton-Schulz costs one CPU core ~4x a layer's
# forward and backward (2.2 s against 0.6 s per stage at G = 8), and the step would time the
# optimizer, not the schedule. Ouroboros keeps its compensations (prediction, DC).
# cpu_bench P: every schedule on P pinned processes, 2P layers (ZB-V's chunks), a batch of at
# least 8 rows that the pipelined stream's 2P micro-batches divide.
cpu_bench() {
  local p=$1 name=$2
  # Ouroboros, then FSDP over the P processes beside 1F1B and replicated data parallelism (issue
  # 61; run 9's 8-process bench stopped before 1F1B), then ZB-V: a bench cut short keeps the rows
  # it measured first ("data_parallel" names the replicated one and FSDP, already named).
  local only="ouroboros M=$p stream locked,ouroboros M=$((2 * p)) stream pipelined"
  only+=",data_parallel fsdp,1f1b M=8,data_parallel,zb_v M=8,zb_h1 M=8,interleaved M=8,gpipe M=8"
  only+=",model_parallel,backprop"
  [ "$QUICK" = 1 ] && only="backprop,zb_v M=8,ouroboros M=$((2 * p)) stream pipelined"
  only=${ONLY:-$only}
  local limit=$((DEADLINE - SECONDS < BENCH_LIMIT ? DEADLINE - SECONDS : BENCH_LIMIT))
  step "$name" "$limit" python3 -m ouroboros_jax launch --processes "$p" --pin-cpus -- \
    bench --stages "$p" --num-layers $((2 * p)) --batch-size $((p < 4 ? 8 : 2 * p)) \
    "${SHAPE[@]}" "${TIMED[@]}" --rounds "$ROUNDS" \
    --optimizer adamw --compensation predict,dc --try-microbatches "8,$p,$((2 * p))" \
    --try-policy all --try-stash graph/nothing --only "$only" --out "$WORK/$name"
}

has() { [[ " $PARTS " == *" $1 "* ]]; }
has smoke && step smoke 90 python3 experiments/device_smoke.py --out "$WORK"
GPUS=$(python3 -c "import jax; print(len([d for d in jax.devices() if d.platform == 'gpu']))" \
  2>/dev/null || echo 0)

gpu_steps() {
  local free=$1
  local pin=()
  command -v taskset >/dev/null && pin=(taskset -c "$free")
  has gpu_tests && OUROBOROS_TEST_PLATFORMS=cuda,cpu step gpu_tests 120 "${pin[@]}" python3 -m pytest -q \
    -p no:cacheprovider tests/test_gpu.py --junitxml "$WORK/gpu_tests.xml"
  has layer_costs && step layer_costs 180 "${pin[@]}" python3 experiments/layer_costs.py --out "$WORK/layer_costs"
  has train_gpu && step train_gpu 120 "${pin[@]}" python3 -m ouroboros_jax train --preset tiny --dtype bfloat16 \
    --steps 50 --eval-every 50 --out "$WORK/train_gpu"
  local mfu=(python3 -m ouroboros_jax bench --preset gpt2-small --vocab-size 50257 --dropout 0
    --dtype bfloat16 --attention cudnn --stages 1 --only backprop --bench-steps 10 --warmup 2)
  has mfu && for batch in 64 32 16; do  # the largest batch that fits, with the default head
    step "mfu_b$batch" 120 "${pin[@]}" "${mfu[@]}" --batch-size "$batch" \
      --out "$WORK/mfu_b$batch" || continue
    # The same batch with the unchunked head (the float32 logits [B, L, V] whole), to compare.
    step "mfu_unchunked_b$batch" 120 "${pin[@]}" "${mfu[@]}" --batch-size "$batch" \
      --loss-chunk-tokens 0 --out "$WORK/mfu_unchunked_b$batch"
    break
  done
  # What holds the MFU back: the step at batch 64, once per lever, each against the same default
  # (MFU_LEVERS, each "name|words": an XLA_FLAGS=... word sets the environment, the rest are flags).
  has mfu_levers && for lever in "${MFU_LEVERS[@]}"; do
    local name=${lever%%|*} words=() env=() flags=()
    read -ra words <<<"${lever#*|}"
    for word in "${words[@]}"; do
      if [[ $word == XLA_FLAGS=* ]]; then env+=("$word"); else flags+=("$word"); fi
    done
    # 150 s: beside the cpu benches (4 cores left, host load 13) XLA's Triton GEMM autotuning
    # took the default, Muon and the unpadded vocabulary past 90 s in run 9; alone, 58 s (run 10).
    step "mfu_lever_$name" 150 env "${env[@]}" "${pin[@]}" "${mfu[@]}" --batch-size 64 \
      --bench-steps 5 --warmup 1 "${flags[@]}" --out "$WORK/mfu_lever_$name"
  done
}
# The levers of the mfu_levers part, each against the library's default (since 88b5951 the layer
# stack unrolled on GPU and the vocabulary padded to a multiple of 128; run 8 measured them as
# flags): each default turned off (a scan of one layer; the vocabulary unpadded), XLA's Triton
# GEMMs off (cuBLAS), Muon in place of the bench's AdamW, both defaults off.
MFU_LEVERS=(  # the most telling first: a step cut short keeps the levers it measured
  "default|"
  "cublas|XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"
  "scan|--layer-unroll 1"
  "unpadded|--vocab-multiple 1"
  "muon|--optimizer muon"
  "none|--layer-unroll 1 --vocab-multiple 1"
)

# The cpu benches run side by side on disjoint cores (P0 on cores 0..P0-1, the next on the next
# P1, ...) and the gpu steps on the cores left over; where the cores run out, one after another.
# A P that comes twice is a second, separate run (cpu_gPr2): two quiet runs of one bench.
next_core=0 jobs=()
declare -A runs=()
if has cpu; then
  for p in $PROCESSES; do
    if [ $((next_core + p)) -gt "$CORES" ]; then wait "${jobs[@]}"; jobs=() next_core=0; fi
    runs[$p]=$((${runs[$p]:-0} + 1))
    name=cpu_g$p$([ "${runs[$p]}" -gt 1 ] && echo "r${runs[$p]}")
    (taskset -pc "$next_core-$((next_core + p - 1))" $BASHPID >/dev/null && cpu_bench "$p" "$name") &
    jobs+=($!)
    next_core=$((next_core + p))
  done
fi
if [ "$GPUS" -gt 0 ]; then
  free=$([ "$next_core" -lt "$CORES" ] && echo "$next_core-$((CORES - 1))" || echo "0-$((CORES - 1))")
  gpu_steps "$free"
else
  echo "=== no GPU: the gpu steps are skipped"
fi
[ ${#jobs[@]} -gt 0 ] && wait "${jobs[@]}"

python3 experiments/device_summary.py "$WORK" | tee "$WORK/summary.md"
cp "$WORK/summary.md" "$OUT/summary.md"
tar czf "$OUT/device_check.tar.gz" -C "$WORK" --exclude data .
echo "wrote $OUT/summary.md and $OUT/device_check.tar.gz (from $WORK)"
