#!/bin/bash
# A/B (or A/B/C) of engine variants under `bench serve` (512/256 at concurrency 256) in one device
# call, the runs alternating as in latency_ab.sh (scripts/device/ab.sh). A variant is a quoted
# string of bench serve / engine flags, which the launched server gets, e.g. "" (the defaults),
# "--passes=-add_rms_norm_into_gemm", "--max-cuda-graph-tokens 512" or
# '--kernel-config={"pdl":false}'. Usage:
#   bash scripts/device/serve_ab.sh <commit> <rounds> "<variant A>" "<variant B>" ...
# NUM_PROMPTS (768 here: 3 waves, ~1 minute a run at 8k tok/s) and MODEL as for serve.sh. The
# first run of a variant builds its artifact (~50 s). Each run's JSON comes back as
# $OUT/<label>-r<round>.json (at most 8 files a call); its logs stay in /tmp/serve-ab.
set -u
commit=$1 rounds=$2
shift 2
export NUM_PROMPTS=${NUM_PROMPTS:-768}
REAL_OUT=${OUT:-/tmp/out}
T0=$(date +%s)
source scripts/device/ab.sh
run() {  # run <label> <round> <variant>
  local label=$1 round=$2 dir=/tmp/serve-ab/$1-r$2
  split_variant "$3"
  rm -rf "$dir"; mkdir -p "$dir"
  env "${ENVS[@]}" OUT="$dir" SERVE_ARGS="${ARGS[*]}" SERVE_BUDGET_S=240 \
    bash scripts/device/serve.sh "$commit" > "$dir/run.log" 2>&1
  cp "$dir"/r/serve-*.json "$REAL_OUT/$label-r$round.json" 2>/dev/null
  echo "$label round $round ($3): $(grep -E 'output tok/s|TPOT' "$dir/serve.log" \
    | tr -s ' ' | tr '\n' ' ')at $(( $(date +%s) - T0 )) s"
}
alternate "$rounds" run "$@"
