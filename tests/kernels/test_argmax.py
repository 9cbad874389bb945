"""The Triton greedy argmax against torch.argmax: the same index, ties to the first.

CPU cases run in the TRITON_INTERPRET=1 child of test_triton_fusions_interpreted.py; the GPU
cases check bf16 rows of Llama-3's vocabulary and a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import spec_of
from compile_engine.kernels_generated import argmax as k

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)


def _rows(rows: int, vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    return torch.randn(rows, vocab, generator=g).to(dtype).to(device)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,vocab", [(1, 37), (3, k.CHUNK * 2 + 5), (2, k.CHUNK)])
def test_interpreted_matches_torch(rows, vocab, dtype):
    logits = _rows(rows, vocab, dtype)
    assert torch.equal(k.argmax_triton(logits), logits.argmax(dim=-1))


@interpreted
def test_interpreted_ties_take_the_first_index_across_and_within_pieces():
    logits = torch.zeros(3, k.CHUNK * 2 + 9)
    logits[0, [k.CHUNK + 4, 11, k.CHUNK * 2 + 1]] = 5.0  # across pieces: 11 wins
    logits[1, [20, 21]] = 3.0  # within a piece: 20 wins
    # row 2: all equal, index 0
    assert k.argmax_triton(logits).tolist() == [11, 20, 0]
    assert logits.argmax(dim=-1).tolist() == [11, 20, 0]


@interpreted
def test_interpreted_check_through_the_harness():
    assert check(spec_of("argmax")) == 0  # a tie planted across pieces: the first index wins


@interpreted
def test_interpreted_strided_rows_and_nan():
    base = _rows(4, 3 * 100, torch.float32)
    view = base[:, :100]  # rows strided by 300, vocabulary contiguous
    assert torch.equal(k.argmax_triton(view), view.argmax(dim=-1))
    nan_row = torch.zeros(1, 50)
    nan_row[0, 30] = float("nan")
    assert k.argmax_triton(nan_row).tolist() == nan_row.argmax(dim=-1).tolist() == [30]


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(k.ArgmaxKernelError, match=r"\[S, V\]"):
        k.argmax_triton(torch.zeros(4))
    with pytest.raises(k.ArgmaxKernelError, match="contiguous"):
        k.argmax_triton(torch.zeros(8, 4).t())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_bf16_llama3_vocabulary(rows):
    logits = _rows(rows, 128256, torch.bfloat16, "cuda")
    logits[0, [5, 128000]] = 50.0  # a planted tie far apart
    assert torch.equal(k.argmax_triton(logits), logits.argmax(dim=-1))
    g = torch.cuda.CUDAGraph()
    out = k.argmax_triton(logits)
    with torch.cuda.graph(g):
        out = k.argmax_triton(logits)
    logits.copy_(_rows(rows, 128256, torch.bfloat16, "cuda"))
    g.replay()
    assert torch.equal(out, logits.argmax(dim=-1))


def test_a_vocabulary_past_the_kernels_limit_is_refused():
    with pytest.raises(k.ArgmaxKernelError, match="outside"):
        k.argmax_triton(torch.zeros(1, k.MAX_VOCAB + 1))
