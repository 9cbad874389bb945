"""silu_and_mul in Helion: x [T, 2I] holding [gate | up] -> silu(gate) * up, [T, I].

Lowers `ce::silu_and_mul` (reference: `models.ops.silu_and_mul_ref`). The op is one read of
2I and one write of I elements per token, so it is bound by memory bandwidth; the kernel is a
2-D tiling over (tokens, I) that Helion's autotuner shapes per target and shape class.

Rounding follows the reference (HF's `F.silu(gate) * up` in the activation dtype): silu in
float32, rounded to the activation dtype, then the product in that dtype. A kernel that kept
the float32 silu for the product would be more accurate and differ from HF by one rounding.

The gate and up halves are passed as two strided views of x (`x.chunk(2, -1)`), never copied:
the kernel reads them with x's row stride.

Running it:
- `torch.ops.ce_kernels.silu_and_mul_helion(x)` is an opaque custom op (with a fake for
  tracing), which is what lets Inductor and CUDA graphs treat the Helion launch as one call.
  It picks the config for (target, I, bucketed T) from configs/silu_and_mul_helion.json by
  nearest key; the token dimension is dynamic (`static_shapes=False`), so one compile per
  config serves every token count of its 0/1/many class.
- On CPU there is no compiled Helion backend: with `HELION_INTERPRET=1` (read when this module
  is imported) the kernel body runs eagerly in PyTorch, which is how CI checks it. The Triton
  source for any config is available without a GPU: `emit_triton(config)`.

`compile-engine bench kernel silu_and_mul_helion` checks the op against the reference and, on
a GPU, times both; `--tune` runs Helion's autotuner per shape class and writes the table
(benchmarks/kernel_harness.py).
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import TARGET_OF_DEVICE, bucket_tokens
from compile_engine.kernels_generated.tuning import KernelConfig

# The only GPU target: a CUDA device is taken to be an H100/H200 (sm_90).


class KernelUnavailableError(RuntimeError):
    """The Helion kernel cannot run on this device; the message says what to do instead."""


@helion.kernel(static_shapes=False)
def silu_and_mul_kernel(gate: Tensor, up: Tensor) -> Tensor:
    # Names inside a Helion kernel must not shadow this module's globals: Helion reads a
    # global of the same name as a host variable the device loop may not assign.
    num_tokens, inter = gate.size()
    result = torch.empty([num_tokens, inter], dtype=gate.dtype, device=gate.device)
    for tile_t, tile_i in hl.tile([num_tokens, inter]):
        activated = torch.nn.functional.silu(gate[tile_t, tile_i].to(torch.float32))
        result[tile_t, tile_i] = activated.to(up.dtype) * up[tile_t, tile_i]
    return result


def interpreted() -> bool:
    """True when HELION_INTERPRET=1 was set at import: the kernel body runs as PyTorch."""
    return silu_and_mul_kernel.settings.ref_mode != helion.RefMode.OFF


def shape_key(num_tokens: int, inter: int) -> dict[str, int]:
    return {"I": inter, "T": bucket_tokens(num_tokens)}


@functools.cache
def config_for(tuning_key: str, target: str, num_tokens_bucket: int, inter: int) -> helion.Config:
    """The config for a shape class in the kernel config's table (cached: the lookup runs once
    per class, not per call)."""
    table = tuning.resolve(tuning_key).table("silu_and_mul_helion")
    return helion.Config(**table.lookup(target, {"I": inter, "T": num_tokens_bucket}))


def silu_and_mul_helion_impl(
    gate: Tensor, up: Tensor, kernel_config: KernelConfig | None = None
) -> Tensor:
    """Launch the kernel on gate, up [T, I] with the tiling of kernel_config's table (None:
    the defaults)."""
    if interpreted():
        return silu_and_mul_kernel(gate, up)
    if gate.device.type != "cuda":
        raise KernelUnavailableError(
            "the Helion silu_and_mul kernel runs compiled only on CUDA; on CPU set "
            "HELION_INTERPRET=1 before importing it, or leave the silu_and_mul_helion pass off"
        )
    num_tokens, inter = gate.shape
    if num_tokens == 0:
        return gate.new_empty((0, inter))
    key = (kernel_config or tuning.default()).key
    config = config_for(key, TARGET_OF_DEVICE[gate.device.type], bucket_tokens(num_tokens), inter)
    bound = silu_and_mul_kernel.bind((gate, up))
    return bound.compile_config(config, allow_print=False)(gate, up)


@torch.library.custom_op("ce_kernels::silu_and_mul_helion", mutates_args=())
def silu_and_mul_helion(x: Tensor, tuning_key: str) -> Tensor:
    """x [..., 2I] holding [gate | up] -> silu(gate) * up, [..., I]; tiles from the kernel
    config whose key the pass gave (tuning.py)."""
    flat = x.reshape(-1, x.shape[-1])  # [T, 2I], a view for the model's 2-D activations
    gate, up = flat.chunk(2, dim=-1)  # [T, I] each, strided views of x
    out = silu_and_mul_helion_impl(gate, up, tuning.resolve(tuning_key))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


@silu_and_mul_helion.register_fake
def _(x: Tensor, tuning_key: str) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def emit_triton(
    config: dict | helion.Config | None = None,
    num_tokens: int = 4,
    inter: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The Triton source Helion generates for `config` (default: the file's default), on
    example tensors of any device: no GPU needed. Not available under HELION_INTERPRET=1."""
    if interpreted():
        raise KernelUnavailableError("no Triton source under HELION_INTERPRET=1 (eager mode)")
    x = torch.empty(num_tokens, 2 * inter, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    config = config if config is not None else tuning.default().table("silu_and_mul_helion").default
    if not isinstance(config, helion.Config):
        config = helion.Config(**config)
    return silu_and_mul_kernel.bind((gate, up)).to_triton_code(config)
