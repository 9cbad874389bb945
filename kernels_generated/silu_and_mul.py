"""silu_and_mul in plain Triton: x [T, 2I] holding [gate | up] -> silu(gate) * up, [T, I].

Lowers `ce::silu_and_mul` (reference: `models.ops.silu_and_mul_ref`), the hand-written
counterpart of the Helion kernel in silu_and_mul_helion.py, so that `bench fusions` compares
Helion's generated tiling, a plain one and Inductor's fusion of the reference on one footing.
Bound by memory bandwidth: one read of 2I and one write of I elements per token.

Grid `(T, cdiv(I, BLOCK))`: a program reads BLOCK gate and BLOCK up elements of one token
(x's row stride, no copy of the halves) and writes BLOCK outputs. Rounding follows the
reference (HF's `F.silu(gate) * up` in the activation dtype): silu as ATen computes it,
`g / (1 + exp(-g))` in float32, rounded to the activation dtype, then the product in that
dtype. exp's last float32 bit may differ from ATen's, moving a result by one ulp at most.

Measured on the H200 (`compile-engine bench fusions`, I = 14336, bf16, CUDA-graph replay):
1.21 / 1.93 / 3.65 / 43.43 us at T = 1 / 64 / 256 / 2048; against Inductor's fusion of the
reference a tie at one token and at 2048, ahead at 64 and 256.

BLOCK and num_warps per target and shape class {I, T bucketed} live in configs/silu_and_mul.json
(nearest key); `tune()` measures them. On CPU the kernel runs only under the Triton interpreter
(`TRITON_INTERPRET=1`), in float32 or float16.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import (
    CONFIG_DIR,
    TARGET_OF_DEVICE,
    ConfigEntry,
    ConfigTable,
    TargetConfigs,
    bucket_tokens,
    tuning_provenance,
)
from compile_engine.kernels_generated.device import pdl_launch, pdl_on
from compile_engine.kernels_generated.timing import graph_us, kernel_main
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import silu_and_mul_fake, silu_and_mul_ref

CONFIG_FILE = CONFIG_DIR / "silu_and_mul.json"


class SiluAndMulKernelError(RuntimeError):
    """The Triton silu_and_mul kernel cannot run these inputs here; the message says why."""


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], unit last stride
    out_ptr,  # [T, I], unit last stride
    inter,
    stride_xt,
    stride_ot,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # a PDL dependent: waits for the kernel ahead, releases the next
    # after its loads (tuning.py)
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + token * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + inter + cols, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded as the reference
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, out.to(gate.dtype), mask=mask)


INTERPRETED = not isinstance(_silu_and_mul_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


def shape_key(num_tokens: int, inter: int) -> dict[str, int]:
    return {"I": inter, "T": bucket_tokens(num_tokens)}


@functools.cache
def config_for(tuning_key: str, target: str, tokens_bucket: int, inter: int) -> dict:
    """The launch config of a shape class in the kernel config's table (cached: looked up once
    per class, not per call)."""
    table = tuning.resolve(tuning_key).table("silu_and_mul")
    return table.lookup(target, {"I": inter, "T": tokens_bucket})


def silu_and_mul_triton(
    x: Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> Tensor:
    """Same contract as `models.ops.silu_and_mul`. The launch config comes from kernel_config's
    table, PDL from its settings (None: the defaults); block / num_warps override the config."""
    if x.device.type == "cpu" and not INTERPRETED:
        raise SiluAndMulKernelError(
            "the Triton silu_and_mul kernel runs on CPU tensors only under the interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported, or leave the pass off"
        )
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise SiluAndMulKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )
    if x.shape[-1] % 2:
        raise SiluAndMulKernelError(f"last dim {x.shape[-1]} is odd: want [..., 2I]")
    out = silu_and_mul_fake(x)
    flat = x.reshape(-1, x.shape[-1])  # [T, 2I], a view for the model's 2-D activations
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    num_tokens, inter = flat.shape[0], flat.shape[1] // 2
    if num_tokens == 0 or inter == 0:
        return out
    out_flat = out.view(num_tokens, inter)  # the fake's new_empty is contiguous
    kernel_config = kernel_config or tuning.default()
    target = TARGET_OF_DEVICE[x.device.type]
    config = config_for(kernel_config.key, target, bucket_tokens(num_tokens), inter)
    block = block or config["BLOCK"]
    pdl = pdl_on(kernel_config, x.device, num_tokens)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            flat,
            out_flat,
            inter,
            flat.stride(0),
            out_flat.stride(0),
            BLOCK=block,
            PDL=pdl,
            num_warps=num_warps or config["num_warps"],
            **pdl_launch(pdl),
        )
    return out


# The op the silu_and_mul_triton pass swaps in for ce::silu_and_mul: its schema and the kernel
# config's key (tuning.py).
@torch.library.custom_op("ce_kernels::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor, tuning_key: str) -> Tensor:
    """`ce::silu_and_mul` computed by the Triton kernel."""
    return silu_and_mul_triton(x, kernel_config=tuning.resolve(tuning_key))


@silu_and_mul.register_fake
def _silu_and_mul_kernel_fake(x: Tensor, tuning_key: str) -> Tensor:
    return silu_and_mul_fake(x)


# --------------------------------------------------------------------------- check, bench, tune

REAL_SHAPES = tuple((t, 14336) for t in (1, 64, 256, 2048))


def moved_bytes(num_tokens: int, inter: int, element_size: int) -> int:
    return 3 * num_tokens * inter * element_size  # read 2I, write I per token


def check(shapes: tuple[tuple[int, int], ...] | None = None, dtype=None) -> float:
    """Compare the op with the reference on this machine's device; return the largest absolute
    error. CPU: small float32 shapes under the interpreter; CUDA: Llama-3-8B's I in bf16."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    shapes = shapes or (((1, 8), (5, 40), (3, 600)) if device == "cpu" else REAL_SHAPES)
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for num_tokens, inter in shapes:
        x = torch.randn(num_tokens, 2 * inter, device=device, generator=gen).to(dtype)
        got, want = silu_and_mul(x, tuning.default().key), silu_and_mul_ref(x)
        torch.testing.assert_close(got, want)  # torch's per-dtype defaults: a few ulps
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


