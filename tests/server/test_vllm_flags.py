"""vLLM's serve flags and probes (issue 31, item 7): several served names, /version and /ping,
the prefix-caching pair, --gpu-memory-utilization sizing the KV pool as vLLM does."""

from __future__ import annotations

import types

import httpx
import pytest
import torch

from compile_engine.cli import build_parser
from compile_engine.compiler.artifact import ENGINE_VERSION
from compile_engine.runtime import model_runner
from compile_engine.runtime.engine import EngineConfig, LLMEngine
from compile_engine.runtime.engine_args import engine_kwargs

from server_harness import ServerThread
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def named_server(tmp_path_factory):
    from compile_engine.runtime.server import build_app

    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", directory)
    config = EngineConfig(model=str(directory), target="cpu", enforce_eager=True)
    app = build_app(LLMEngine(config), served_model_name=["first", "second"])
    thread = ServerThread(app)
    port = thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        yield http
    thread.stop()


def test_every_served_name_is_listed_and_answers(named_server):
    listed = named_server.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["first", "second"]
    body = {"model": "second", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    answer = named_server.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == "first"  # as vLLM: the first
    assert named_server.get("/v1/models/second").json()["id"] == "second"
    missing = named_server.post("/v1/completions", json={**body, "model": "third"})
    assert missing.status_code == 404
    assert "'first', 'second'" in missing.json()["error"]["message"]


def test_version_and_ping(named_server):
    assert named_server.get("/version").json() == {"version": ENGINE_VERSION}
    assert named_server.get("/ping").status_code == 200
    assert named_server.post("/ping").status_code == 200
    assert named_server.get("/health").status_code == 200


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


def test_the_prefix_caching_pair_and_the_old_spelling():
    assert engine_kwargs(_serve_args())["enable_prefix_caching"] is True
    assert (
        engine_kwargs(_serve_args("--no-enable-prefix-caching"))["enable_prefix_caching"] is False
    )
    assert engine_kwargs(_serve_args("--no-prefix-caching"))["enable_prefix_caching"] is False
    assert engine_kwargs(_serve_args("--enable-prefix-caching"))["enable_prefix_caching"] is True
    assert _serve_args("--served-model-name", "a", "b").served_model_name == ["a", "b"]
    utilization = engine_kwargs(_serve_args("--gpu-memory-utilization", "0.5"))
    assert utilization["gpu_memory_utilization"] == 0.5


def test_gpu_memory_utilization_bounds_the_whole_process_as_vllm(monkeypatch):
    # 100 GiB device, 60 GiB free (the weights took 40): at 0.9 the process may use 90 GiB, so
    # the pool gets 50 GiB less the reserve; at 0.5 it gets nothing beyond the minimum.
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 100 * gib))
    per_block = 1 << 20
    loaded = types.SimpleNamespace(
        dtype=torch.float16,
        cache_dtype=torch.float16,
        config=types.SimpleNamespace(num_layers=1),
        model=types.SimpleNamespace(kv_cache_shape=lambda blocks, size: (per_block // 2,)),
    )
    cuda = torch.device("cuda")
    blocks = model_runner.default_num_blocks(loaded, 16, cuda, 1 << 40, gib, 0.9)
    assert blocks == 49 * 1024  # (60 - 10 - 1) GiB of 1 MiB blocks
    assert model_runner.default_num_blocks(loaded, 16, cuda, 1 << 40, 0, 0.5) == 10 * 1024
    assert model_runner.default_num_blocks(loaded, 16, cuda, 1 << 40, 0, 0.3) == 2
