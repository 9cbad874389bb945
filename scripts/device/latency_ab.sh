#!/bin/bash
# A/B (or A/B/C/...) of engine variants by `bench latency` in one device call, the runs
# alternating (A B A B ...) so that clock and power drift land on all. A variant is a quoted
# string of bench arguments (scripts/device/ab.sh), e.g. "" (the defaults),
# "--passes=-rotary_into_attention" or '--kernel-config={"pdl":false}'. Usage on the device,
# from the repo root:
#   bash scripts/device/latency_ab.sh <commit> <batch sizes> <rounds> "<variant A>" "<variant B>" ...
#   e.g. bash scripts/device/latency_ab.sh abc1234 1,64,256 2 "" "--passes=-rotary_into_attention"
# Rounds after the first time only the largest batch size (the noisiest, power-capped one),
# or LATER_SIZES (e.g. LATER_SIZES=1 for a batch-1 change).
# JSON lands in $OUT/a/r<round>, $OUT/b/r<round>, ...; one line per run. The runs' logs stay
# in /tmp/ab-logs: a call brings back at most 8 files, so variants x rounds must stay <= 8.
set -u
commit=$1 batches=$2 rounds=$3
shift 3
variants=("$@")
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$commit
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/l3}
T0=$(date +%s)
[ -e "$MODEL" ] || timeout 300 python3 -m compile_engine.benchmarks make-model llama3-8b --out "$MODEL" --device cuda > /tmp/ab-make-model.log 2>&1
later=${LATER_SIZES:-${batches##*,}}
source scripts/device/ab.sh
run() {  # run <label> <round> <variant>
  local label=$1 round=$2
  split_variant "$3"
  local sizes=$batches; [ "$round" -gt 1 ] && sizes=$later
  local dir="$OUT/$label/r$round" log="/tmp/ab-logs/$label-r$round.log"
  mkdir -p "$dir" /tmp/ab-logs
  env "${ENVS[@]}" timeout 200 python3 -m compile_engine.benchmarks latency --model "$MODEL" --target h100 \
    --dtype bfloat16 --batch-sizes "$sizes" --num-iters 2 --results-dir "$dir" "${ARGS[@]}" \
    > "$log" 2>&1
  echo "$label round $round ($3): $(grep -E '^ +[0-9]+ ' "$log" \
    | awk '{printf "%s: %s (%s ms)  ", $1, $2, $3}')at $(( $(date +%s) - T0 )) s"
}
alternate "$rounds" run "${variants[@]}"
