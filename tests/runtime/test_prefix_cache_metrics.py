"""/metrics' prefix-cache counters on a tiny model: tokens, counted as vLLM counts them (issue 32).

vLLM's `prefix_cache_queries` adds each new request's tokens when it is scheduled and
`prefix_cache_hits` the tokens found cached; a prompt that must be scored looks nothing up, and a
preempted request's second lookup is kept apart (scheduler-level cases: tests/runtime/
test_scheduler.py). Here the counters are read as a scrape renders them, after LLM.generate.
"""

from __future__ import annotations

import re

import pytest

from compile_engine.runtime.llm import LLM
from compile_engine.runtime.metrics import ServerMetrics
from compile_engine.runtime.sampling_params import SamplingParams

from tiny_models import make_tiny_model

ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", directory)
    return LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)


def scrape(llm: LLM) -> dict[str, float]:
    engine = llm.engine
    text = ServerMetrics("tiny", engine.stats, lambda: engine.runner.counters).render().decode()
    out = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        match = re.search(rf"^compile_engine:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} missing"
        out[name] = float(match.group(1))
    return out


def test_counters_count_prompt_tokens_and_cached_tokens(llm):
    prefix = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    before = scrape(llm)
    llm.generate(prefix + [40, 41], ONE)  # 15 tokens, nothing cached yet
    llm.generate(prefix + [50, 51, 52], ONE)  # 16 tokens, the prefix's 3 blocks hit
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm.generate(prefix + [60], scored)  # must score its prompt: no lookup, not counted
    llm.generate(prefix + [70, 71], SamplingParams(temperature=0.0, max_tokens=1, n=2))
    after = scrape(llm)
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    # n=2: sibling 0 hits the prefix's 3 blocks, sibling 1 forks sibling 0's 3 full blocks.
    assert queries == 15 + 16 + 2 * 15
    assert hits == 12 + 2 * 12
