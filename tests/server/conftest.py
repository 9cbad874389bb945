"""A real server on loopback around the session's SmolLM2 engine, shared by the server tests."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import API_KEY, MAX_BODY_BYTES, MODEL_NAME, RunningServer, ServerThread


@pytest.fixture(scope="session")
def server(smollm2_llm):
    from compile_engine.runtime.server import build_app

    engine = smollm2_llm.engine
    app = build_app(
        engine,
        served_model_name=MODEL_NAME,
        api_key=API_KEY,
        max_body_bytes=MAX_BODY_BYTES,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    thread = ServerThread(app)
    port = thread.start()
    yield RunningServer(f"http://127.0.0.1:{port}", app, engine, thread.loop)
    thread.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official client on the shared server."""
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="session")
def http(server):
    """Raw HTTP on the shared server, with the API key."""
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as c:
        yield c
