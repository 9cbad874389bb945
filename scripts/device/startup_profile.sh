#!/bin/bash
# Where a start from an artifact spends its time on the H200, function by function: builds the
# Llama-3-8B-shaped artifact, then runs `python -X importtime` and a cProfile of LLM(artifact)
# (scripts/device/startup_profile.py). Results in $OUT: importtime_top.txt, load_prof.txt,
# load.prof. About 150 s on a fresh machine.
#   device call: carry [".whl"], command `bash scripts/device/startup_profile.sh`
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache
T0=$(date +%s)
[ -d /tmp/l3 ] || timeout 120 python3 -m compile_engine.benchmarks make-model llama3-8b --out /tmp/l3 --device cuda > $OUT/make.log 2>&1
timeout 120 python3 -m compile_engine.cli build /tmp/l3 --target h100 --dtype bfloat16 --out /tmp/art > $OUT/build.log 2>&1
tail -2 $OUT/build.log; echo "== build at $(( $(date +%s) - T0 )) s"
timeout 60 python3 -X importtime scripts/device/startup_profile.py /tmp/art --no-profile 2> $OUT/importtime.txt
sort -t'|' -k2 -n -r $OUT/importtime.txt | head -40 > $OUT/importtime_top.txt
timeout 60 python3 scripts/device/startup_profile.py /tmp/art $OUT 2>&1 | tail -1
echo "== done at $(( $(date +%s) - T0 )) s"
