"""`AsyncLLM`: the engine loop as an asyncio service, for the server.

The engine is not thread-safe and `step()` is blocking torch work, so one background task hands
every engine call to a single worker thread, one *cycle* at a time: apply the queued adds, then
the queued aborts, then one `step()`, then snapshot the scheduler stats. Everything else (the
per-request queues, timing, metrics) lives on the event loop, which stays free to serve HTTP while
a step runs. Adds are applied before aborts within a cycle, so an abort issued any time after an
add (even while the add is still queued) always lands after it.

A request's outputs go to an asyncio.Queue: its own, or one shared by several requests (a
completions call with a list of prompts merges all its streams into one). A consumer that stops
early (client disconnect -> CancelledError, or closing the generator) aborts its request, and the
next cycle frees its KV blocks. When the loop has nothing to do it waits on an event.

A failing step must not take the server down silently: the error is logged with its traceback,
every in-flight request gets an `EngineError` (the server answers 500 without the traceback), the
failed requests are aborted, and the loop carries on. After several consecutive failing cycles the
engine is declared dead: new requests are refused and /health reports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.registry import Collector

from compile_engine.runtime.engine import LLMEngine, RequestOutput
from compile_engine.runtime.metrics import ServerMetrics
from compile_engine.runtime.model_runner import StepCounters
from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.scheduler import DuplicateRequest, SchedulerStats

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Consecutive failing cycles after which the engine is considered broken for good.
_MAX_CONSECUTIVE_FAILURES = 3


class EngineError(RuntimeError):
    """The engine failed while running this request (the cause is in the server log)."""


class EngineDead(RuntimeError):
    """The engine failed repeatedly and no longer accepts requests; restart the server."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    done: asyncio.Future


@dataclass(slots=True)
class _Tracked:
    """Loop-side state of one in-flight request."""

    sink: asyncio.Queue
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class _CycleResult:
    add_errors: list[Exception | None]
    outputs: list[RequestOutput] = field(default_factory=list)
    step_error: Exception | None = None
    stats: SchedulerStats | None = None
    counters: StepCounters | None = None
    has_unfinished: bool = False


class AsyncLLM:
    def __init__(
        self, engine: LLMEngine, model_name: str = "model", collectors: Iterable[Collector] = ()
    ) -> None:
        """`collectors`: more metrics for `self.metrics` (the server's HTTP side)."""
        self.engine = engine
        self.model_name = model_name
        self.stats: SchedulerStats | None = engine.stats()  # snapshot from the engine thread
        # The runner's step counters, copied in the engine thread after each cycle.
        self.counters = dataclasses.replace(engine.runner.counters)
        self.metrics = ServerMetrics(
            model_name, lambda: self.stats, lambda: self.counters, collectors
        )
        self.dead: BaseException | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._requests: dict[str, _Tracked] = {}
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._engine_busy = engine.has_unfinished_requests()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        """Abort whatever is still in flight, stop the loop and the worker thread."""
        for request_id in list(self._requests):
            self._fail(request_id, EngineError("the server is shutting down"))
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def run_in_engine_thread(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` in the engine's thread between two cycles: what must touch the engine or
        its own tokenizer (the server's start-up: the token-text table, the tokenizer pool's
        copies). A request's tokenizer work goes to the server's tokenizer pool instead, which
        never delays a step."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    # -- requests -------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        sink: asyncio.Queue | None = None,
    ) -> asyncio.Queue:
        """Queue a request; return the queue its RequestOutputs (or an EngineError) arrive on.

        Raises what `LLMEngine.add_request` raises (RequestTooLong, QueueFull, ValueError...),
        or EngineDead.
        """
        if self.dead is not None or self._stopping:
            raise EngineDead("the engine is not accepting requests (see the server log)")
        if request_id in self._requests:
            raise DuplicateRequest(f"request id {request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        sink = sink if sink is not None else asyncio.Queue()
        done = loop.create_future()
        self._requests[request_id] = _Tracked(sink, time.monotonic())
        self._adds.append(_Add(request_id, prompt, params, cache_salt, done))
        self._wake.set()
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return sink

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the next step. Unknown ids are ignored."""
        if self._requests.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            self._wake.set()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; stopping early aborts it."""
        request_id = request_id or uuid.uuid4().hex
        queue = await self.add_request(request_id, prompt, params, cache_salt=cache_salt)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            if not (self._adds or self._aborts or self._engine_busy):
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            try:
                result = await loop.run_in_executor(self._executor, self._cycle, adds, aborts)
            except Exception as exc:  # a bug outside step(): fail this cycle's work, carry on
                log.exception("engine cycle failed")
                result = _CycleResult([exc] * len(adds), step_error=exc)
                # Some of the adds may have reached the engine before the failure.
                self._aborts.extend(add.request_id for add in adds)
                self._engine_busy = True  # unknown: let the next cycle find out
            else:
                self._engine_busy = result.has_unfinished
                self.stats = result.stats or self.stats
                self.counters = result.counters or self.counters
            self._finish_adds(adds, result.add_errors)
            self._route(result.outputs)
            if result.step_error is None:
                failures = 0
                continue
            failures += 1
            for request_id in list(self._requests):
                self._fail(request_id, EngineError("the engine failed; see the server log"))
            if failures >= _MAX_CONSECUTIVE_FAILURES:
                self.dead = result.step_error
                log.error("engine failed %d cycles in a row; refusing new requests", failures)
                for add in self._adds:
                    if not add.done.done():
                        add.done.set_exception(EngineDead("the engine failed; see the server log"))
                self._adds.clear()
                return

    def _cycle(self, adds: list[_Add], aborts: list[str]) -> _CycleResult:
        """One turn of the worker thread; the only place that touches the engine."""
        engine = self.engine
        add_errors: list[Exception | None] = []
        for add in adds:
            try:
                engine.add_request(
                    add.request_id, add.prompt, add.params, cache_salt=add.cache_salt
                )
                add_errors.append(None)
            except Exception as exc:
                add_errors.append(exc)
        for request_id in aborts:
            engine.abort_request(request_id)
        result = _CycleResult(add_errors)
        if engine.has_unfinished_requests():
            try:
                result.outputs = engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the in-flight requests")
                result.step_error = exc
        result.stats = engine.stats()
        result.counters = dataclasses.replace(engine.runner.counters)
        result.has_unfinished = engine.has_unfinished_requests()
        return result

    def _finish_adds(self, adds: list[_Add], errors: list[Exception | None]) -> None:
        for add, error in zip(adds, errors, strict=True):
            if error is not None:
                self._requests.pop(add.request_id, None)
            if add.done.done():  # the caller was cancelled; its abort is already queued
                continue
            if error is None:
                add.done.set_result(None)
            else:
                add.done.set_exception(error)

    def _route(self, outputs: list[RequestOutput]) -> None:
        metrics = self.metrics
        now = time.monotonic()
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:  # aborted while the step ran
                continue
            new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
            if new_tokens:
                metrics.generation_tokens.inc(new_tokens)
                if tracked.first_token is None:
                    tracked.first_token = now
                    metrics.ttft.observe(now - tracked.arrival)
                    metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    metrics.itl.observe(now - tracked.last_token)
                tracked.last_token = now
            if out.finished:
                metrics.e2e.observe(now - tracked.arrival)
                del self._requests[out.request_id]
            tracked.sink.put_nowait(out)

    def _fail(self, request_id: str, error: Exception) -> None:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        self.abort(request_id)
        tracked.sink.put_nowait(error)
