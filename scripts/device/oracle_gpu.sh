#!/bin/bash
# Issue 5's trained-weights accuracy bar on the H200, in two device calls one after the other
# (the GGUF travels in halves; see scripts/device/split_smollm2.sh, run it here first):
#   call 1: carry [".whl", ".gguf_a"]   command: bash scripts/device/oracle_gpu.sh 1
#   call 2: carry [".whl", ".gguf_b"]   command: bash scripts/device/oracle_gpu.sh 2
# Call 2 must find the machine still warm (it stays warm ~30 s after a call): it reads the
# first half that call 1 left in /tmp (or in .gguf_a/, which survives while no call names it
# in carry). Output: $OUT/oracle_trained.log and $OUT/oracle_trained.json.
set -uo pipefail
phase=${1:?usage: oracle_gpu.sh 1|2}
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
part_a=/tmp/smollm2.part_a
if [ "$phase" = 1 ]; then
    [ -f .gguf_a/part ] || { echo "no .gguf_a/part: carry .gguf_a"; exit 1; }
    echo "$(cat .gguf_a/part.sha256)  .gguf_a/part" | sha256sum -c --quiet - || exit 1
    cp .gguf_a/part "$part_a"
    echo "phase 1: first half in $part_a ($(stat -c %s "$part_a") bytes); now run phase 2 at once"
    exit 0
fi
[ -f "$part_a" ] || part_a=.gguf_a/part
[ -f "$part_a" ] || { echo "the first half is gone (machine not warm?): run phase 1 again, then 2"; exit 1; }
[ -f .gguf_b/part ] || { echo "no .gguf_b/part: carry .gguf_b"; exit 1; }
cat "$part_a" .gguf_b/part > /tmp/smollm2.gguf
echo "$(cat .gguf_b/sha256)  /tmp/smollm2.gguf" | sha256sum -c - || { echo "sha256 mismatch: the halves do not rejoin"; exit 1; }
export COMPILE_ENGINE_SMOLLM2_GGUF=/tmp/smollm2.gguf
export COMPILE_ENGINE_ORACLE_JSON=$OUT/oracle_trained.json
export COMPILE_ENGINE_CACHE_DIR=/tmp/cecache
T0=$(date +%s)
timeout 200 python3 -m pytest tests/gpu/test_trained_bf16.py -m gpu -q -s -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/oracle_trained.log" | grep -E "vs HF|passed|failed|skipped|SKIP|^E " | tail -20
echo "== done in $(( $(date +%s) - T0 )) s (rc ${PIPESTATUS[0]})"
