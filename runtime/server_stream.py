"""Running one API call's engine requests (`Run`, one request per prompt) and answering them:
all outputs collected for a JSON answer, or sent as Server-Sent Events as they arrive: OpenAI's
`data:` chunks ending in `[DONE]` (`stream`), or the named events of the Responses and Anthropic
Messages APIs (`stream_events`).

A run that ends any other way than in full (the client went away, a write failed, the handler
was cancelled) aborts its requests, which frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from compile_engine.runtime.async_engine import AsyncLLM, EngineDead, EngineError
from compile_engine.runtime.engine import CompletionOutput, RequestOutput
from compile_engine.runtime.protocol import APIError
from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.scheduler import QueueFull, RequestTooLong
from compile_engine.runtime.server_common import internal_error

log = logging.getLogger(__name__)


def add_error(exc: BaseException) -> APIError:
    """The answer to an error from queuing a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTooLong):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, QueueFull):
        return APIError(503, str(exc), type="server_error", code="queue_full")
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, EngineError):
        return internal_error()
    if isinstance(exc, ValueError):  # bad prompt token ids, empty prompt, ...
        return APIError(400, str(exc), code="invalid_value")
    log.error("unexpected error queuing a request", exc_info=exc)
    return internal_error()


class Run:
    """The engine requests of one API call (one per prompt), all feeding one queue."""

    def __init__(self, llm: AsyncLLM, base_id: str, num_prompts: int) -> None:
        self.llm = llm
        self.ids = [f"{base_id}-{i}" for i in range(num_prompts)]
        self.prompt_index = {rid: i for i, rid in enumerate(self.ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(self.ids)

    async def start(
        self, prompts: list[str | list[int]], params: SamplingParams, cache_salt: str | None
    ) -> None:
        adds = [
            self.llm.add_request(rid, prompt, params, cache_salt=cache_salt, sink=self.queue)
            for rid, prompt in zip(self.ids, prompts, strict=True)
        ]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:
            self.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort()
            raise add_error(errors[0])

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    @property
    def done(self) -> bool:
        return not self.unfinished

    def abort(self) -> None:
        for rid in self.unfinished:
            self.llm.abort(rid)
        self.unfinished.clear()


async def collect(run: Run) -> dict[str, RequestOutput]:
    """Every request's final output, by request id; the caller aborts the run when done."""
    final: dict[str, RequestOutput] = {}
    while not run.done:
        out = await run.next()
        if out.finished:
            final[out.request_id] = out
    return final


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def total_usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage(prompt, completion)


class Choice:
    """Streaming bookkeeping of one choice: what has been sent so far."""

    __slots__ = ("started", "finished", "num_logprobs", "text_offset")

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.num_logprobs = 0
        self.text_offset = 0


def usage_chunk(req, head: dict):
    """The final usage-only chunk of a stream, when stream_options.include_usage asks for it."""
    if req.stream_options is None or not req.stream_options.include_usage:
        return None

    def make(final: list[RequestOutput]) -> dict:
        return head | {"choices": [], "usage": total_usage(final)}

    return make


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream(
    request: web.Request,
    run: Run,
    make_chunks: Callable[[RequestOutput, CompletionOutput, Choice], list[dict[str, Any]]],
    make_usage: Callable[[list[RequestOutput]], dict[str, Any]] | None,
    n: int,
) -> web.StreamResponse:
    """Send SSE chunks as outputs arrive; on a dropped connection abort the run."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    choices: dict[int, Choice] = {}
    final: list[RequestOutput] = []
    try:
        # Inside the try: a client gone before the headers go out must abort the run too.
        await response.prepare(request)
        try:
            while not run.done:
                out = await run.next()
                base = run.prompt_index[out.request_id] * n
                for completion in out.outputs:
                    choice = choices.setdefault(base + completion.index, Choice())
                    if choice.finished:
                        continue
                    for chunk in make_chunks(out, completion, choice):
                        await response.write(_sse(chunk))
                    choice.finished = completion.finish_reason is not None
                if out.finished:
                    final.append(out)
        except ConnectionError:
            raise
        except Exception as exc:  # headers are sent: the error travels as an event
            if not isinstance(exc, EngineError):
                log.error("stream failed", exc_info=exc)
            await response.write(_sse(internal_error().body()))
        else:
            if make_usage is not None:
                await response.write(_sse(make_usage(final)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        log.debug("client went away during a stream")
    finally:
        run.abort()
    return response


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """One named Server-Sent Event; the Anthropic client skips events without a name."""
    data = json.dumps(payload, ensure_ascii=False).encode()
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


async def stream_events(
    request: web.Request,
    run: Run,
    events: AsyncGenerator[bytes, None],
    failed: Callable[[], bytes],
) -> web.StreamResponse:
    """Send `events` (encoded SSE, which pull the run's outputs themselves) as they come; a
    failure once the headers are out is sent as the event `failed()` makes, since the status
    can no longer change. On a dropped connection, or any other early end, abort the run."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)  # inside the try, as in `stream`
        try:
            async for event in events:
                await response.write(event)
        except ConnectionError:
            raise
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.error("stream failed", exc_info=exc)
            await response.write(failed())
        await response.write_eof()
    except ConnectionError:
        log.debug("client went away during a stream")
    finally:
        run.abort()
        await events.aclose()
    return response
