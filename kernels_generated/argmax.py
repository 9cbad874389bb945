"""Greedy sampling's argmax over the vocabulary in Triton: two short launches, not one slow one.

Reference: `torch.argmax(logits, dim=-1)` (what the sampler runs on CPU). logits [S, V] in any
float dtype -> int64 [S], the first index of each row's maximum.

Why a kernel: at decode a step samples few rows of a long vocabulary (128,256 for Llama-3).
PyTorch's reduction gives a row to one thread block, so batch 1 reads 256 KB with one SM:
36 us a step on the H200 (0.8% of a batch-1 step), and 53 us at batch 256 (65 MB, 1.2 TB/s).
Here stage 1 splits each row into CHUNK-wide pieces, one program each (grid `(S, chunks)`),
and writes each piece's maximum and the global index of its first occurrence; stage 2 (grid
`(S,)`) takes the first piece holding the row's maximum. Both keep "first index wins" ties:
tl.argmax breaks ties to the left, and pieces are in index order.

NaN: torch.argmax treats NaN as larger than every number. The kernel maps NaN to +inf, so a
row with a NaN returns the first NaN-or-+inf position: the same as torch unless the row holds
a +inf before its first NaN (then torch returns the NaN's index, the kernel the +inf's).

On CPU the kernel runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported). `compile-engine bench kernel argmax` checks it against the
reference and, on CUDA, times both (benchmarks/kernel_harness.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

CHUNK = 2048  # 4 KB of bf16 a program: 63 programs a row for Llama-3's vocabulary
_MAX_CHUNKS = 1024  # stage 2 reads a row's partials in one block
MAX_VOCAB = _MAX_CHUNKS * CHUNK  # the longest row the kernel takes; the sampler checks it


class ArgmaxKernelError(RuntimeError):
    """The Triton argmax cannot run these inputs; the message says why."""


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    part_val_ptr,  # [S, NUM_CHUNKS] float32
    part_idx_ptr,  # [S, NUM_CHUNKS] int32
    vocab,
    stride_row,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest, as in torch.argmax
    best = tl.argmax(x, axis=0, tie_break_left=True)
    value = tl.max(x, axis=0)
    tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, value)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, (chunk * CHUNK + best).to(tl.int32))


@triton.jit
def _rows_argmax_kernel(
    part_val_ptr,
    part_idx_ptr,
    out_ptr,  # [S] int64
    NUM_CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NUM_CHUNKS
    vals = tl.load(part_val_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    best = tl.argmax(vals, axis=0, tie_break_left=True)  # the first piece holding the max
    idx = tl.load(part_idx_ptr + row * NUM_CHUNKS + best)
    tl.store(out_ptr + row, idx.to(tl.int64))


INTERPRETED = not isinstance(_chunk_argmax_kernel, JITFunction)


def argmax_triton(logits: Tensor) -> Tensor:
    """logits [S, V] (rows may be strided, the vocabulary contiguous) -> int64 [S]."""
    if logits.dim() != 2:
        raise ArgmaxKernelError(f"logits must be [S, V], got shape {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ArgmaxKernelError("the vocabulary dimension must be contiguous (stride 1)")
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    if vocab == 0 or vocab > MAX_VOCAB:
        raise ArgmaxKernelError(
            f"vocabulary of {vocab} is outside 1..{MAX_VOCAB}; use torch.argmax"
        )
    if logits.device.type == "cpu" and not INTERPRETED:
        raise ArgmaxKernelError("on CPU the kernel needs TRITON_INTERPRET=1; use torch.argmax")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, part_val, part_idx, vocab, logits.stride(0),
        NUM_CHUNKS=num_chunks, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip
    block_c = max(triton.next_power_of_2(num_chunks), 2)
    _rows_argmax_kernel[(rows,)](part_val, part_idx, out, NUM_CHUNKS=num_chunks, BLOCK_C=block_c)
    return out
