"""bench serve: the metric arithmetic on hand-made timestamps, and a real run against our server
on a tiny random model (launched as a subprocess, as `--launch` does). No timed assertions."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

from compile_engine.benchmarks import cli, render, serve
from compile_engine.benchmarks.serve import (
    RequestResult,
    RequestSpec,
    ServeBenchError,
    compute_metrics,
)

from tiny_models import make_tiny_model

VOCAB = 96  # tests/tiny_models.py


def _result(prompt_len, output_len, start, chunks, usage=None, error=None) -> RequestResult:
    r = RequestResult(prompt_len, output_len, start=start, chunk_times=list(chunks))
    r.usage_tokens = usage
    r.error = error
    return r


@pytest.fixture
def hand_made() -> list[RequestResult]:
    return [
        # TTFT 100 ms, E2EL 300 ms, gaps 50/100/50 ms, TPOT 200/3 ms.
        _result(10, 4, 0.0, [0.10, 0.15, 0.25, 0.30], usage=4),
        # One token: TTFT = E2EL = 200 ms, no gap, no TPOT (0 for goodput).
        _result(20, 1, 1.0, [1.2], usage=1),
        # No usage in the stream: one token per chunk. TTFT 400, E2EL 500, gap 100, TPOT 100.
        _result(30, 2, 0.5, [0.9, 1.0]),
        _result(40, 8, 0.7, [], error="HTTP 503: queue full"),
    ]


def test_metric_arithmetic(hand_made):
    m = compute_metrics(hand_made, duration_s=2.0)
    assert (m["completed"], m["failed"], m["first_error"]) == (3, 1, "HTTP 503: queue full")
    # Failed requests count in no total.
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 7)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["num_output_len_mismatch"] == 0 and m["per_token_stream"]
    assert m["ttft_ms"]["mean"] == pytest.approx(700 / 3)
    assert m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["e2el_ms"]["mean"] == pytest.approx(1000 / 3)
    assert m["tpot_ms"]["mean"] == pytest.approx((200 / 3 + 100) / 2)
    assert m["itl_ms"]["mean"] == pytest.approx(75) and m["itl_ms"]["median"] == pytest.approx(75)
    # Percentiles by linear interpolation, as numpy (and vLLM through numpy) compute them.
    for key, values in (("ttft_ms", [100, 200, 400]), ("itl_ms", [50, 100, 50, 100])):
        for p in (90, 99):
            assert m[key][f"p{p}"] == pytest.approx(np.percentile(values, p))
        assert m[key]["std"] == pytest.approx(np.std(values))
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo(hand_made):
    # ttft <= 250 and tpot <= 80 ms: the first two (a one-token output has TPOT 0), not the third.
    slos = serve.parse_goodput(["ttft:250", "tpot:80"])
    assert compute_metrics(hand_made, 2.0, slos)["request_goodput"] == pytest.approx(1.0)
    slos["e2el"] = 250.0  # now the first (E2EL 300 ms) misses too
    assert compute_metrics(hand_made, 2.0, slos)["request_goodput"] == pytest.approx(0.5)
    for bad in ("ttft", "itl:5", "tpot:-1", "e2el:x"):
        with pytest.raises(ServeBenchError, match="METRIC:MILLISECONDS"):
            serve.parse_goodput([bad])


def test_bunched_stream_is_flagged():
    # One chunk for 4 tokens (a model without a tokenizer on our server): not per token.
    m = compute_metrics([_result(5, 4, 0.0, [0.5], usage=4)], 1.0)
    assert not m["per_token_stream"] and m["tokens_per_chunk"] == 4
    assert m["itl_ms"]["mean"] is None


def test_datasets_are_seeded_and_sharegpt_filtered():
    a = serve.make_requests("sharegpt-synthetic", 300, VOCAB, random.Random(3))
    b = serve.make_requests("sharegpt-synthetic", 300, VOCAB, random.Random(3))
    assert [(s.prompt, s.output_len) for s in a] == [(s.prompt, s.output_len) for s in b]
    for s in a:
        assert 4 <= len(s.prompt) <= 1024 and s.output_len >= 4
        assert len(s.prompt) + s.output_len <= 2048
        assert all(0 <= t < VOCAB for t in s.prompt)
    r = serve.make_requests(
        "random", 50, VOCAB, random.Random(0), input_len=20, output_len=10, range_ratio=0.5
    )
    assert all(10 <= len(s.prompt) <= 30 and 5 <= s.output_len <= 15 for s in r)
    assert len({len(s.prompt) for s in r}) > 1


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """Our server in a subprocess on a tiny random Llama with a one-word-per-token tokenizer."""
    root = tmp_path_factory.mktemp("serve-bench")
    model = root / "tiny"
    make_tiny_model("llama", model)
    assert serve.add_word_tokenizer(model) == model
    assert serve.add_word_tokenizer(model) is None  # already there
    args = serve.build_parser().parse_args(
        ["--model", str(model), "--target", "cpu", "--enforce-eager", "--num-kv-blocks", "64"]
    )
    args.max_waiting = 64
    log = root / "server.log"
    with serve.launch_server(args, log, ready_timeout_s=120) as server:
        yield model, server
    assert server.process.returncode == 0, log.read_text()[-2000:]


def test_streams_against_our_server(tiny_server):
    model, server = tiny_server
    rng = random.Random(0)
    lengths = [(5, 3), (17, 6), (9, 1), (30, 8), (12, 5), (3, 7), (22, 2), (8, 4)]
    specs = [RequestSpec([rng.randrange(VOCAB) for _ in range(i)], o) for i, o in lengths]
    settings = serve.ClientSettings(server.base_url, model_name=str(model))
    results, duration = asyncio.run(serve.run_requests(settings, specs, max_concurrency=4))
    assert duration > 0
    for spec, r in zip(specs, results, strict=True):
        assert r.success, r.error
        assert r.prompt_len == len(spec.prompt)
        # Three counts of the output agree with what was asked: the server's usage, the words of
        # the streamed text (one word per token with this tokenizer) and the chunks.
        words = r.text.split()
        assert r.usage_tokens == spec.output_len
        assert len(words) == spec.output_len
        assert all(w.startswith("t") and 0 <= int(w[1:]) < VOCAB for w in words)
        assert len(r.chunk_times) == spec.output_len
        assert 0 < r.ttft <= r.e2el
        assert all(gap >= 0 for gap in r.itl)


def test_main_writes_serve_json_and_render_shows_it(tiny_server, tmp_path):
    model, server = tiny_server
    argv = ["--base-url", server.base_url, "--model", str(model), "--results-dir", str(tmp_path)]
    argv += ["--num-prompts", "8", "--max-concurrency", "4", "--input-len", "12"]
    argv += ["--output-len", "5", "--random-range-ratio", "0.5", "--request-rate", "200"]
    argv += ["--num-warmup", "2", "--goodput", "ttft:60000", "tpot:60000", "--save-requests"]
    assert cli.main(["serve", *argv]) == 0
    (path,) = tmp_path.glob("serve-*.json")
    data = json.loads(path.read_text())
    assert data["serve_output_tok_s"] == pytest.approx(data["output_throughput"])
    assert data["serve_output_tok_s"] > 0
    assert (data["completed"], data["failed"]) == (8, 0)
    assert data["per_token_stream"] and data["num_output_len_mismatch"] == 0
    rows = data["requests"]
    assert all(r["output_tokens"] == r["output_len"] == r["chunks"] for r in rows)
    assert data["total_output_tokens"] == sum(r["output_len"] for r in rows)
    assert data["total_input_tokens"] == sum(r["prompt_len"] for r in rows)
    assert all(r["ttft_ms"] <= r["e2el_ms"] for r in rows)
    # Generous SLOs: every request meets them.
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    # The server's own counters saw the timed requests' tokens, and no preemption.
    assert data["server_counters"]["generation_tokens"] == data["total_output_tokens"]
    assert data["server_counters"]["preemptions"] == 0
    # Its step counters: every timed token was computed in some step (the prompts' and all but
    # the last of each output), none from a CUDA graph on the CPU, none waiting for a device.
    steps = data["server_steps"]
    computed = data["server_counters"]["step_tokens"]
    assert computed <= data["total_input_tokens"] + data["total_output_tokens"]
    assert computed >= data["total_output_tokens"]
    assert steps["steps"] >= max(r["output_len"] for r in rows)
    assert steps["graph_step_share"] == 0 and steps["device_wait_share"] == 0
    assert steps["busy_ms_per_step"] > 0
    assert steps["tokens_per_step"] == pytest.approx(computed / steps["steps"], abs=0.05)

    out = tmp_path / "performance.md"
    assert render.main(["--results-dir", str(tmp_path), "--output", str(out)]) == 0
    text = out.read_text()
    # A CPU run is no headline number: it is detailed, its throughput in its own table.
    assert "## Against the targets" not in text
    throughput = render._fmt(data["request_throughput"]), render._fmt(data["output_throughput"])
    assert "| " + " | ".join(throughput) + " | " in text
    assert "| TTFT |" in text and "| ITL |" in text and "goodput" in text


def test_no_server_is_a_clear_error(tmp_path, capsys):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", str(tmp_path), "--num-prompts", "1"]
    assert serve.main([*argv, "--results-dir", str(tmp_path)]) == 2
    assert "no OpenAI-compatible server answers at http://127.0.0.1:9" in capsys.readouterr().err
    assert not list(Path(tmp_path).glob("*.json"))


def test_serve_command_passes_the_engine_flags():
    args = serve.build_parser().parse_args(
        ["--model", "/m", "--target", "h100", "--dtype", "bfloat16", "--num-kv-blocks", "9"]
        + ["--no-cuda-graphs", "--max-num-seqs", "128", "--launch"]
    )
    args.max_waiting = 2000
    command = serve.serve_command(args, 1234)
    assert command[1:5] == ["-m", "compile_engine.cli", "serve", "/m"]
    pairs = {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}
    assert pairs["--port"] == "1234" and pairs["--max-waiting"] == "2000"
    assert pairs["--target"] == "h100" and pairs["--dtype"] == "bfloat16"
    assert pairs["--num-kv-blocks"] == "9" and pairs["--max-num-seqs"] == "128"
    assert "--no-cuda-graphs" in command and "--enforce-eager" not in command
    assert "--max-model-len" not in command  # unset flags keep the server's defaults
    # Every flag given is one `compile-engine serve` accepts.
    from compile_engine.cli import build_parser

    build_parser().parse_args(["serve", *command[4:]])
