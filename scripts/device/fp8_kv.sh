#!/bin/bash
# Issue 28's FP8 KV cache on the H200: the GPU tests (the paged-attention kernels over a
# float8_e4m3fn cache at Llama-3-8B's heads, bit-equal cache writes, CUDA-graph replay; a
# compiled tiny engine with kv_cache_dtype fp8 against its bf16-cache twin), a subset of the
# bf16 kernel tests, `bench paged-attention` decode over an FP8 cache (batch 1/64/256, contexts
# 512/4k/32k), then `bench latency` of the Llama-3-8B shape with --kv-cache-dtype auto and fp8
# at batch 1/64/256 in one call.
#   device call: carry [".whl"], command `bash scripts/device/fp8_kv.sh <commit>`
# JSON lands in $OUT/r (paged_attention_fp8-*, latency-kvauto-*, latency-kvfp8-*); logs in
# $OUT/logs.tgz. Bounded to about 8 minutes: every step has a
# timeout, the model is written in the background meanwhile.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
at() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
([ -d /tmp/l3 ] || timeout 150 python3 -m compile_engine.benchmarks make-model llama3-8b \
  --out /tmp/l3 --device cuda 2>&1 | tail -1) > $OUT/make-model.log 2>&1 &
MAKER=$!
timeout 120 python3 -m pytest tests/gpu/test_fp8_kv_cache_gpu.py -q -p no:cacheprovider \
  --maxfail=6 2>&1 | tee $OUT/tests-fp8kv.log | tail -15
at "fp8 kv tests"
# A subset of the bf16-cache kernel tests: the kernels' new constexpr branch is off for them.
timeout 60 python3 -m pytest tests/kernels/test_paged_attention.py -m gpu -q -p no:cacheprovider \
  --maxfail=6 -k "gpu_mixed or gpu_tiled_prefill or gpu_rotary" 2>&1 | tee $OUT/tests-pa.log \
  | tail -8
at "bf16 kernel tests"
# Over an FP8 cache; the bf16 record of the same shapes is paged_attention-nvidia-h200-9488c66.
timeout 60 python3 -m compile_engine.benchmarks paged-attention --kv-cache-dtype fp8 \
  --iters 10 --out $OUT/r 2>&1 | tee $OUT/pa-fp8.log | tail -12
at "paged-attention fp8"
wait $MAKER
cat $OUT/make-model.log
at "make-model"
L3="--target h100 --dtype bfloat16 --results-dir $OUT/r --batch-sizes 1,64,256"
for kv in auto fp8; do
  timeout 130 python3 -m compile_engine.benchmarks latency --model /tmp/l3 $L3 \
    --kv-cache-dtype $kv --name latency-kv$kv 2>&1 | tee $OUT/latency-$kv.log | grep -v Warn \
    | tail -5
  at "latency kv $kv"
done
# A device call returns at most 8 files: the logs go back as one archive beside the JSON.
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
