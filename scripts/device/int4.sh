#!/bin/bash
# Issue 29's GPU half on the H200: the integer weight-only GEMM's and the quantized_gemm pass's
# GPU tests (int4 / int8 / uint4_zp kernels against the reference at the Llama-3-8B shapes,
# split-K under CUDA-graph replay; tiny GPTQ / AWQ / int8 engines against eager), then
# `bench latency` on Llama-3-8B-shaped models that `bench make-model` writes on the device:
# GPTQ int4 (group 128, symmetric) at batch 1 and 64, GPTQ int8 at batch 1.
#   device call: carry [".whl"], command `bash scripts/device/int4.sh <commit>`
# JSON lands in $OUT/r (latency-int4-*, latency-int8-*); logs in $OUT/logs.tgz. Bounded to about
# 7 minutes: every step has a timeout, the models are written in the background meanwhile.
# SWEEP=1 retunes the int4 table before the latency (the new table comes back in $OUT/r; SWEEP_ROWS
# the row counts, default "1 16 64"; SWEEP_MODES the forms, default "fma dot");
# BASELINE=1 times batch 1 on the shipped table first; PASS_TESTS=0 and INT8=0 leave out the pass's engine tests and the int8 model.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
at() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
make() {  # preset dir, layout
  [ -d $1 ] || timeout 150 python3 -m compile_engine.benchmarks make-model llama3-8b --out $1 \
    --device cuda --quantize $2 2>&1 | tail -1
}
(make /tmp/l3gptq4 gptq-int4; [ "${INT8:-1}" = 1 ] && make /tmp/l3gptq8 gptq-int8) > $OUT/make-model.log 2>&1 &
MAKER=$!
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: the benchmarks alone
  timeout 100 python3 -m pytest tests/kernels/test_int_linear.py -m gpu -q -p no:cacheprovider \
    --maxfail=6 2>&1 | tee $OUT/tests-kernels.log | tail -12
  at "kernel tests"
  if [ "${PASS_TESTS:-1}" = 1 ]; then
    timeout 100 python3 -m pytest tests/passes/test_quantized_gemm_pass.py -m gpu -q \
      -p no:cacheprovider -k "integer" 2>&1 | tee $OUT/tests-pass.log | tail -12
    at "pass tests"
  fi
fi
L3="--target h100 --dtype bfloat16 --results-dir $OUT/r"
if [ "${BASELINE:-0}" = 1 ]; then  # BASELINE=1: batch 1 on the shipped table before the sweep
  wait $MAKER
  timeout 120 python3 -m compile_engine.benchmarks latency --model /tmp/l3gptq4 $L3 \
    --batch-sizes 1 --name latency-int4-before 2>&1 | tee $OUT/latency-before.log | grep -v Warn | tail -4
  at "latency int4 before"
fi
if [ "${SWEEP:-0}" = 1 ]; then  # SWEEP=1: retune the int4 table first (bench int-gemm), kept in $OUT
  timeout 220 python3 -m compile_engine.benchmarks int-gemm --weights int4 --rows ${SWEEP_ROWS:-1 16 64} \
    --budget-s ${SWEEP_BUDGET_S:-150} --modes ${SWEEP_MODES:-fma dot} --write-configs kernels_generated/configs/int_gemm.json \
    --results-dir $OUT/r 2>&1 | tee $OUT/int-gemm.log | grep -v Warn | tail -14
  cp kernels_generated/configs/int_gemm.json $OUT/r/
  at "int-gemm sweep"
fi
wait $MAKER
cat $OUT/make-model.log
at "make-model"
timeout 150 python3 -m compile_engine.benchmarks latency --model /tmp/l3gptq4 $L3 \
  --batch-sizes 1,64 --name latency-int4 2>&1 | tee $OUT/latency-int4.log | grep -v Warn | tail -6
at "latency int4"
if [ "${INT8:-1}" = 1 ]; then  # INT8=0: int4 only
  timeout 100 python3 -m compile_engine.benchmarks latency --model /tmp/l3gptq8 $L3 \
    --batch-sizes 1 --name latency-int8 2>&1 | tee $OUT/latency-int8.log | grep -v Warn | tail -5
  at "latency int8"
fi
# A device call returns at most 8 files: the logs go back as one archive beside the JSON.
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
