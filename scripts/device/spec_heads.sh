#!/bin/bash
# Issue 33's head rows on the H200: one draft step of an EAGLE-3 head (the published
# Llama-3.1-8B head's shape, random weights, on the Llama-3-8B shape) or of DeepSeek-V3's MTP
# layer (the config's first 3 layers, dense, plus its MoE MTP layer) at batch 1, which `bench
# latency` records as spec_draft_step_ms_bs1, beside that run's decode tok/s. One head a call:
#   bash scripts/device/spec_heads.sh eagle3    (~4 min: writes /tmp/l3 and /tmp/l3e)
#   bash scripts/device/spec_heads.sh mtp       (~8 min: writes /tmp/dsv3, ~34 GB)
# carry [".whl"]. The JSON lands in $OUT/r, the logs in $OUT/logs.tgz.
set -uo pipefail
head=${1:?usage: spec_heads.sh eagle3 | mtp}
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache
mkdir -p $OUT/r
T0=$(date +%s)
bench() { python3 -m compile_engine.benchmarks "$@"; }
common="--target h100 --dtype bfloat16 --results-dir $OUT/r --batch-sizes 1 --input-len 32 --output-len 64 --num-iters 2"
if [ "$head" = eagle3 ]; then
    [ -d /tmp/l3 ] || bench make-model llama3-8b --out /tmp/l3 --device cuda > $OUT/make.log 2>&1
    [ -d /tmp/l3e ] || bench make-model llama3-8b-eagle3 --out /tmp/l3e --device cuda >> $OUT/make.log 2>&1
    echo "== models at $(( $(date +%s) - T0 )) s"
    timeout 420 python3 -m compile_engine.benchmarks latency --model /tmp/l3 $common --name latency-eagle3 \
        --speculative-config '{"method": "eagle3", "model": "/tmp/l3e", "num_speculative_tokens": 3}' \
        2>&1 | tee $OUT/latency.log | grep -v Warn | tail -6
else
    [ -d /tmp/dsv3 ] || bench make-model deepseek-v3 --layers 3 --out /tmp/dsv3 --device cuda > $OUT/make.log 2>&1
    echo "== model at $(( $(date +%s) - T0 )) s"
    timeout 480 python3 -m compile_engine.benchmarks latency --model /tmp/dsv3 $common --name latency-mtp \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' \
        2>&1 | tee $OUT/latency.log | grep -v Warn | tail -6
fi
echo "== $head at $(( $(date +%s) - T0 )) s"
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
