"""`bench int-gemm`: the integer weight-only GEMM's config sweep on CUDA, and its table.

    compile-engine bench int-gemm [--rows 1 4 16 64] [--weights int4 int8] [--budget-s 240]
                                  [--write-configs PATH]

y[M, N] = x[M, K] @ dequant(codes[N, K], scales[N, K / 128])^T for the Llama-3-8B decoder
linears (qkv, o_proj, gate_up, down), int4 (GPTQ's symmetric, zero point 8) and int8 codes in
groups of 128, bf16 activations: what `ce_kernels::int_linear` runs (kernels_generated/
int_linear.py) at every row count. Timed as `bench gemm` times (CUDA-graph replay,
round-robin over weight copies of >= 256 MB in all, so each call streams its weight from HBM),
against bf16 cuBLAS on the same shape. A config must match the reference (`int_linear_ref`, to
bf16 rounding) before it is timed.

--write-configs writes the h100 entries of kernels_generated/configs/int_gemm.json: per (N, K,
M) swept the fastest config; the entries of keys not swept stay. The int4 and int8 cells share
(N, K, M) keys, so only one weight kind's sweep is written: the first of --weights.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from compile_engine.benchmarks.gemm import SHAPES, graph_time_us, time_configs
from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result

ROWS = (1, 4, 16, 64)
ROTATION_BYTES = 256 << 20
GROUP = 128
DECODER = ("qkv", "o_proj", "gate_up", "down")
SCHEMES = {"int4": f"int4:group{GROUP}:none", "int8": f"int8:group{GROUP}:none"}


def candidates(rows: int, modes: tuple[str, ...] = ("fma", "dot")) -> list[dict]:
    """Launch configs worth timing at `rows` rows (a tile lies in one group: block_k at most
    the group), the modes interleaved so that a cell cut short by the budget has timed some of
    each; `modes` keeps those of these modes."""
    return [c for c in _candidates(rows) if c["mode"] in modes]


def _candidates(rows: int) -> list[dict]:
    from compile_engine.kernels_generated.int_linear import FMA_MAX_ROWS

    out = []
    if rows <= FMA_MAX_ROWS:  # the one-row form: a program a row, lanes over weight rows
        for bn in (32, 64, 128, 256):
            for bk in (32, 64, 128):
                for warps in (4, 8):
                    for pps in (2, 8):
                        out.append(dict(mode="fma", block_m=1, block_n=bn, block_k=bk,
                                        num_warps=warps, num_stages=1,
                                        programs_per_sm=pps))  # fmt: skip
    if rows <= 16:
        for bn in (32, 64, 128):
            for warps, stages in ((4, 4), (8, 4)):
                for pps in (0, 2, 4):
                    out.append(dict(mode="dot", block_m=16, block_n=bn, block_k=GROUP,
                                    num_warps=warps, num_stages=stages,
                                    programs_per_sm=pps))  # fmt: skip
        fma = [c for c in out if c["mode"] == "fma"]
        dot = [d for c in out if c["mode"] == "dot" for d in _dot_forms(c)]
        mixed = [c for pair in zip(fma, dot, strict=False) for c in pair]
        return mixed + fma[len(mixed) // 2 :] + dot[len(mixed) // 2 :]
    for bm, bn in ((16, 128), (32, 128), (64, 128), (64, 64)):
        for warps, stages in ((4, 3), (8, 3), (4, 4)):
            for pps in (0, 2):
                out.extend(_dot_forms(dict(mode="dot", block_m=bm, block_n=bn, block_k=GROUP,
                                           num_warps=warps, num_stages=stages,
                                           programs_per_sm=pps)))  # fmt: skip
    return out


def _dot_forms(config: dict) -> list[dict]:
    """A dot config four times: the 4-bit tiles' conversions or their mantissa form, each with
    the activations or the weights as the dot's left operand."""
    return [{**config, "dequant": d, "swap": w} for w in (False, True) for d in ("convert", "bits")]


def name_of(c: dict) -> str:
    bits = ("/bits" if c.get("dequant") == "bits" else "") + ("/swap" if c.get("swap") else "")
    return (
        f"{c['mode']}/{c['block_m']}x{c['block_n']}x{c['block_k']}/pps{c['programs_per_sm']}"
        f"/w{c['num_warps']}/p{c['num_stages']}{bits}"
    )


