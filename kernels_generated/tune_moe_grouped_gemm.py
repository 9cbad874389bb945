"""Tune the MoE grouped-GEMM tiles on the current GPU and write them to the config file.

    python -m compile_engine.kernels_generated.tune_moe_grouped_gemm \
        --experts 128,64 --tokens 1,64,256,2048

For each (experts, token count): for each BLOCK_M worth trying at that many rows per expert,
align once, then time every tile candidate of GEMM 1 (silu fused) and of GEMM 2 (weights
fused) on their own (CUDA-graph replay, so launch overhead does not count); keep the BLOCK_M
whose best pair is fastest. The two GEMMs are tuned apart because only BLOCK_M ties them (it
fixes the alignment): a joint search would multiply the candidates, and compiling them is what
tuning costs. Entries are merged into configs/moe_grouped_gemm.json under the h100 target,
replacing entries of the same key.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch
import triton

from compile_engine.kernels_generated import moe_grouped_gemm as mk
from compile_engine.kernels_generated.configs import ConfigEntry, ConfigTable, TargetConfigs

# (BLOCK_N, BLOCK_K, num_warps, num_stages): narrow-N/deep-K tiles stream decode's few rows
# through many programs; wide tiles reuse each loaded weight over more rows at prefill.
TILES = [
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (64, 256, 4, 2),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
]


def block_m_candidates(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 8:
        return [16]
    if rows_per_expert <= 32:
        return [16, 32]
    return [32, 64, 128]


def _tiles(t: tuple[int, int, int, int], group_m: int = 8) -> dict:
    n, k, warps, stages = t
    return {"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group_m, "num_warps": warps,
            "num_stages": stages}  # fmt: skip


def _best(fn, candidates: list[dict]) -> tuple[float, dict] | None:
    best = None
    for tiles in candidates:
        try:
            seconds = mk.bench(functools.partial(fn, tiles=tiles), (), iters=5, cuda_graph=True)
        except (triton.runtime.errors.OutOfResources, RuntimeError) as err:
            print(f"    skip {tiles}: {type(err).__name__}", flush=True)
            continue
        if best is None or seconds < best[0]:
            best = (seconds, tiles)
    return best


def tune_one(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int) -> dict:
    x, w13, w2, weights, ids = mk.make_inputs(num_tokens, num_experts, hidden, inter, top_k,
                                              dtype=torch.bfloat16, device="cuda")  # fmt: skip
    act = torch.randn(num_tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
    candidates = [_tiles(t) for t in TILES]
    results = []
    for block_m in block_m_candidates(num_tokens * top_k / num_experts):
        sorted_ids, blocks = mk.moe_align_triton(ids, num_experts, block_m)

        def gemm1(tiles, block_m=block_m, sorted_ids=sorted_ids, blocks=blocks):
            return mk.moe_gemm_triton(x, w13, sorted_ids, blocks, top_k, tiles, silu=True)

        def gemm2(tiles, sorted_ids=sorted_ids, blocks=blocks):
            return mk.moe_gemm_triton(act, w2, sorted_ids, blocks, 1, tiles, topk_weights=weights)

        first, second = _best(gemm1, candidates), _best(gemm2, candidates)
        if first is None or second is None:
            continue
        total = first[0] + second[0]
        print(f"  T{num_tokens} BLOCK_M {block_m}: gemm1 {first[0] * 1e6:.1f} us {first[1]}, "
              f"gemm2 {second[0] * 1e6:.1f} us {second[1]}", flush=True)  # fmt: skip
        results.append((total, {"BLOCK_M": block_m, "gemm1": first[1], "gemm2": second[1]}))
    total, config = min(results, key=lambda r: r[0])
    whole = mk.bench(functools.partial(mk.fused_experts, config=config),
                     (x, w13, w2, weights, ids), iters=10, cuda_graph=True)  # fmt: skip
    return {
        "key": mk.shape_key(num_experts, hidden, inter, num_tokens * top_k),
        "config": config,
        "tokens": num_tokens,
        "top_k": top_k,
        "gemms_us": round(total * 1e6, 2),
        "fused_us": round(whole * 1e6, 2),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tuned_at": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="128,64")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,64,256,2048")
    p.add_argument("--out", default=str(mk.CONFIG_FILE), help="config file to update")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tuning needs a CUDA device", file=sys.stderr)
        return 2
    table = ConfigTable.load(mk.CONFIG_FILE)
    section = table.targets.setdefault("h100", TargetConfigs(True, []))
    section.tuned = True
    section.note = "tuned by kernels_generated/tune_moe_grouped_gemm.py (bf16, CUDA-graph replay)"
    for num_experts in (int(e) for e in args.experts.split(",")):
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            raw = tune_one(num_experts, args.hidden, args.inter, args.top_k, num_tokens)
            key, config = raw.pop("key"), raw.pop("config")
            section.entries = [e for e in section.entries if e.key != key]
            section.entries.append(ConfigEntry(key, config, raw))
            print(f"E{num_experts} T{num_tokens}: {config} fused {raw['fused_us']} us", flush=True)
            table.save(args.out)  # after every entry: a timeout keeps what was tuned
    return 0


if __name__ == "__main__":
    sys.exit(main())
