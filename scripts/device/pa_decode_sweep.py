"""Sweep the single-token (decode) paged-attention kernel's configs at the engine's shapes.

Device call: carry [".whl"], command: the install line (README.md), then
`python3 scripts/device/pa_decode_sweep.py` (under a minute on the H200). Every config is
compiled first in parallel worker processes (Triton's on-disk cache), then timed in this one
by CUDA-graph replay at decode shapes from batch 1 to 256 and contexts from 32 to 32k
(Llama-3-8B heads, bf16, block 16, block tables as wide as a 16k-token model's, so split-KV
is chosen as in the engine) and checked against the reference, three launches in a row (the
fused split reduction's counters must come back to zero). Rows: the kernel file's own
config table (with the fused split reduction and with the reduce kernel), then each
candidate at every shape. Prints one line per row and writes $OUT/pa_decode_sweep.json as it
goes, then $OUT/pa-decode-sweep-<device>-<commit>.json (with command, commit, device and
versions) for benchmarks/results, which `bench render` shows; the chosen configs live in
kernels_generated/paged_attention.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
import compile_engine.kernels_generated.paged_attention as pa  # noqa: E402
from compile_engine.benchmarks.results import write_result  # noqa: E402
from compile_engine.kernels_generated.counters import ALLOCATED  # noqa: E402
from compile_engine.models.ops import paged_attention_ref  # noqa: E402

LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
WIDTH = 1024  # block-table columns: a 16k-token model

# (BLOCK_N, num_warps, num_stages[, maxnreg]). A program per several KV heads (block-diagonal
# q, 2 and 4 heads) was swept too in this script's first version and lost at every shape.
CANDIDATES = [
    (32, 2, 2), (32, 2, 3), (32, 4, 2), (32, 4, 3), (64, 2, 2), (64, 2, 3), (64, 4, 2),
    (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (16, 2, 2),
    # Unpipelined: more programs resident an SM (short contexts are bound by per-program latency)
    (32, 2, 1), (32, 1, 1), (64, 2, 1), (64, 4, 1), (128, 4, 1), (16, 1, 1),
    # Register caps. Offline sm_90 compiles (triton 3.6): 32 / 2 / 2 takes 160 registers, so 6
    # programs an SM (shared memory would allow 10) and batch 256's 2,048 programs run in 3
    # waves; capped at 128 (8 bytes of spill) 8 fit, 2 waves.
    (32, 2, 2, 128), (32, 2, 2, 112), (32, 2, 3, 128), (16, 2, 2, 96),
]  # fmt: skip


def config(block_n: int, warps: int, stages: int, maxnreg: int | None = None, **extra) -> dict:
    base = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "MIN_SPLIT_KEYS": 64}
    if maxnreg is not None:
        base["maxnreg"] = maxnreg
    return {**base, **extra}


def use(cfg: dict | None, fused: bool = True) -> None:
    """Run every launch with cfg (None: the kernel file's own table)."""
    pa.decode_config = ORIGINAL if cfg is None else (lambda num_tokens, device: cfg)
    pa._FUSED_REDUCE = fused
    # Fresh zeroed counters: a faulty config must not spoil the next.
    for key in [k for k in ALLOCATED if k[0] == "paged_attention"]:
        del ALLOCATED[key]


ORIGINAL = pa.decode_config

# name: (batch, context range, table width)
SHAPES = {
    "bs256_c100": (256, (32, 160), WIDTH),
    "bs256_c640": (256, (513, 768), WIDTH),
    "bs64_c100": (64, (40, 160), WIDTH),
    "bs1_c100": (1, (100, 100), WIDTH),
    "bs1_c32k": (1, (32768, 32768), 2048),
    "bs8_c2k": (8, (1500, 2500), WIDTH),
    "bs16_c300": (16, (200, 400), WIDTH),
    "bs64_c4k": (64, (4096, 4096), WIDTH),
    "bs256_c4k": (256, (4096, 4096), WIDTH),
    "bs64_c32k": (64, (32768, 32768), 2048),
}


# Every (batch, table width) launched, for the compile workers: the split count depends on both.
CHECKS = {"check_bs2": (2, (3000, 5000), WIDTH), "check_bs64": (64, (1, 700), WIDTH),
          "check_bs5": (5, (1, 300), 64)}  # fmt: skip


def batch(batch_size: int, lo: int, hi: int, width: int, seed: int = 0) -> pa.PagedBatch:
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch_size)]
    return pa.make_batch([1] * batch_size, lens, dtype=torch.bfloat16, device="cuda",
                         table_width=width, seed=seed, **LLAMA8B)  # fmt: skip