def _weights(kind: str, n_size: int, k_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from compile_engine.models.quant import pack_int4

    per_copy = n_size * k_size // (2 if kind == "int4" else 1)
    out = []
    for _ in range(max(2, math.ceil(ROTATION_BYTES / per_copy))):
        if kind == "int4":
            codes = torch.randint(0, 16, (n_size, k_size), device="cuda", dtype=torch.uint8)
            w = pack_int4(codes, "plain")
        else:
            w = torch.randint(-128, 128, (n_size, k_size), device="cuda", dtype=torch.int8)
        scale = torch.rand(n_size, k_size // GROUP, device="cuda") * 0.02 + 0.001
        out.append((w, scale))
    return out


def run_cell(kind, name, rows, weights, bf16_weights, deadline, modes) -> dict:
    from compile_engine.kernels_generated import tuning
    from compile_engine.kernels_generated.int_linear import IntLaunch, run_int_linear
    from compile_engine.models.quant import quant_linear_ref

    n_size, k_size = SHAPES[name]
    kernel_config, scheme = tuning.default(), SCHEMES[kind]
    x = torch.randn(rows, k_size, device="cuda", dtype=torch.bfloat16)
    want = quant_linear_ref(x, *weights[0], None, None, scheme).float()
    moved = n_size * k_size // (2 if kind == "int4" else 1) + 2 * rows * (k_size + n_size)
    cell: dict = {"weights": kind, "shape": name, "N": n_size, "K": k_size, "M": rows}
    v = cell["variants"] = {}
    v["bf16_cublas"] = {"us": graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in bf16_weights])}
    v["default"] = {
        "us": graph_time_us(
            [
                lambda w=w, s=s: run_int_linear(kernel_config, x, w, s, None, scheme)
                for w, s in weights
            ]  # fmt: skip
        )
    }

    def call_of(config: dict):
        launch = IntLaunch(**config)
        return lambda w, s: run_int_linear(kernel_config, x, w, s, None, scheme, launch)

    configs = candidates(rows, modes)
    best = time_configs(cell, configs, call_of, weights, want, moved, deadline, name_of)
    if best is not None:
        cell["speedup_vs_bf16_cublas"] = round(v["bf16_cublas"]["us"] / best["us"], 3)
    return cell


def sweep(kinds: list[str], rows: list[int], budget_s: float, modes=("fma", "dot")) -> list[dict]:
    cells = [(kind, name, m) for kind in kinds for name in DECODER for m in rows]
    start = time.monotonic()
    out, current = [], None
    for i, (kind, name, m) in enumerate(cells):
        if (kind, name) != current:
            weights = bf16 = None
            torch.cuda.empty_cache()
            weights = _weights(kind, *SHAPES[name])
            copies = max(2, math.ceil(ROTATION_BYTES / (2 * math.prod(SHAPES[name]))))
            bf16 = [torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16)
                    for _ in range(copies)]  # fmt: skip
            current = (kind, name)
        deadline = start + budget_s * (i + 1) / len(cells)
        t0 = time.monotonic()
        try:
            cell = run_cell(kind, name, m, weights, bf16, deadline, tuple(modes))
        except Exception as exc:  # keep the rest of the sweep
            out.append({"weights": kind, "shape": name, "M": m, "error": f"{exc}"[:500]})
            print(f"{kind} {name} M={m}: {type(exc).__name__}: {exc}", flush=True)
            continue
        cell["seconds"] = round(time.monotonic() - t0, 2)
        out.append(cell)
        v, best = cell["variants"], cell.get("best")
        print(
            f"{kind} {name:8s} M={m:4d}  bf16 cublas {v['bf16_cublas']['us']:7.2f}  default "
            f"{v['default']['us']:7.2f}  best {v[best]['us'] if best else float('nan'):7.2f} us"
            f"  {best}  ({cell['seconds']:.1f} s, {len(cell['failed'])} failed, "
            f"{cell['skipped_over_budget']} over budget)",
            flush=True,
        )
    return out


def write_configs(cells: list[dict], kind: str, path: str) -> None:
    from compile_engine.kernels_generated.configs import (
        ConfigEntry,
        ConfigTable,
        TargetConfigs,
        tuning_provenance,
    )

    table = ConfigTable.load(path)
    chosen = [c for c in cells if c.get("weights") == kind and "best" in c]
    if not chosen:
        raise SystemExit(f"no {kind} cell of the sweep timed a config; {path} left as it was")
    info = tuning_provenance(f"{kind} weights in groups of {GROUP}, bfloat16 activations")
    entries = []
    for cell in chosen:
        best = cell["variants"][cell["best"]]
        key = {"N": cell["N"], "K": cell["K"], "M": cell["M"]}
        cublas = round(cell["variants"]["bf16_cublas"]["us"], 2)
        entries.append(ConfigEntry(key, best["config"], {**info, "us": round(best["us"], 2),
                                                          "bf16_cublas_us": cublas}))  # fmt: skip
    section = table.targets.get("h100")
    swept = {tuple(sorted(e.key.items())) for e in entries}
    kept = [e for e in (section.entries if section else [])
            if tuple(sorted(e.key.items())) not in swept]  # fmt: skip
    table.targets["h100"] = TargetConfigs(True, kept + entries, section.note if section else "")
    table.save(path)
    print(f"wrote {len(entries)} h100 entries to {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench int-gemm", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--weights", nargs="+", choices=sorted(SCHEMES), default=["int4", "int8"])
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["fma", "dot"],
        default=["fma", "dot"],
        help="the kernel forms to time (a row count's others are left out)",
    )
    p.add_argument("--write-configs", default=None, help="the int_gemm.json to rewrite")
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench int-gemm needs a CUDA device")
    cells = sweep(args.weights, args.rows, args.budget_s, args.modes)
    if args.write_configs:
        write_configs(cells, args.weights[0], args.write_configs)
    payload = {"benchmark": "int_gemm", "rows": args.rows, "budget_s": args.budget_s,
               "modes": args.modes}  # fmt: skip
    write_result("int-gemm", {**payload, "cells": cells}, Path(args.results_dir))
    return 0
