#!/bin/bash
# Issue 28's FP8 checks and timings on the H200, from a copy of the fp8 branch exported into
# main's ignored .devrun/fp8 (device calls send main's checkout):
#   device call: carry [".whl", ".devrun"], command
#     `bash .devrun/fp8/scripts/device/fp8_bench.sh <commit> <phase>`
# phase "check": the FP8 kernels' and the pass's GPU tests, `bench fp8-gemm` sweeping the skinny
# configs and writing the table (it lands in $OUT and is used by the latency run after it), and
# `bench latency` of online FP8 at batch 1/64/256. Any other phase ("final"): the GPU tests, the
# sweep again, then `bench latency` in bf16 and in FP8 (online at batch 1/64/256, and the
# compressed-tensors FP8 checkpoint made by make-model at batch 1), one call.
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $ROOT/.whl/*.whl 2>/dev/null
cd $ROOT/.devrun/fp8 || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
at() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
[ -d /tmp/l3 ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 \
  --device cuda 2>&1 | tail -1) &
L3="--target h100 --dtype bfloat16 --results-dir $OUT/r --batch-sizes 1,64,256"
if [ "$2" = check ]; then
  timeout 120 python3 -m pytest tests/kernels/test_fp8_linear.py -m gpu -q --maxfail=8 -p no:cacheprovider \
    2>&1 | tee $OUT/tests-kernels.log | tail -15
  at "kernel tests"
  timeout 100 python3 -m pytest tests/passes/test_quantized_gemm_pass.py -m gpu -q -x \
    -p no:cacheprovider -k "ct-channel or online" 2>&1 | tee $OUT/tests-pass.log | tail -15
  at "pass tests"
  timeout 120 python3 -m compile_engine.benchmarks fp8-gemm --budget-s 75 --results-dir $OUT/r \
    --write-configs kernels_generated/configs/fp8_gemm.json 2>&1 | tee $OUT/sweep.log | tail -40
  cp kernels_generated/configs/fp8_gemm.json $OUT/
  at "sweep"
  wait
  timeout 200 python3 -m compile_engine.benchmarks latency --model /tmp/l3 $L3 --quantization fp8 \
    --name latency-fp8 2>&1 | tee $OUT/latency-fp8.log | grep -v Warn | tail -6
  at "latency fp8"
else
  [ -d /tmp/l3ct ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3ct \
    --device cuda --quantize ct-channel 2>&1 | tail -1) &
  timeout 60 python3 -m pytest tests/kernels/test_fp8_linear.py -m gpu -q --maxfail=8 \
    -p no:cacheprovider 2>&1 | tee $OUT/tests-kernels.log | tail -12
  at "kernel tests"
  timeout 80 python3 -m pytest tests/passes/test_quantized_gemm_pass.py -m gpu -q \
    -p no:cacheprovider -k "ct-channel or online or fp8-block" 2>&1 | tee $OUT/tests-pass.log \
    | tail -12
  at "pass tests"
  timeout 90 python3 -m compile_engine.benchmarks fp8-gemm --budget-s 50 --results-dir $OUT/r \
    --write-configs kernels_generated/configs/fp8_gemm.json 2>&1 | tee $OUT/sweep.log | tail -24
  cp kernels_generated/configs/fp8_gemm.json $OUT/
  at "sweep"
  wait
  for variant in bf16 fp8 ct; do
    case $variant in
      bf16) args="--model /tmp/l3 --name latency-bf16 $L3" ;;
      fp8) args="--model /tmp/l3 --quantization fp8 --name latency-fp8 $L3" ;;
      ct) args="--model /tmp/l3ct --name latency-fp8-ct ${L3/1,64,256/1}" ;;
    esac
    timeout $([ $variant = ct ] && echo 80 || echo 140) python3 -m compile_engine.benchmarks \
      latency $args 2>&1 | tee $OUT/latency-$variant.log | grep -v Warn | tail -5
    at "latency $variant"
  done
fi
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
