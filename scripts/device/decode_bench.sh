#!/bin/bash
# The decode and offline rows of issue 7 on the H200, as the results in benchmarks/results were
# made: the decode kernels' GPU tests and tests/gpu/test_h100.py, then `bench latency` (batch
# 1/64/256, HF eager in the same run), `bench throughput` (1000 x 512/256, LLM's default token
# budget) and `bench breakdown --kernels` (batch 1/64/256) on a Llama-3-8B-shaped random model
# made on the device.
#   device call: carry [".whl"], command `bash scripts/device/decode_bench.sh <commit>`
# (.whl from ../shared/tools/device-wheels.sh). JSON lands in $OUT/r. About 6 minutes (at
# e3edd31: 3.4 minutes up to the throughput run, the breakdown about 30 s more). Latency takes
# bench's default of 3 measured runs since 2026-11-30 (2 before): at 2bf3115 one of two batch-256
# runs stalled once for ~1 s and the median of two is their mean.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
[ -d /tmp/l3 ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 --device cuda 2>&1 | tail -1) &
timeout 90 python3 -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_skinny_gemm.py \
  tests/kernels/test_argmax.py -m gpu -q -p no:cacheprovider 2>&1 | tee $OUT/tests-kernels.log | tail -2
echo "== kernel tests at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m pytest tests/gpu/test_h100.py tests/passes/test_skinny_gemm_pass.py -m gpu -q \
  -p no:cacheprovider 2>&1 | tee $OUT/tests-h100.log | tail -2
echo "== h100 tests at $(( $(date +%s) - T0 )) s"
wait
L3="--model /tmp/l3 --target h100 --dtype bfloat16 --results-dir $OUT/r"
timeout 300 python3 -m compile_engine.benchmarks latency $L3 --batch-sizes 1,64,256 --hf-reference 2>&1 | tee $OUT/latency.log | grep -v Warn | tail -6
echo "== latency at $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m compile_engine.benchmarks throughput $L3 2>&1 | tee $OUT/throughput.log | grep -v Warn | tail -4
echo "== throughput at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m compile_engine.benchmarks breakdown $L3 --batch-sizes 1,64,256 --kernels 2>&1 | tee $OUT/breakdown.log | grep -E "^batch|device kernels|^    [A-Za-z]" | head -30
echo "== breakdown at $(( $(date +%s) - T0 )) s"
# A device call returns at most 8 files: the logs go back as one archive beside the JSON.
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
