"""`bench prefix` and its step sweep on a 2-layer random model on the CPU, at tiny sizes.

No time is asserted (a shared 2-core machine); what is: the record's keys, and that the
engine's own prefix-cache counters saw each measured request hit exactly the shared prefix's
full blocks with caching on and nothing with it off, so a prefix that stopped hitting fails here.
"""

from __future__ import annotations

import json

import pytest

from compile_engine.benchmarks import make_model, prefix

RECORD_KEYS = {"command", "commit", "dirty", "timestamp", "device", "versions", "environment"}
BLOCK = 16  # the engine's default block size


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    model = make_model.make_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))
    out = tmp_path_factory.mktemp("results")
    rc = prefix.main(
        [
            "--model", str(model), "--target", "cpu", "--enforce-eager", "--num-kv-blocks", "256",
            "--sizes", "32,64", "--shares", "0,90", "--budgets", "16384,16",
            "--concurrency", "3", "--num-iters", "2",
            "--sweep", "--sweep-tokens", "1,2,4,16", "--sweep-iters", "1",
            "--sweep-prefix", "32", "--sweep-context", "4",
            "--results-dir", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    (path,) = out.glob("prefix-*.json")
    return json.loads(path.read_text())


def hit(size: int, share: int) -> int:
    shared = size * share // 100
    return min(shared // BLOCK, (size - 1) // BLOCK) * BLOCK


def test_record_holds_the_issues_keys(record):
    assert set(record) >= RECORD_KEYS
    assert record["benchmark"] == "prefix"
    assert record["parts_done"] == ["sequential", "sweep", "concurrent"]
    for tag in ("", "_b16"):  # the offline budget is the headline; others carry their budget
        for size in (32, 64):
            for share in (0, 90):
                name = f"{size}_{share}"
                assert record[f"prefix_ttft_{name}{tag}_ms"] > 0
                assert record[f"prefix_ttft_{name}_nocache{tag}_ms"] > 0
                assert record[f"prefix_hit_ttft_speedup_{name}{tag}"] > 0
                for stat in ("mean", "p50", "p99"):
                    assert record[f"prefix_c3_ttft_{name}{tag}_{stat}_ms"] > 0
                    assert record[f"prefix_c3_ttft_{name}_nocache{tag}_{stat}_ms"] > 0
                assert record[f"prefix_hit_c3_ttft_speedup_{name}{tag}"] > 0
            assert f"prefix_miss_cost_{size}{tag}" in record
    assert record["prefix_miss_cost"] == record["prefix_miss_cost_64"]  # nearest 4k


def test_cached_requests_hit_exactly_the_shared_prefix(record):
    for budget, cells in record["sequential"]["cells"].items():
        for name, cell in cells.items():
            size, share = map(int, name.split("_"))
            on, off = cell["cached"], cell["nocache"]
            assert on["hit_tokens"] == [hit(size, share)] * 2, (budget, name)
            assert on["queried_tokens"] == [size] * 2
            # The steps computed the rest, and with caching off the whole prompt.
            assert on["computed_tokens"] == [size - hit(size, share)] * 2
            assert off["computed_tokens"] == [size] * 2
            assert off["hit_tokens"] == off["queried_tokens"] == [0, 0]
            assert on["preemptions"] == off["preemptions"] == 0
    assert hit(64, 90) == 48  # the 90% cell does reach the cache
    for budget, by_c in record["concurrent"]["cells"].items():
        for name, cell in by_c["3"].items():
            size, share = map(int, name.split("_"))
            assert cell["cached"]["hit_tokens"] == 3 * hit(size, share), (budget, name)
            assert cell["nocache"]["hit_tokens"] == 0
            assert len(cell["cached"]["ttft_ms"]) == 3
            assert cell["cached"]["p99_ms"] >= cell["cached"]["p50_ms"] > 0


def test_sweep_times_steps_of_the_intended_shape(record):
    sweep = record["sweep"]
    for mode in prefix.SWEEP_MODES:
        for n in (1, 2, 4, 16):
            point = sweep["modes"][mode][str(n)]
            if mode == "mixed" and n == 1:
                assert "skipped" in point
                continue
            assert point["shape_ok"], (mode, n, point["shapes"])
            assert point["tokens"] == n and record[f"step_{mode}_{n}_ms"] > 0
    assert sweep["modes"]["decode"]["16"]["rows"] == 16
    assert sweep["modes"]["mixed"]["16"]["rows"] == 8 + 1
    # Each cached step found the whole 32-token prefix cached.
    assert all(sweep["modes"]["cached"][str(n)]["hit_tokens"] == [32] for n in (1, 2, 4, 16))
    assert isinstance(record["step_time_monotone"], bool)
    assert record["step_time_monotone_worst_ratio"] > 0
    assert sweep["doubling"]["pairs_checked"] == 4  # 1 vs 2 and 2 vs 4, decode and prefill


def test_monotone_checks_on_known_numbers():
    points = {1: 5.0, 2: 5.1, 4: 5.0, 416: 31.7, 512: 20.0, 1024: 24.8}
    found = prefix.inversions(points)
    assert [(f["n"], f["vs_n"]) for f in found] == [(416, 512)]  # 2 vs 4 is within 5%
    # The issue's 512 vs 1,024 (from its 416 vs 1,024): the worst pair is named.
    check = prefix.doubling_check({"prefill": {1: 4.8, 2: 4.6, 512: 31.0, 1024: 24.8}})
    assert not check["monotone"] and check["worst"] == {"ratio": 1.25, "mode": "prefill", "n": 512}
    assert prefix.doubling_check({"decode": {1: 1.0, 2: 1.04}})["monotone"]
    assert prefix.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert [prefix.parse_size(s) for s in ("4k", "416")] == [4096, 416]
    assert prefix.size_label(16384) == "16k" and prefix.budget_tag(2048) == "_b2048"
    assert prefix.expected_hit_tokens(4096, 90, 16) == 3680  # the issue's 3,686 shared tokens
