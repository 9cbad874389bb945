"""`bench fp8-gemm`: the FP8 skinny GEMM's config sweep on CUDA, and its table.

    compile-engine bench fp8-gemm [--rows 1 2 4 8 16] [--budget-s 150] [--write-configs PATH]

y[M, N] = (xq[M, K] * sx[M]) @ (q[N, K] * s[N])^T for the Llama-3-8B decoder linears (qkv,
o_proj, gate_up, down) with e4m3 weights and per-channel scales, the activation quantized per
token (as the graph hands it over), at M = 1..16 rows: what `ce_kernels::fp8_linear` runs there
(kernels_generated/fp8_linear.py). Timed as `bench
gemm` times (CUDA-graph replay, round-robin over weight copies of >= 256 MB in all, so each
call streams its weight from HBM), against bf16 cuBLAS and the bf16 engine's tuned choice on
the same shape; and above 16 rows `torch._scaled_mm` (row-wise and tensor-wise) with the
activation's quantization, against bf16 cuBLAS. A config must match the reference
(`fp8_linear_ref`, to bf16 rounding) before it is timed.

--write-configs writes the h100 entries of kernels_generated/configs/fp8_gemm.json: per (N, K,
M) the fastest config (no 5% rule: there is no other kernel to fall back on at these rows).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from compile_engine.benchmarks.gemm import SHAPES, graph_time_us, time_configs
from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result

ROWS = (1, 4, 16)  # the buckets between take the nearest entry
LARGE_ROWS = (64, 256)
ROTATION_BYTES = 256 << 20
SMS = 132
DECODER = ("qkv", "o_proj", "gate_up", "down")


def candidates(n_size: int, k_size: int, rows: int) -> list[dict]:
    """Launch configs worth timing at `rows` rows: one-byte weights want twice the bf16
    tiles' K (the same bytes in flight a tile), so block_k 256-512; splits that leave each
    program at least two K-tiles and the grid under eight programs an SM."""
    tiles = []
    # TMA tiles first: they won o_proj, gate_up and down in the W8A16 sweep at a366a76, and a
    # cell cut short by the budget has then timed the likeliest winners.
    for bn, bk, warps, stages, tma in (
        (64, 256, 4, 4, True),
        (64, 512, 4, 4, True),
        (128, 256, 4, 4, True),
        (32, 512, 4, 4, True),
        (128, 512, 4, 3, True),
        (64, 256, 4, 4, False),
        (64, 512, 4, 4, False),
        (32, 512, 4, 4, False),
        (128, 256, 4, 4, False),
        (64, 256, 4, 6, False),
        (32, 256, 4, 4, False),
    ):
        tiles.append(dict(mode="swap", block_m=16, block_n=bn, block_k=bk, num_warps=warps,
                          num_stages=stages, tma=tma))  # fmt: skip
    if rows <= 4:
        tiles.append(dict(mode="fma", block_m=max(1, 1 << (rows - 1).bit_length()), block_n=16,
                          block_k=512, num_warps=4, num_stages=4, tma=False))  # fmt: skip
    out = []
    for tile in tiles:
        programs = math.ceil(n_size / tile["block_n"]) * math.ceil(rows / tile["block_m"])
        for split in (1, 2, 4):
            if split > 1 and (k_size // split < 2 * tile["block_k"] or programs * split > 8 * SMS):
                continue
            out.append({**tile, "split_k": split})

    # Grids near 2.5 programs an SM first (the W8A16 sweep's winners: qkv 192 programs, o_proj
    # and down 256, gate_up 448), TMA first among equals.
    def order(c: dict) -> tuple[float, bool]:
        grid = math.ceil(n_size / c["block_n"]) * math.ceil(rows / c["block_m"]) * c["split_k"]
        return round(abs(math.log2(grid / (2.5 * SMS))) * 2) / 2, not c["tma"]

    return sorted(out, key=order)


def name_of(c: dict) -> str:
    tma = "/tma" if c.get("tma") else ""
    return (
        f"{c['mode']}/{c['block_m']}x{c['block_n']}x{c['block_k']}/s{c['split_k']}"
        f"/w{c['num_warps']}/p{c['num_stages']}{tma}"
    )


def _weights(n_size: int, k_size: int):
    from compile_engine.models.quant import quantize_checkpoint_tensor

    copies = max(2, math.ceil(ROTATION_BYTES / (n_size * k_size)))
    out = []
    for _ in range(copies):
        w = torch.randn(n_size, k_size, device="cuda", dtype=torch.bfloat16) * k_size**-0.5
        parts = quantize_checkpoint_tensor("model.layers.0.mlp.x_proj.weight", w, "ct-channel")
        out.append((parts["model.layers.0.mlp.x_proj.weight"],
                    parts["model.layers.0.mlp.x_proj.weight_scale"].reshape(-1)))  # fmt: skip
    return out


def run_cell(name: str, rows: int, weights, bf16_weights, deadline: float) -> dict:
    from compile_engine.kernels_generated import tuning
    from compile_engine.kernels_generated.fp8_linear import fp8_linear_ref, run_fp8_linear
    from compile_engine.kernels_generated.skinny_gemm import (
        Fp8Operands,
        LaunchConfig,
        _launch,
        tuned_linear,
    )
    from compile_engine.models.quant import quantize_fp8_ref

    n_size, k_size = SHAPES[name]
    kernel_config = tuning.default()
    x = torch.randn(rows, k_size, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_fp8_ref(x)
    scheme, bf16 = "fp8_e4m3:channel:token", torch.bfloat16
    want = fp8_linear_ref(x_q, x_s, weights[0][0], weights[0][1], None, scheme, bf16)
    fp8_bytes = n_size * k_size + 2 * rows * (k_size + n_size)
    cell: dict = {"shape": name, "N": n_size, "K": k_size, "M": rows, "variants": {}}
    v = cell["variants"]
    v["bf16_cublas"] = {"us": graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in bf16_weights])}
    v["bf16_engine"] = {
        "us": graph_time_us([lambda w=w: tuned_linear(kernel_config, x, w) for w in bf16_weights])
    }
    if rows > 16:
        v["fp8_linear"] = {
            "us": graph_time_us(
                [
                    lambda q=q, s=s: run_fp8_linear(
                        kernel_config, x_q, x_s, q, s, None, scheme, bf16
                    )
                    for q, s in weights
                ]
            )
        }
        return cell

    def call_of(config: dict):
        launch = LaunchConfig(**config)

        def call(q, s):
            operands = Fp8Operands(s, "channel", bf16, x_s.reshape(-1))
            return _launch(x_q, q, None, launch, kernel_config, fp8=operands)[0]

        return call

    configs = candidates(n_size, k_size, rows)
    best = time_configs(cell, configs, call_of, weights, want, fp8_bytes, deadline, name_of)
    if best is not None:
        cell["speedup_vs_bf16_engine"] = round(v["bf16_engine"]["us"] / best["us"], 3)
    return cell


def sweep(rows: list[int], budget_s: float) -> list[dict]:
    cells = [(name, m) for name in DECODER for m in rows]
    start = time.monotonic()
    out = []
    current = None
    for i, (name, m) in enumerate(cells):
        if name != current:
            weights = bf16 = None
            torch.cuda.empty_cache()
            weights = _weights(*SHAPES[name])
            copies = max(2, math.ceil(ROTATION_BYTES / (2 * math.prod(SHAPES[name]))))
            bf16 = [torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16)
                    for _ in range(copies)]  # fmt: skip
            current = name
        deadline = start + budget_s * (i + 1) / len(cells)
        t0 = time.monotonic()
        try:
            cell = run_cell(name, m, weights, bf16, deadline)
        except Exception as exc:  # keep the rest of the sweep
            out.append({"shape": name, "M": m, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"{name} M={m}: {type(exc).__name__}: {exc}", flush=True)
            continue
        cell["seconds"] = round(time.monotonic() - t0, 2)
        out.append(cell)
        v = cell["variants"]
        best = cell.get("best")
        fp8_us = v[best]["us"] if best else v.get("fp8_linear", {}).get("us", float("nan"))
        print(
            f"{name:8s} M={m:4d}  bf16 cublas {v['bf16_cublas']['us']:7.2f}  engine "
            f"{v['bf16_engine']['us']:7.2f}  fp8 {fp8_us:7.2f} us  {best or 'fp8_linear'}"
            f"  ({cell['seconds']:.1f} s, {len(cell.get('failed', []))} failed)",
            flush=True,
        )
    return out


def write_configs(cells: list[dict], path: str) -> None:
    from compile_engine.kernels_generated.configs import (
        ConfigEntry,
        ConfigTable,
        TargetConfigs,
        tuning_provenance,
    )

    table = ConfigTable.load(path)
    if not any("best" in cell for cell in cells):
        raise SystemExit(f"no cell of the sweep timed a config; {path} left as it was")
    info = tuning_provenance("float8_e4m3fn weights and activations, bfloat16 output")
    entries = []
    for cell in cells:
        if "best" not in cell:
            continue
        best = cell["variants"][cell["best"]]
        key = {"N": cell["N"], "K": cell["K"], "M": cell["M"]}
        bf16_us = round(cell["variants"]["bf16_engine"]["us"], 2)
        measured = {**info, "us": round(best["us"], 2), "bf16_engine_us": bf16_us}
        entries.append(ConfigEntry(key, best["config"], measured))
    note = table.targets.get("h100").note if "h100" in table.targets else ""
    table.targets["h100"] = TargetConfigs(True, entries, note)
    table.save(path)
    print(f"wrote {len(entries)} h100 entries to {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench fp8-gemm", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[*ROWS, *LARGE_ROWS])
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--write-configs", default=None, help="the fp8_gemm.json to rewrite")
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench fp8-gemm needs a CUDA device")
    cells = sweep(args.rows, args.budget_s)
    if args.write_configs:
        write_configs(cells, args.write_configs)
    payload = {"benchmark": "fp8_gemm", "rows": args.rows, "budget_s": args.budget_s}
    write_result("fp8-gemm", {**payload, "cells": cells}, Path(args.results_dir))
    return 0
