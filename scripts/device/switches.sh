#!/bin/bash
# Try engine switches that are off by default: the GPU tests with every variant's settings on
# at once (the decode kernels' tests and tests/gpu/test_h100.py, the HF oracle), the attention
# probe (PROBE_ARGS=--ablation-only skips its split sweeps), then a `bench latency` A/B of the
# defaults against each variant at BATCHES (default 1; e.g. BATCHES=1,64), ROUNDS rounds
# (default 2), the variants' order reversed in the second. A variant is a quoted string of
# VAR=value settings, as latency_ab.sh takes. Usage on the device, from the repo root:
#   bash scripts/device/switches.sh <commit> "COMPILE_ENGINE_NORM_DEFER_SUM=0" ...
# carry [".whl"]. At 908d9f3 with three variants the tests and the probe took 145 s and the
# A/B of two variants 196 s, more than one call may run: SKIP_AB=1 runs the first part,
# SKIP_TESTS=1 the second (two calls back to back, so the second finds the model and the
# caches warm). JSON and logs in $OUT/bundle.tgz (a call brings back at most 8 files, and
# none from folders nested too deep).
set -u
commit=$1
shift
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$commit
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
[ -d /tmp/l3 ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 --device cuda > /tmp/make-model.log 2>&1) &
settings=()
for variant in "$@"; do
  for word in $variant; do settings+=("$word"); done
done
if [ -z "${SKIP_TESTS:-}" ]; then
  env "${settings[@]}" timeout 200 python3 -m pytest tests/kernels/test_paged_attention.py \
    tests/kernels/test_skinny_gemm.py -m gpu -q -p no:cacheprovider > "$OUT/logs/tests-kernels.log" 2>&1
  echo "kernel tests (${settings[*]}): $(tail -1 "$OUT/logs/tests-kernels.log") at $(( $(date +%s) - T0 )) s"
  env "${settings[@]}" timeout 150 python3 -m pytest tests/gpu/test_h100.py -m gpu -q -p no:cacheprovider \
    > "$OUT/logs/tests-h100.log" 2>&1
  echo "h100 tests: $(tail -1 "$OUT/logs/tests-h100.log") at $(( $(date +%s) - T0 )) s"
  timeout 150 python3 scripts/device/attention_probe.py --out "$OUT/attention-probe.json" ${PROBE_ARGS:-} 2>&1 \
    | grep -v Warn | tee "$OUT/logs/attention-probe.log" | tail -40
fi
wait
if [ -z "${SKIP_AB:-}" ]; then
  reversed=()
  for ((i = $#; i >= 1; i--)); do reversed+=("${!i}"); done
  batches=${BATCHES:-1}
  LATER_SIZES=$batches MODEL=/tmp/l3 OUT="$OUT/ab1" bash scripts/device/latency_ab.sh "$commit" "$batches" 1 "" "$@"
  if [ "${ROUNDS:-2}" -gt 1 ]; then
    LATER_SIZES=$batches MODEL=/tmp/l3 OUT="$OUT/ab2" bash scripts/device/latency_ab.sh "$commit" "$batches" 1 "${reversed[@]}" ""
  fi
fi
cp /tmp/ab-logs/*.log "$OUT/logs/" 2>/dev/null
cd "$OUT" && tar czf /tmp/bundle.tgz . && rm -rf ./* && mv /tmp/bundle.tgz .
echo "total $(( $(date +%s) - T0 )) s"
