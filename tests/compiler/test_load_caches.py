"""Start-up from an artifact: what loading may reuse, and what it must not.

The load path's numbers are in bench startup (benchmarks/startup.py); here are its
invariants. On the CPU: AOTAutograd's cache serves the compiled pieces again, keyed by the
source of our op references so that an edited reference is never served stale. On the H200 (skipped
without CUDA): an h100 build leaves nothing for the load to compile, Triton kernels included.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch
from oracle import GREEDY, NEW_TOKENS, hf_greedy
from tiny_models import make_tiny_model

import compiler.compiled_model as compiled_model
from runtime import LLM

pytestmark = pytest.mark.slow


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_aot_cache_serves_pieces_again_and_is_keyed_by_engine_code(tmp_path, monkeypatch):
    hf_model = make_tiny_model("llama", tmp_path)
    prompts = [[5, 9, 11, 3], [7, 1, 8]]
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]

    def start() -> LLM:
        return LLM(str(tmp_path), dtype="float32", target="cpu", num_kv_blocks=16)

    start()  # fills the caches (or finds them filled by an earlier run)
    again = start()
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


_LOAD = """
import json, sys
from runtime import LLM
llm = LLM(sys.argv[1], num_kv_blocks=64)
graphs = llm.engine.runner.graphs
print("RESULT " + json.dumps({
    "caches": llm.engine.compiled.cache_stats,
    "num_graphs": len(graphs.graphs) if graphs else 0,
}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_h100_artifact_leaves_nothing_to_compile_at_load(tmp_path):
    """Serve captures a CUDA graph per size; each size's kernels must already be in the
    artifact's Triton cache (the build warms them), so the load adds none."""
    from benchmarks.make_model import make_model
    from benchmarks.startup import triton_cache_entries
    from compiler.build import build_artifact

    model = make_model("llama3-8b", tmp_path / "model", device="cuda", layers=2)
    artifact = tmp_path / "artifact"
    manifest = build_artifact(str(model), artifact, target="h100", dtype="bfloat16")
    assert manifest.timings["warm_up_s"] > 0
    before = triton_cache_entries(artifact)
    load = subprocess.run(
        [sys.executable, "-c", _LOAD, str(artifact)], capture_output=True, text=True, timeout=600
    )
    assert load.returncode == 0, load.stderr[-3000:]
    result = json.loads(load.stdout.split("RESULT ", 1)[1])
    assert result["num_graphs"] == len(manifest.capture_sizes)
    assert result["caches"]["aot_autograd_hits"] == 3
    assert result["caches"]["fx_graph_misses"] == 0
    assert triton_cache_entries(artifact) - before == set()
