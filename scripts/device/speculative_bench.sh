#!/bin/bash
# Issue 33's recorded keys on the H200, `bench speculative` (benchmarks/speculative.py), in two
# device calls one after the other (the SmolLM2 GGUF travels in halves: run
# scripts/device/split_smollm2.sh here first):
#   call 1: carry [".whl", ".gguf_a"]   command: bash scripts/device/speculative_bench.sh 1
#   call 2: carry [".whl", ".gguf_b"]   command: bash scripts/device/speculative_bench.sh 2 <commit>
# Call 2 must find the machine still warm (~30 s after call 1). It runs
#   1. SmolLM2-135M (the GGUF dequantized to bfloat16 on CUDA: dtype auto keeps it quantized
#      on the CPU only), n-gram, the shipped rewrite/summarise/code-edit workload at batch 1,
#      with and without speculation alternating: spec_ngram_speedup_bs1 (target >= 1.8x);
#   2. the Llama-3-8B shape (bench make-model, on the device while 1 runs), `--replay`: every
#      draft accepted at k = 4 and none accepted, batch 1, 64 and 256:
#      spec_ceiling_speedup_bs1_k4 (>= 3.2x), spec_zero_accept_cost_bs1 (<= 0.03), and every
#      spec_*_speedup_bs64/256 >= 0.98.
# About 6 minutes; the JSON lands in $OUT/r, the logs in $OUT/logs.tgz. SKIP_SMOLLM2=1 runs
# only part 2 (then call 1 and .gguf_b are not needed); SKIP_REPLAY=1 only part 1;
# SMOLLM2_ARGS adds flags to part 1's run (e.g. "--profile $OUT/prof").
set -uo pipefail
phase=${1:?usage: speculative_bench.sh 1 | 2 <commit>}
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache
part_a=/tmp/smollm2.part_a
if [ "$phase" = 1 ]; then
    [ -f .gguf_a/part ] || { echo "no .gguf_a/part: carry .gguf_a"; exit 1; }
    echo "$(cat .gguf_a/part.sha256)  .gguf_a/part" | sha256sum -c --quiet - || exit 1
    cp .gguf_a/part "$part_a"
    echo "phase 1: first half in $part_a; now run phase 2 at once"
    exit 0
fi
export COMPILE_ENGINE_COMMIT=${2:?usage: speculative_bench.sh 2 <commit>}
mkdir -p $OUT/r
T0=$(date +%s)
# The replay's model has constant logits (make-model --constant-logits): with random weights the
# greedy continuation otherwise flips with each step's shape (bf16 near-ties), and the recorded
# continuation stopped being the target's (accept length 1.13 of 5 at batch 64, 417898e).
[ "${SKIP_REPLAY:-0}" = 1 ] || [ -d /tmp/l3c ] || (python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3c --device cuda --constant-logits > $OUT/make-model.log 2>&1) &
if [ "${SKIP_SMOLLM2:-0}" != 1 ]; then
    [ -f "$part_a" ] || part_a=.gguf_a/part
    if [ -f "$part_a" ] && [ -f .gguf_b/part ]; then
        cat "$part_a" .gguf_b/part > /tmp/smollm2.gguf
        echo "$(cat .gguf_b/sha256)  /tmp/smollm2.gguf" | sha256sum -c --quiet - && \
        timeout 200 python3 -m compile_engine.benchmarks speculative --model /tmp/smollm2.gguf \
            --target h100 --batch-sizes 1 --rounds 2 --max-tokens 128 --results-dir $OUT/r \
            ${SMOLLM2_ARGS:-} \
            2>&1 | tee $OUT/smollm2.log | grep -v Warn | tail -4
    else
        echo "no SmolLM2 halves (run phase 1 with .gguf_a, then this with .gguf_b): skipped"
    fi
    echo "== smollm2 n-gram at $(( $(date +%s) - T0 )) s"
fi
wait
[ "${SKIP_REPLAY:-0}" = 1 ] && { tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log); rm -f $OUT/*.log; exit 0; }
L3="--model /tmp/l3c --target h100 --dtype bfloat16 --results-dir $OUT/r"
timeout ${REPLAY_BUDGET_S:-330} python3 -m compile_engine.benchmarks speculative $L3 --replay \
    --batch-sizes ${REPLAY_SIZES:-1,64,256} --input-len 32 --output-len 128 --rounds 2 \
    2>&1 | tee $OUT/replay.log | grep -v Warn | tail -10
echo "== replay at $(( $(date +%s) - T0 )) s"
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