def bench(shapes: tuple[tuple[int, int], ...] = REAL_SHAPES) -> list[dict]:
    """Microseconds and GB/s of the op against the eager reference, bf16 on CUDA, from CUDA-graph
    replay. Inductor's fusion of the reference is timed by `bench fusions`."""
    if not torch.cuda.is_available() or INTERPRETED:
        raise SiluAndMulKernelError("bench() needs a CUDA device and compiled Triton")
    rows = []
    for num_tokens, inter in shapes:
        x = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
        moved = moved_bytes(num_tokens, inter, 2)
        row = {"T": num_tokens, "I": inter}
        for name, fn in (("triton", silu_and_mul_triton), ("reference", silu_and_mul_ref)):
            us = graph_us(lambda fn=fn, x=x: fn(x))
            row[f"{name}_us"], row[f"{name}_gbs"] = round(us, 2), round(moved / us / 1e3, 1)
        rows.append(row)
        print(
            f"T={num_tokens:5d} I={inter}  triton {row['triton_us']:7.2f} us "
            f"{row['triton_gbs']:7.1f} GB/s   reference {row['reference_us']:7.2f} us"
        )
    return rows


TUNE_CONFIGS = tuple(
    {"BLOCK": b, "num_warps": w} for b in (256, 512, 1024, 2048, 4096) for w in (2, 4, 8)
)


def tune(
    shapes: tuple[tuple[int, int], ...] = REAL_SHAPES, target: str = "h100", write: bool = True
) -> ConfigTable:
    """Time the op (bf16) with every config of TUNE_CONFIGS per shape class on this CUDA device
    and record the fastest, with provenance, under `target` in configs/silu_and_mul.json."""
    if not torch.cuda.is_available() or INTERPRETED:
        raise SiluAndMulKernelError("tune() needs a CUDA device and compiled Triton")
    table = ConfigTable.load(CONFIG_FILE)
    info = tuning_provenance()
    entries = []
    for num_tokens, inter in shapes:
        x = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
        times = []
        for c in TUNE_CONFIGS:
            run = functools.partial(
                silu_and_mul_triton, x, block=c["BLOCK"], num_warps=c["num_warps"]
            )
            times.append((graph_us(run), c))
        us, best = min(times, key=lambda t: t[0])
        worst = max(t[0] for t in times)
        entries.append(
            ConfigEntry(
                shape_key(num_tokens, inter),
                best,
                {**info, "us": round(us, 2), "worst_us": round(worst, 2)},
            )
        )
        print(f"T={num_tokens:5d} I={inter}: {best} {us:.2f} us (worst {worst:.2f})", flush=True)
    table.targets[target] = TargetConfigs(
        True, entries, note=f"tuned on {info['device']} by silu_and_mul.tune()"
    )
    if write:
        print(f"wrote {table.save()}")
    tuning.default.cache_clear()  # the next default config reads the new table
    config_for.cache_clear()
    return table


if __name__ == "__main__":
    sys.exit(kernel_main(__doc__.splitlines()[0], check, bench, tune))
