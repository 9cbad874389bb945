#!/bin/bash
# The skinny GEMM on the H200 in one call: `bench gemm` sweeps the Triton kernel's configs
# against cuBLAS and writes the tuned table, which then replaces the tree's copy here; the
# kernel's GPU tests; then `bench latency` (batch 1/64/256) with the skinny_gemm pass, on a
# Llama-3-8B-shaped random model made on the device while the sweep runs.
#   device call: carry [".whl"], command `bash scripts/device/skinny_gemm.sh <commit>`, about
#   5 minutes. Results in $OUT: gemm-*.json, skinny_gemm.json (copy to
#   kernels_generated/configs/), r/latency-skinny-gemm-*.json, logs.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
# Drawn on the GPU a shard at a time (milliseconds), written from the CPU: it does not touch
# the sweep's CUDA-graph timings beyond a few samples that the medians drop.
[ -d /tmp/l3 ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 --device cuda > $OUT/make-model.log 2>&1) &
cp kernels_generated/configs/skinny_gemm.json $OUT/skinny_gemm.json
timeout 170 python3 -m compile_engine.benchmarks gemm --out $OUT --budget-s ${SWEEP_BUDGET_S:-95} \
  --write-configs $OUT/skinny_gemm.json > $OUT/gemm.log 2>&1
grep -A60 "^shape" $OUT/gemm.log | grep -v "^ *$"
cp $OUT/skinny_gemm.json kernels_generated/configs/skinny_gemm.json
echo "== sweep at $(elapsed) s"
timeout 60 python3 -m pytest tests/kernels/test_skinny_gemm.py -m gpu -q -p no:cacheprovider 2>&1 | tail -2
echo "== gpu tests at $(elapsed) s"
wait
echo "== model at $(elapsed) s: $(tail -1 $OUT/make-model.log 2>/dev/null)"
L3="--model /tmp/l3 --target h100 --dtype bfloat16 --results-dir $OUT/r --batch-sizes 1,64,256 --num-iters 2"
timeout $(( 318 - $(elapsed) )) python3 -m compile_engine.benchmarks latency $L3 --passes +skinny_gemm \
  --name latency-skinny-gemm 2>&1 | tee $OUT/latency.log | grep -v Warn | tail -8
echo "== latency at $(elapsed) s"
