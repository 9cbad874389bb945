"""default_capture_sizes: which token counts get a CUDA graph (compiler/cuda_graphs.py)."""

from __future__ import annotations

import pytest

from compiler.cuda_graphs import MAX_GRAPH_TOKENS, default_capture_sizes

DEFAULT = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
           288, 320, 352, 384, 416, 448, 480, 512]  # fmt: skip


def test_serve_defaults_graph_every_step_up_to_512_tokens():
    assert MAX_GRAPH_TOKENS == 512
    assert default_capture_sizes(256, 2048) == DEFAULT
    assert default_capture_sizes(256, 2048, 512) == DEFAULT


@pytest.mark.parametrize("budget", [1, 16, 100, 300, 512, 2048, 16384])
@pytest.mark.parametrize("seqs", [1, 16, 256, 1024])
def test_the_default_bound_stays_on_the_grid_within_the_budget(seqs, budget):
    sizes = default_capture_sizes(seqs, budget)
    assert sizes == [s for s in DEFAULT if s <= min(budget, max(seqs, 512))]


def test_a_larger_bound_graphs_prompt_chunks_up_to_it():
    assert default_capture_sizes(256, 2048, 2048) == DEFAULT + [768, 1024, 1280, 1536, 1792, 2048]
    # Off the 256 grid, the bound itself is the last size; never above the token budget.
    assert default_capture_sizes(256, 2048, 1000)[-3:] == [512, 768, 1000]
    assert default_capture_sizes(256, 1000, 4096)[-3:] == [512, 768, 1000]
    assert default_capture_sizes(256, 300, 4096) == [s for s in DEFAULT if s <= 300]
