"""Does a TMA weight stream beat the skinny GEMM's pointer loads at one row (batch-1 decode)?

The skinny GEMM (kernels_generated/skinny_gemm.py) streams each weight with `tl.load` over a
pointer tile; the lm_head's cuBLAS kernel (nvjet, TMA) reads 4.43 TB/s where the layers' launches
read 3.1-4.2 (docs/compiler.md section 6). This probe times a minimal GEMV whose weight tiles
come through a host tensor descriptor (`w_desc.load`, TMA on Hopper) against the tuned table's
launch (`skinny_gemm.linear`) and cuBLAS, at M = 1 for the four Llama-3-8B layer weights, with
`bench gemm`'s timing (CUDA-graph replay over weight copies that stream from HBM). PDL is off
for every variant (COMPILE_ENGINE_PDL=0 is set here): this compares raw streaming.

    python3 scripts/device/tma_gemv_probe.py
"""

from __future__ import annotations

import os

os.environ["COMPILE_ENGINE_PDL"] = "0"

import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from compile_engine.benchmarks.gemm import SHAPES, _weights, graph_time_us  # noqa: E402
from compile_engine.kernels_generated import skinny_gemm  # noqa: E402


@triton.jit
def _tma_gemv(
    x_ptr, w_desc, out_ptr, M, N, k_tiles, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_tiles * BLOCK_K
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, k_tiles * BLOCK_K, BLOCK_K):
        w = w_desc.load([n0, k_start + k])
        x = tl.load(x_ptrs, mask=(offs_m < M)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        x_ptrs += BLOCK_K
    o = out_ptr + offs_n[:, None] + offs_m[None, :] * N
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if not ATOMIC:
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(o, acc, mask=mask, sem="relaxed")


def tma_call(x, w, out, cfg):
    """One launch; split > 1 adds its partials into a float32 `out` (zeroed by the caller: the
    timed calls accumulate garbage, which costs what a zeroed output does)."""
    bn, bk, split, warps, stages = cfg
    n, k = w.shape
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    k_tiles = k // bk // split
    grid = (triton.cdiv(n, bn), split)

    def call():
        _tma_gemv[grid](
            x, desc, out, x.shape[0], n, k_tiles, x.stride(0),
            BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, ATOMIC=split > 1, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip

    return call


def configs(name: str):
    splits = (1,) if name == "gate_up" else (1, 2, 4)
    for bn, bk, split, warps, stages in itertools.product(
        (32, 64, 128), (128, 256), splits, (4,), (4, 6)
    ):
        if bn * bk * 2 * stages > 200_000:
            continue
        yield bn, bk, split, warps, stages


def main() -> int:
    rows = []
    for name in sys.argv[1:] or ("qkv", "o_proj", "gate_up", "down"):
        n, k = SHAPES[name]
        ws, _ = _weights(n, k)
        x = (torch.randn(1, k, device="cuda") * 0.5).to(torch.bfloat16)
        want = torch.nn.functional.linear(x, ws[0]).float()
        mb = 2 * n * k / 1e6
        table = graph_time_us([lambda w=w, x=x: skinny_gemm.linear(x, w) for w in ws])
        cublas = graph_time_us([lambda w=w, x=x: torch.mm(x, w.t()) for w in ws])
        best = None
        for cfg in configs(name):
            dtype = torch.bfloat16 if cfg[2] == 1 else torch.float32
            outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in ws]
            try:
                calls = [tma_call(x, w, o, cfg) for w, o in zip(ws, outs, strict=True)]
                outs[0].zero_()
                calls[0]()
                torch.cuda.synchronize()
                err = (outs[0].float() - want).abs().max().item() / want.abs().max().item()
                if err > 2e-2:
                    print(f"{name} {cfg}: wrong, relative error {err:.3g}")
                    continue
                us = graph_time_us(calls)
            except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append({"shape": name, "config": cfg, "us": us})
            if best is None or us < best[1]:
                best = (cfg, us)
        print(
            f"{name:8} {mb:6.1f} MB  table {table:6.2f} us ({mb / table:.2f} TB/s)  cublas "
            f"{cublas:6.2f}  tma best {best[1]:6.2f} us ({mb / best[1]:.2f} TB/s) {best[0]}",
            flush=True,
        )
        rows.append({"shape": name, "table_us": table, "cublas_us": cublas, "best": best})
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tma_gemv_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
