#!/bin/bash
# The no-regression check of a change on the H200: `bench latency` (batch 1/64/256) and
# `bench throughput` (1000 x 512/256) of an earlier commit's tree and of this checkout, in one
# call, alternating (old latency, new latency, old throughput, new throughput), on one
# Llama-3-8B-shaped random model, so that the machine's ~1.5% spread lands on both.
#   here:    mkdir -p .devrun/old && git archive <old> | tar -x -C .devrun/old --exclude=docs \
#              --exclude=benchmarks/results
#   device:  carry [".whl", ".devrun"], command
#            `bash scripts/device/compare_trees.sh <old commit> <new commit>`
# An old tree from before 802a0e4 has top-level packages (`python -m benchmarks`); a newer one
# the compile_engine package. JSON lands in $OUT/old and $OUT/new, the logs in one archive.
# BENCHES (default "latency throughput") picks the benchmarks.
# Separate Inductor caches per tree: each pays its own cold compile in its latency run.
set -u
old_commit=$1 new_commit=$2
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD OLD=$PWD/.devrun/old MODEL=${MODEL:-/tmp/l3}
mkdir -p "$OUT/old" "$OUT/new" /tmp/cmp-logs
T0=$(date +%s)
[ -e "$MODEL" ] || timeout 300 python3 -m compile_engine.benchmarks make-model llama3-8b \
  --out "$MODEL" --device cuda > /tmp/cmp-logs/make-model.log 2>&1
echo "== model at $(( $(date +%s) - T0 )) s"
run() {  # run old|new latency|throughput [args...]
  local side=$1 bench=$2; shift 2
  local tree=$ROOT module=compile_engine.benchmarks commit=$new_commit
  if [ "$side" = old ]; then
    tree=$OLD commit=$old_commit
    [ -d "$OLD/compile_engine" ] || module=benchmarks
  fi
  (cd "$tree" && PYTHONPATH=$tree:/tmp/site COMPILE_ENGINE_CACHE_DIR=/tmp/cecache-$side \
    COMPILE_ENGINE_COMMIT=$commit timeout 280 python3 -m $module $bench --model "$MODEL" \
    --target h100 --dtype bfloat16 --results-dir "$OUT/$side" "$@" \
    > "/tmp/cmp-logs/$side-$bench.log" 2>&1)
  echo "== $side $bench ($?) at $(( $(date +%s) - T0 )) s"
  grep -E '^ +[0-9]+ |output tok/s|tok/s' "/tmp/cmp-logs/$side-$bench.log" | grep -v Warn | tail -4
}
for bench in ${BENCHES:-latency throughput}; do  # BENCHES=latency: the decode rows only
  args=(); [ "$bench" = latency ] && args=(--batch-sizes 1,64,256)
  run old "$bench" "${args[@]}"
  run new "$bench" "${args[@]}"
done
tar czf "$OUT/logs.tgz" -C /tmp/cmp-logs .
