#!/bin/bash
# Every GPU test a change since the last device call touched, in three groups at once on the one
# H200 (the tests' models are small or 4-layer; the GPU has room for all three): the engine and
# graph tests, speculative decoding, the integer weight-only kernels, paged attention and the
# skinny GEMM (group d; b's SmolLM2 test reads $COMPILE_ENGINE_SMOLLM2_GGUF). A table of each group's
# outcome last; the logs come back as one archive.
#   device call: carry [".whl"], command `bash scripts/device/gpu_tests.sh <commit>`
#   TEST_GROUPS="a b" picks groups; BUDGET_S bounds each group (default 420).
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=${1:-unknown}
T0=$(date +%s)
group() {  # name, pytest arguments...
  local name=$1; shift
  timeout ${BUDGET_S:-420} python3 -m pytest -q -p no:cacheprovider -rfE "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tail -1 $OUT/$name.log) ($(( $(date +%s) - T0 )) s)" >> $OUT/summary.txt
}
declare -A TESTS=(
  [a]="tests/gpu/test_fp8_kv_cache_gpu.py tests/gpu/test_h100.py"
  [b]="tests/gpu/test_speculative_gpu.py tests/gpu/test_speculative_heads_gpu.py"
  [c]="tests/kernels/test_int_linear.py tests/passes/test_quantized_gemm_pass.py tests/models/test_quant_int.py -m gpu"
  [d]="tests/kernels/test_paged_attention.py tests/kernels/test_skinny_gemm.py -m gpu"
)
for g in ${TEST_GROUPS:-a b c}; do group $g ${TESTS[$g]} & done
wait
for f in $OUT/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|Error|assert" $f | head -8; done
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
cat $OUT/summary.txt
