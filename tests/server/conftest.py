"""A real server on loopback around the session's SmolLM2 engine, shared by the server tests."""

from __future__ import annotations

import pytest
from server_harness import API_KEY, MAX_BODY_BYTES, MODEL_NAME, RunningServer, ServerThread


@pytest.fixture(scope="session")
def server(smollm2_llm):
    from runtime.server import build_app

    engine = smollm2_llm.engine
    app = build_app(
        engine, served_model_name=MODEL_NAME, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES
    )
    thread = ServerThread(app)
    port = thread.start()
    yield RunningServer(f"http://127.0.0.1:{port}", app, engine)
    thread.stop()
