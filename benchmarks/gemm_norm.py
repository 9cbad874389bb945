"""The fused add_rms_norm + skinny GEMM (kernels_generated/skinny_gemm.add_rms_norm_gemm) on
CUDA against the unfused chain it replaces, over a sweep of its launch configs.

    compile-engine bench gemm-norm [--rows 1 2 4 8 16] [--write-configs PATH]

For the Llama-3-8B weights a norm feeds, qkv [6144, 4096] and gate_up [28672, 4096] (gated:
silu_and_mul fused too, as the add_rms_norm_into_gemm pass fuses it), at 1..16 rows: the
unfused chain as the engine runs it without the fusion (our Triton norm kernel, `tuned_linear`
with the choice of the table the records go to, and silu_and_mul for gate_up) against each
fused config, every variant replayed from one CUDA graph round-robin over weight copies that
stream from HBM (as `bench gemm` times). A fused config must match the reference (to bf16
rounding) before it is timed. The fused launch holds more registers and shared memory a program
than the plain GEMM (x, the residual and the norm weight beside the weight tile), so its config
is swept apart from the GEMM's.

--write-configs adds to each (N, K, M) entry of kernels_generated/configs/skinny_gemm.json's h100
section a `fused` record ({"plain" | "gated": {"config", "fused_us", "unfused_us", ...}}) where the
best fused config beats the unfused chain by at least --min-speedup, and removes the record
where it does not: `skinny_gemm.fused_config` fuses only where a record exists. The unfused
chain's GEMM is that table's choice (a KernelConfig naming it), else the shipped table's.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from compile_engine.benchmarks.gemm import (
    SHAPES,
    TIMING,
    _close,
    _weights,
    graph_time_us,
    save_sweep,
)
from compile_engine.benchmarks.results import DEFAULT_DIRECTORY
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig

FUSED = {"qkv": False, "gate_up": True}  # shape: gated
ROWS = (1, 2, 4, 8, 16)
EPS = 1e-5


def candidates(gated: bool) -> list[dict]:
    """Swapped-dot launches (a 16-row tile of x): block_n of the weight rows a program owns
    (gated: of the gate rows, as many up rows beside them), no split-K. Plain launches also
    share the rows out evenly among 1 or 2 programs an SM (ragged, block_n grown to a share):
    whole 64-row tiles make qkv's 6,144 rows 96 programs, and 36 of the H200's 132 SMs idle.
    Whole tiles of 64 rows and more also with the weight's tiles through TMA (`tma`), where
    the pipeline's weight buffers fit shared memory."""
    out = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4)):
        if bn == 32 and (warps, stages) != (4, 4):
            continue
        out.append(_config(bn, bk, warps, stages))
        if bn > 32 and bn * bk * stages * (4 if gated else 2) <= 196_608:
            # The same whole tiles with the weight through TMA (twice the tile gated).
            out.append(_config(bn, bk, warps, stages, tma=True))
    if not gated:
        for per_sm, bk, stages in itertools.product((1, 2), (128, 256), (3, 4)):
            out.append(_config(16, bk, 4, stages, programs_per_sm=per_sm))
    return out


def _config(bn: int, bk: int, warps: int, stages: int, **extra) -> dict:
    return dict(
        mode="swap",
        block_m=16,
        block_n=bn,
        block_k=bk,
        split_k=1,
        num_warps=warps,
        num_stages=stages,
        **extra,
    )


def label(c: dict) -> str:
    ragged = f"/r{c['programs_per_sm']}" if c.get("programs_per_sm") else ""
    tma = "/tma" if c.get("tma") else ""
    return f"{c['block_n']}x{c['block_k']}/w{c['num_warps']}/p{c['num_stages']}{ragged}{tma}"


