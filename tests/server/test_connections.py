"""What one slow or silent client may hold (issue 31, item 2): slowloris headers, a body shorter
than its Content-Length, a silent connection and an idle keep-alive one are each dropped within
their (small, here) timeout, with a 408 where a request had begun; beyond the connection cap a
new connection gets a 503; /metrics counts every drop; a client that is slow but in time, and a
stream longer than every timeout, are served in full."""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from compile_engine import LLM
from compile_engine.runtime.server import build_app
from compile_engine.runtime.server_connections import ConnectionLimits

from server_harness import ServerThread
from tiny_models import make_tiny_model

LIMITS = ConnectionLimits(
    header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_timeout_s=1.0, max_connections=16
)
# How much later than its timeout a drop may come on a loaded 2-core machine.
SLACK_S = 0.75


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-connections")
    make_tiny_model("llama", directory)
    llm = LLM(str(directory), dtype="float32", target="cpu", num_kv_blocks=64, enforce_eager=True)
    thread = ServerThread(build_app(llm.engine, served_model_name="tiny", limits=LIMITS))
    port = thread.start()
    yield port, llm.engine
    thread.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open {limit_s} s; sent {data[:200]!r}")


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["error"]


def metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def dropped(text: str, reason: str) -> float:
    pattern = (
        rf'^compile_engine:http_connections_dropped_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$'
    )
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no drop count for {reason}"
    return float(match.group(1))


def assert_dropped_in(elapsed: float, timeout: float) -> None:
    assert timeout - 0.1 <= elapsed <= timeout + SLACK_S, (elapsed, timeout)


def test_slowloris_headers_get_408_within_the_header_timeout(tiny):
    port, _ = tiny
    before = dropped(metrics(port), "header_timeout")
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock = connect(port)
    start = time.monotonic()
    response = b""
    for byte in request:  # one byte every 0.1 s, as issue 31's client sent them
        ready, _, _ = select.select([sock], [], [], 0.1)
        if ready:
            break
        sock.send(bytes([byte]))
    response = read_until_closed(sock)
    elapsed = time.monotonic() - start
    sock.close()
    status, error = error_of(response)
    assert status == 408 and error["code"] == "request_timeout", response
    assert_dropped_in(elapsed, LIMITS.header_timeout_s)
    assert dropped(metrics(port), "header_timeout") == before + 1


def test_a_body_shorter_than_its_length_gets_408_within_the_body_timeout(tiny):
    port, _ = tiny
    before = dropped(metrics(port), "body_timeout")
    sock = connect(port)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    sock.sendall(head + b'{"prompt": [1, 2')
    start = time.monotonic()
    response = read_until_closed(sock)
    elapsed = time.monotonic() - start
    sock.close()
    status, error = error_of(response)
    assert status == 408 and "body" in error["message"], response
    assert_dropped_in(elapsed, LIMITS.body_timeout_s)
    assert dropped(metrics(port), "body_timeout") == before + 1


def test_a_silent_connection_is_closed_without_a_word(tiny):
    port, _ = tiny
    before = dropped(metrics(port), "header_timeout")
    sock = connect(port)
    start = time.monotonic()
    assert read_until_closed(sock) == b""
    assert_dropped_in(time.monotonic() - start, LIMITS.header_timeout_s)
    sock.close()
    assert dropped(metrics(port), "header_timeout") == before + 1


def test_an_idle_keep_alive_connection_is_closed(tiny):
    port, _ = tiny
    before = dropped(metrics(port), "keep_alive_timeout")
    sock = connect(port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(65536)
    start = time.monotonic()
    assert response.startswith(b"HTTP/1.1 200")
    read_until_closed(sock)
    assert_dropped_in(time.monotonic() - start, LIMITS.keep_alive_timeout_s)
    sock.close()
    assert dropped(metrics(port), "keep_alive_timeout") == before + 1


def test_beyond_the_cap_a_connection_gets_503_and_the_count_returns(tiny):
    port, _ = tiny
    time.sleep(LIMITS.keep_alive_timeout_s + SLACK_S)  # earlier tests' connections are gone
    before = dropped(metrics(port), "max_connections")
    held = [connect(port) for _ in range(LIMITS.max_connections - 1)]
    time.sleep(0.1)  # accepted (the /metrics connection before closes meanwhile)
    one_more = connect(port)  # the cap's last
    time.sleep(0.1)
    refused = connect(port)
    refused.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    start = time.monotonic()
    response = read_until_closed(refused)
    assert time.monotonic() - start < 1.5
    status, error = error_of(response)
    assert status == 503 and error["code"] == "too_many_connections", response
    assert b"Retry-After: 1" in response
    for sock in [*held, one_more, refused]:
        sock.close()
    time.sleep(0.2)
    text = metrics(port)
    assert dropped(text, "max_connections") == before + 1
    gauge = re.search(r"^compile_engine:http_connections{[^}]*} (\S+)$", text, re.MULTILINE)
    assert gauge and float(gauge.group(1)) == 1.0  # the scrape's own connection


def test_slow_but_timely_clients_and_a_long_stream_are_served(tiny, monkeypatch):
    port, engine = tiny
    # Headers in two halves, then the body in two halves, each part in time.
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    sock = connect(port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)
    sock.sendall(f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    time.sleep(0.3)  # the body's deadline counts from the end of the headers
    sock.sendall(body[:5])
    time.sleep(0.3)
    sock.sendall(body[5:])
    response = b""
    while b'"usage"' not in response:
        chunk = sock.recv(65536)
        assert chunk, response
        response += chunk
    assert response.startswith(b"HTTP/1.1 200"), response
    sock.close()

    # A stream that runs past every timeout: busy connections have no deadline.
    real_step = engine.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    start = time.monotonic()
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - start > LIMITS.header_timeout_s + LIMITS.keep_alive_timeout_s
    assert lines[-1] == "data: [DONE]"
    finish = json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    assert finish == "length"


@pytest.mark.parametrize(
    ("flags", "code", "match"),
    [
        (["--header-timeout", "0"], 2, "must be a number of seconds > 0"),
        (["--timeout-keep-alive", "soon"], 2, "is not a number of seconds"),
        (["--max-connections", "0"], 2, "must be >= 1"),
        (["--max-connections", "100000000"], 1, "more than the open-file limit"),
    ],
)
def test_serve_refuses_limits_that_cannot_work_before_loading(tmp_path, flags, code, match):
    command = [sys.executable, "-m", "compile_engine", "serve", str(tmp_path / "no-model")]
    result = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert match in result.stderr.strip().splitlines()[-1]