def compile_worker(jobs: list[tuple[str, dict | None, bool]]) -> list[str]:
    """Compile each job at every shape's split count on tiny contexts (same kernel keys)."""
    errors = []
    every = {**SHAPES, **CHECKS}
    small = {name: batch(b, 3, 40, w) for name, (b, _, w) in every.items()}
    for name, cfg, fused in jobs:
        use(cfg, fused)
        try:
            for b in small.values():
                pa.paged_attention_triton(*b.args())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded, the main process skips it
            errors.append(f"{name}: {str(e)[:200]}")
    return errors


def precompile(configs: list, workers: int) -> list[str]:
    chunks = [configs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [e for errs in pool.map(compile_worker, [c for c in chunks if c]) for e in errs]


def micros(b: pa.PagedBatch, **kwargs) -> float:
    def fn(*args):
        return pa.paged_attention_triton(*args, **kwargs)

    return round(pa.bench(b, fn=fn, cuda_graph=True, iters=10, inner=5)["seconds"] * 1e6, 2)


def max_err(b: pa.PagedBatch) -> float:
    cache_ref, cache_out = b.kv_cache.clone(), b.kv_cache.clone()
    expected = paged_attention_ref(*b.args(cache_ref)).float()
    got = pa.paged_attention_triton(*b.args(cache_out)).float()
    err = (got - expected).abs().max().item()
    if not torch.equal(cache_out, cache_ref):
        err = float("inf")
    # Twice more: the fused reduce's counters must be back at zero after each launch.
    for _ in range(2):
        again = pa.paged_attention_triton(*b.args(b.kv_cache.clone())).float()
        err = max(err, (again - expected).abs().max().item())
    return err


def time_job(job: tuple[str, dict | None, bool], shapes: dict, checks: list) -> dict:
    name, cfg, fused = job
    use(cfg, fused)
    row = {"name": name, "config": cfg, "fused_reduce": fused}
    try:
        for shape, b in shapes.items():
            row[shape] = micros(b)
        row["max_err"] = max(max_err(c) for c in checks)
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: go on
        row["error"] = str(e)[:300]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    p.add_argument("--budget-s", type=float, default=200.0, help="stop timing new configs")
    args = p.parse_args()
    t0 = time.time()
    out_path = os.path.join(os.environ.get("OUT", "/tmp"), "pa_decode_sweep.json")
    jobs = [("table", None, True), ("table_reduce_kernel", None, False)]
    jobs += [("/".join(map(str, c)), config(*c), True) for c in CANDIDATES]
    result: dict = {"compile_errors": precompile(jobs, args.workers)}
    result["compile_s"] = round(time.time() - t0, 1)
    print("compiled in", result["compile_s"], "s; errors:", result["compile_errors"], flush=True)

    shapes = {name: batch(b, lo, hi, w) for name, (b, (lo, hi), w) in SHAPES.items()}
    checks = [batch(b, lo, hi, w, seed=i) for i, (b, (lo, hi), w) in enumerate(CHECKS.values())]
    rows = []
    for job in jobs:
        if time.time() - t0 > args.budget_s:
            print("time budget: stop", flush=True)
            break
        rows.append(time_job(job, shapes, checks))
        result["rows"] = rows
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    # The BY_SEQ launch beside the tiled kernel (a mixed offline step), with the table.
    use(None)
    rng = random.Random(1)
    decodes = [rng.randint(513, 768) for _ in range(237)]
    mixed = pa.make_batch([600] * 3 + [1] * 237, [600] * 3 + decodes, dtype=torch.bfloat16,
                          device="cuda", **LLAMA8B)  # fmt: skip
    result["mixed_3x600_237dec_us"] = micros(mixed, tiled=True)
    result["total_s"] = round(time.time() - t0, 1)
    print("mixed", result["mixed_3x600_237dec_us"], "us; total", result["total_s"], "s")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    # The same as a results JSON (command, commit, device, versions) for benchmarks/results.
    print("wrote", write_result("pa-decode-sweep", result, os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
