"""Start-up from an artifact: what loading may reuse, and what it must not.

The load path's numbers are in bench startup (benchmarks/startup.py), which also counts the
Triton kernels a load had to compile on the H200 (none, once the build has run every CUDA
graph size). Here: AOTAutograd's cache serves the compiled pieces again, keyed by the source
of our op references so that an edited reference is never served stale.
"""

from __future__ import annotations

import uuid

import pytest

import compile_engine.compiler.compiled_model as compiled_model
from compile_engine import LLM

from oracle import GREEDY, NEW_TOKENS, hf_greedy
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_aot_cache_serves_pieces_again_and_is_keyed_by_reference_source(tmp_path, monkeypatch):
    hf_model = make_tiny_model("llama", tmp_path)
    prompts = [[5, 9, 11, 3], [7, 1, 8]]
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]

    def start() -> LLM:
        # The pieces only: the CPU decode graph's cache is keyed alike and would double each
        # of the two cold compiles here (test_compiler's artifact load counts it).
        return LLM(
            str(tmp_path), dtype="float32", target="cpu", num_kv_blocks=16,
            passes="-paged_attention_cpu",
        )  # fmt: skip

    start()  # fills the caches (or finds them filled by an earlier run)
    again = start()
    # the three pieces (compiler/compiled_model.py)
    assert again.engine.compiled.cache_stats["aot_autograd_hits"] == 3
    assert again.engine.compiled.cache_stats["aot_autograd_bypasses"] == 0
    assert _tokens(again, prompts) == want

    # As after an edit of a reference: neither cache may serve what it holds for the old
    # source (a unique hash, so that no earlier run of this test filled the caches for it).
    monkeypatch.setattr(compiled_model, "references_hash", lambda: uuid.uuid4().hex[:16])
    edited = start()
    stats = edited.engine.compiled.cache_stats
    assert stats["aot_autograd_hits"] == 0 and stats["aot_autograd_misses"] == 3
    assert stats["fx_graph_hits"] == 0
    assert _tokens(edited, prompts) == want
