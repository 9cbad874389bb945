#!/bin/bash
# Issue 32's measurements on the H200, on a Llama-3-8B-shaped random model made on the device:
# `bench prefix --sweep` (TTFT at 0/50/90/99% shared prefix of 1k/4k/16k prompts, caching on vs
# off, one request at a time; the step-time sweep over 1..8,192 tokens a step; then 16 and 64
# requests at once for 1k and 4k prompts at 0 and 90%; every cell at budgets 16,384 and 2,048),
# then the sweep's decode rows up to 8,192 sequences on an engine of max_num_seqs 8,192 (the
# first engine's 256 caps its decode rows there).
#   device call: carry [".whl"], command `bash scripts/device/prefix.sh <commit>`
# (.whl from ../shared/tools/device-wheels.sh). JSON lands in $OUT/r: prefix-*.json and
# prefix-decode8192-*.json. Not yet run; estimated from the latency and startup records (LLM
# init 48 s cold, graph capture 20 s of it): model ~45 s, the first run ~200 s, the second ~80 s;
# the timeouts bound the whole at ~6.5 minutes.
# Each run writes its JSON after every part (sequential, sweep, concurrent), so a timeout keeps
# what finished. The concurrent 16k cells are left out for time (16 x 16k is ~10 s a run; 64 x
# 16k does not fit the KV pool and is skipped anyway): add `--concurrent-sizes 1k,4k,16k`.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
mkdir -p $OUT/r
T0=$(date +%s)
[ -d /tmp/l3 ] || python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 --device cuda 2>&1 | tail -1
echo "== model at $(( $(date +%s) - T0 )) s"
L3="--model /tmp/l3 --target h100 --dtype bfloat16 --results-dir $OUT/r"
timeout 230 python3 -m compile_engine.benchmarks prefix $L3 --sweep --concurrent-sizes 1k,4k \
  --concurrent-shares 0,90 2>&1 | tee $OUT/prefix.log | grep -v Warn | tail -80
echo "== prefix at $(( $(date +%s) - T0 )) s"
# Powers of two (the n-vs-2n target) and the graph bound's neighbour; 8,192 sequences of
# 32 tokens hold ~330k tokens of KV, ~43 GB.
timeout 120 python3 -m compile_engine.benchmarks prefix $L3 --sweep-only --sweep-modes decode \
  --sweep-tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,2049,4096,8192 --sweep-iters 3 \
  --max-num-seqs 8192 --name prefix-decode8192 2>&1 | tee $OUT/decode8192.log | grep -v Warn | tail -24
echo "== decode to 8192 sequences at $(( $(date +%s) - T0 )) s"
# A device call returns at most 8 files: the logs go back as one archive beside the JSON.
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log