def run_cell(
    name: str, rows: int, weights: list[torch.Tensor], kernel_config: KernelConfig
) -> dict:
    from compile_engine.kernels_generated import skinny_gemm as sg
    from compile_engine.kernels_generated.add_rms_norm import rms_norm_triton
    from compile_engine.kernels_generated.silu_and_mul import silu_and_mul_triton

    gated = FUSED[name]
    n_size, k_size = SHAPES[name]
    x = torch.randn(rows, k_size, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(k_size, device="cuda", dtype=torch.bfloat16) + 0.5

    def unfused(w):
        normed, _ = rms_norm_triton(x, norm_weight, EPS, residual, kernel_config=kernel_config)
        y = sg.tuned_linear(kernel_config, normed, w)
        return silu_and_mul_triton(y, kernel_config=kernel_config) if gated else y

    want = sg.add_rms_norm_linear_ref(x, residual, norm_weight, EPS, weights[0], gated)[0]
    cell: dict = {"shape": name, "N": n_size, "K": k_size, "M": rows, "gated": gated}
    cell["gemm"] = sg.choose(kernel_config, x, weights[0])[0]
    cell["unfused_us"] = round(graph_time_us([lambda w=w: unfused(w) for w in weights]), 2)
    variants, failed = {}, []
    for config in candidates(gated):
        name_ = label(config)

        def fused(w, c=config):
            return sg.add_rms_norm_gemm(
                x, residual, norm_weight, EPS, w, gated=gated, kernel_config=kernel_config, **c
            )[0]

        try:
            err = _close(fused(weights[0]), want)
            if err > 2e-2:
                failed.append({"variant": name_, "rel_err": err})
                continue
            us = graph_time_us([lambda w=w: fused(w) for w in weights])
        except Exception as exc:  # a config that does not compile or launch is data too
            failed.append({"variant": name_, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        variants[name_] = {"us": round(us, 2), "config": config, "rel_err": round(err, 5)}
    cell["variants"], cell["failed"] = variants, failed
    if variants:
        best = min(variants, key=lambda k: variants[k]["us"])
        cell["best"] = best
        cell["speedup_vs_unfused"] = round(cell["unfused_us"] / variants[best]["us"], 3)
    return cell


def sweep(shapes: list[str], rows: list[int], kernel_config: KernelConfig) -> list[dict]:
    cells = []
    for name in shapes:
        torch.cuda.empty_cache()
        weights = _weights(*SHAPES[name])[0]
        for m in rows:
            t0 = time.monotonic()
            cell = run_cell(name, m, weights, kernel_config)
            cell["seconds"] = round(time.monotonic() - t0, 1)
            cells.append(cell)
            best = cell.get("best", "-")
            fused_us = cell["variants"][best]["us"] if best in cell["variants"] else float("nan")
            print(
                f"{name:8s} M={m:3d}  unfused {cell['unfused_us']:7.2f} us ({cell['gemm']})"
                f"  fused best {best:16s} {fused_us:7.2f} us"
                f"  x{cell.get('speedup_vs_unfused', float('nan')):.3f}"
                f"  ({cell['seconds']} s, {len(cell['failed'])} failed)",
                flush=True,
            )
        del weights
    return cells


def write_configs(cells: list[dict], path: str, min_speedup: float, info: dict) -> None:
    """Each swept cell's `fused` record in the h100 entry of the same (N, K, M)."""
    from compile_engine.kernels_generated.configs import ConfigTable

    table = ConfigTable.load(path)
    entries = {tuple(e.key[k] for k in ("N", "K", "M")): e for e in table.targets["h100"].entries}
    for c in cells:
        entry = entries.get((c["N"], c["K"], c["M"]))
        if entry is None:
            print(f"no h100 entry for N={c['N']} K={c['K']} M={c['M']}: run `bench gemm` first")
            continue
        kind = "gated" if c["gated"] else "plain"
        fused = dict(entry.info.get("fused", {}))
        fused.pop(kind, None)
        if c.get("speedup_vs_unfused", 0.0) >= min_speedup:
            best = c["variants"][c["best"]]
            fused[kind] = {
                "config": best["config"],
                "fused_us": best["us"],
                "unfused_us": c["unfused_us"],
                **info,
            }
        if fused:
            entry.info["fused"] = fused
        else:
            entry.info.pop("fused", None)
    print(f"wrote {table.save(path)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    p.add_argument("--shapes", nargs="+", default=list(FUSED), choices=list(FUSED))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--write-configs", metavar="PATH", help="add the fused records to this table")
    p.add_argument("--min-speedup", type=float, default=1.03)
    args = p.parse_args(argv)
    from compile_engine.kernels_generated.skinny_gemm import NORM_MAX_ROWS

    if max(args.rows) > NORM_MAX_ROWS:
        raise SystemExit(f"--rows: the fused norm takes at most {NORM_MAX_ROWS} rows")
    if not torch.cuda.is_available():
        raise SystemExit("compile_engine.benchmarks.gemm_norm needs a CUDA device")
    torch.manual_seed(0)
    kernel_config = (
        KernelConfig(tables={"skinny_gemm": args.write_configs})
        if args.write_configs
        else tuning.default()
    )
    cells = sweep(args.shapes, args.rows, kernel_config)
    payload = {
        "dtype": "bfloat16",
        "timing": TIMING,
        "kernel_config": kernel_config.describe(),  # the unfused GEMM's table among them
        "cells": cells,
    }
    return save_sweep("gemm-norm", payload, args, write_configs)


if __name__ == "__main__":
    raise SystemExit(main())
