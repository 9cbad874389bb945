#!/bin/bash
# bench serve on the H200: `compile-engine serve` launched by the benchmark on Llama-3-8B-shaped
# random bf16 weights, 512 prompt / 256 output tokens, 1536 requests at concurrency 256 (6 waves;
# ~50 s of requests at 8k output tok/s, ~130 s at 3k). Usage on the device, from the repo root:
#   bash scripts/device/serve.sh <commit>          (MODEL=/path overrides /tmp/l3: a model or artifact;
#   SERVE_ARGS adds bench serve / engine flags, e.g. "--passes=-add_rms_norm_into_gemm")
# Everything lands in $OUT: r/*.json, serve.log (the table), server.log, make-model.log.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache COMPILE_ENGINE_COMMIT=$1
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/l3}
mkdir -p "$OUT/r"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
# The device call is capped at 600 s; leave room to stop the server and copy $OUT back.
left() { echo $(( ${SERVE_BUDGET_S:-560} - $(elapsed) )); }

if [ ! -e "$MODEL" ]; then
  timeout 300 python3 -m compile_engine.benchmarks make-model llama3-8b --out "$MODEL" --device cuda \
    > "$OUT/make-model.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "== make-model failed (rc $rc) at $(elapsed) s"; tail -20 "$OUT/make-model.log"; exit 1
  fi
fi
echo "== model ready at $(elapsed) s"

# make-model writes no tokenizer, and our server sends a stream chunk only when a token adds
# text: without one, each stream is a single chunk and TTFT/TPOT/ITL mean nothing. A word-level
# tokenizer (token i <-> "t{i}") makes every token its own chunk; tokenizer files are not part
# of an artifact's fingerprint. A no-op when the model already has a tokenizer.
python3 -c "import sys; from compile_engine.benchmarks.serve import add_word_tokenizer as add; \
print('== tokenizer:', add(sys.argv[1]) or 'already present')" "$MODEL" 2>&1 | tail -1

# SIGTERM on timeout reaches the benchmark (which stops its server) and the server itself
# (same process group; it finishes in-flight requests for up to 10 s); KILL 50 s later.
timeout -k 50 "$(left)" python3 -m compile_engine.benchmarks serve --launch --model "$MODEL" \
  --target h100 --dtype bfloat16 --dataset random --input-len 512 --output-len 256 \
  --num-prompts ${NUM_PROMPTS:-1536} --max-concurrency 256 --num-warmup 32 --ready-timeout 300 \
  --request-timeout 300 --goodput ttft:2000 tpot:100 \
  --server-log "$OUT/server.log" --results-dir "$OUT/r" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1
rc=$?
grep -v Warn "$OUT/serve.log" | tail -22
echo "== bench serve rc=$rc at $(elapsed) s (124: timed out)"
echo "== server.log tail:"; tail -8 "$OUT/server.log"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1
ls "$OUT/r"
exit $rc
