#!/bin/bash
# Issue 33 on the H200: the speculative-decoding GPU test (a compiled float32 tiny Llama with
# CUDA graphs: greedy tokens with n-gram drafts and with a compiled draft model equal the
# engine's without speculation, every verification step replaying a captured graph).
#   device call: carry [".whl"], command `bash scripts/device/speculative.sh`.
source scripts/device/env.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COMPILE_ENGINE_CACHE_DIR=/tmp/cecache
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py 2>&1 | tail -15
