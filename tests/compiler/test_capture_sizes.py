"""default_capture_sizes: which token counts get a CUDA graph (compiler/cuda_graphs.py)."""

from __future__ import annotations

import pytest

from compile_engine.compiler.cuda_graphs import MAX_GRAPH_TOKENS, default_capture_sizes

UP_TO_512 = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
             288, 320, 352, 384, 416, 448, 480, 512]  # fmt: skip
DEFAULT = UP_TO_512 + [768, 1024, 1280, 1536, 1792, 2048]


def test_serve_defaults_graph_every_step_of_the_token_budget():
    assert MAX_GRAPH_TOKENS == 2048
    assert default_capture_sizes(256, 2048) == DEFAULT
    assert default_capture_sizes(256, 2048, 2048) == DEFAULT
    # LLM's larger budget: prompt-only steps above 2,048 tokens run the pieces.
    assert default_capture_sizes(256, 16384) == DEFAULT
    assert default_capture_sizes(256, 2048, 512) == UP_TO_512


@pytest.mark.parametrize("budget", [1, 16, 100, 300, 512, 2048, 16384])
@pytest.mark.parametrize("seqs", [1, 16, 256, 1024])
def test_the_bound_stays_on_the_grid_within_the_budget(seqs, budget):
    sizes = default_capture_sizes(seqs, budget, 512)
    assert sizes == [s for s in UP_TO_512 if s <= min(budget, max(seqs, 512))]
    assert default_capture_sizes(seqs, budget) == [s for s in DEFAULT if s <= budget]


def test_a_larger_bound_graphs_prompt_chunks_up_to_it():
    assert default_capture_sizes(256, 4096, 4096) == DEFAULT + [2304, 2560, 2816, 3072, 3328,
                                                               3584, 3840, 4096]  # fmt: skip
    # Off the 256 grid, the bound itself is the last size; never above the token budget.
    assert default_capture_sizes(256, 2048, 1000)[-3:] == [512, 768, 1000]
    assert default_capture_sizes(256, 1000, 4096)[-3:] == [512, 768, 1000]
    assert default_capture_sizes(256, 300, 4096) == [s for s in UP_TO_512 if s <= 300]
