#!/bin/bash
# Issue 30's cost on the H200: the structured-output GPU tests, then `bench structured` on a
# Llama-3-8B-shaped random model given a 128k byte-level BPE tokenizer (benchmarks/structured.py):
# output tok/s at batch 64 with every request under a JSON schema against none, alternating,
# the per-step mask time and the schemas' compile times.
#   device call: carry [".whl"] (with llguidance, see the README), command
#   `bash scripts/device/structured.sh <commit>`; the JSON lands in $OUT/r.
# MODEL_DIR (default /tmp/l3) lets a call that made the model already reuse it; TESTS=0 skips
# the GPU tests.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
L3=${MODEL_DIR:-/tmp/l3}
mkdir -p $OUT/r
T0=$(date +%s)
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured_gpu.py 2>&1 | tail -3
[ -d $L3 ] || python3 -m compile_engine.benchmarks make-model llama3-8b --out $L3 --device cuda 2>&1 | tail -1
echo "== model at $(( $(date +%s) - T0 )) s"
timeout ${STRUCTURED_BUDGET_S:-300} python3 -m compile_engine.benchmarks structured --model $L3 \
  --add-tokenizer --target h100 --dtype bfloat16 --max-num-seqs 64 --num-requests 512 \
  --input-len 128 --output-len 256 --repeats 2 --results-dir $OUT/r 2>&1 | tee $OUT/structured.log \
  | grep -v Warn | tail -16
echo "== structured at $(( $(date +%s) - T0 )) s"
