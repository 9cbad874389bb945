"""Helpers for the server tests: constants and an aiohttp app served from a background thread."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from aiohttp import web

from compile_engine.runtime.server import ASYNC_LLM, bind, start_site

_T = TypeVar("_T")

API_KEY = "test-key"
MODEL_NAME = "smollm2"
MAX_BODY_BYTES = 1 << 20


@dataclass
class RunningServer:
    base_url: str
    app: web.Application
    engine: object
    loop: asyncio.AbstractEventLoop

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def in_engine_thread(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` (an offline `LLM.generate`, a tokenizer call) on the server's engine thread
        between two cycles, so that a test never uses the engine or its tokenizer from a second
        thread. The AsyncLLM's snapshot of the engine's stats and step counters is refreshed
        afterwards, as a cycle refreshes it: /metrics then counts `fn`'s steps at once, not in
        the delta of some later request."""

        async def call() -> _T:
            llm = self.app[ASYNC_LLM]

            def run() -> tuple:
                engine = llm.engine
                return fn(), engine.stats(), dataclasses.replace(engine.runner.counters)

            result, llm.stats, llm.counters = await llm.run_in_engine_thread(run)
            return result

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(300)


class ServerThread:
    """An aiohttp app served as `compile-engine serve` serves it (runtime/server.py's
    start_site: every connection watched by the app's limits), from its own event loop on a
    background thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.sock = bind("127.0.0.1", 0)

    def start(self) -> int:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self) -> int:
        self.runner = await start_site(self.app, self.sock, shutdown_timeout=5)
        return self.sock.getsockname()[1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.sock.close()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is an error of `status` in OpenAI's shape, naming `param` if given, with a
    message and no traceback; returns its error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
