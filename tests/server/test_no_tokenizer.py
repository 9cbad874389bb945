"""A model without tokenizer files serves token-id prompts; what needs text (string prompts,
logprobs, echo, chat, /tokenize, /detokenize) is a 400 that says so, not a 500."""

from __future__ import annotations

import httpx
import pytest

from compile_engine import LLM
from compile_engine.runtime.server import build_app

from server_harness import ServerThread, assert_error
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-no-tokenizer")
    make_tiny_model("llama", directory)
    llm = LLM(str(directory), dtype="float32", target="cpu", num_kv_blocks=64, enforce_eager=True)
    assert llm.tokenizer is None
    thread = ServerThread(build_app(llm.engine, served_model_name="tiny"))
    port = thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        yield http
    thread.stop()


def test_token_ids_are_served_and_text_features_refused(tiny):
    http = tiny
    prompt = [5, 17, 33, 41]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 4
    for field, value in [("logprobs", 1), ("echo", True)]:
        body = {"prompt": prompt, "max_tokens": 2, field: value}
        error = assert_error(http.post("/v1/completions", json=body), 400, field)
        assert "tokenizer" in error["message"]
    assert_error(http.post("/v1/completions", json={"prompt": "text", "max_tokens": 2}), 400)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json=chat), 400)
    assert_error(http.post("/tokenize", json={"prompt": "Hi"}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [1, 2]}), 400)
    assert http.get("/health").status_code == 200
