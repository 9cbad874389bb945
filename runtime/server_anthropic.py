"""Anthropic's Messages API: POST /v1/messages, answered in full or streamed as its named events,
and POST /v1/messages/count_tokens.

`system` becomes a system turn before `messages`; the chat template renders them on the engine
thread and the request runs as one `Run` (runtime/server_stream.py). How it ended is Anthropic's
`stop_reason`: `end_turn` (the model's end-of-sequence token), `stop_sequence` (and which one in
`stop_sequence`), `max_tokens`, or `model_context_window_exceeded` (the context ended first).
Text only: tools (until the tool-calling issue lands), thinking and non-text blocks are refused
by name (runtime/protocol_anthropic.py). Every error these handlers raise leaves in Anthropic's
shape `{"type": "error", "error": {"type", "message"}}`, which the anthropic client parses.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from compile_engine.runtime.engine import CompletionOutput, RequestOutput
from compile_engine.runtime.protocol import APIError
from compile_engine.runtime.protocol_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
)
from compile_engine.runtime.sampling_params import InvalidSamplingParams, SamplingParams
from compile_engine.runtime.server_common import (
    STATE,
    State,
    check_model,
    internal_error,
    read_json,
)
from compile_engine.runtime.server_openai import chat_prompt
from compile_engine.runtime.server_stream import Run, collect, sse_event, stream_events

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _anthropic_errors(handler: Handler) -> Handler:
    """Answer the errors `handler` raises in Anthropic's shape instead of OpenAI's."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            error = exc
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            error = internal_error()
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return web.json_response(error_body(error), status=error.status, headers=headers)

    return answer


# The routes on which the API key may come as Anthropic's clients send it, in x-api-key.
PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def add_routes(app: web.Application) -> None:
    """Register the Messages API on `app`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


async def _prompt(state: State, req: CountTokensRequest | MessagesRequest) -> list[int]:
    check_model(state, req.model)
    # On a tokenizer thread, refused by its size or a prefix's count before tokenizing all of
    # it where it can be (State.check_text), as the chat route does.
    template = functools.partial(
        chat_prompt, messages=req.chat_messages(), add_generation_prompt=True,
        check=functools.partial(state.check_text, param="messages"),
    )  # fmt: skip
    prompt = await state.tokenize(template)
    if isinstance(req, MessagesRequest):  # count_tokens counts whatever it is given
        state.check_prompt_tokens(len(prompt), "messages")
    return prompt


def _sampling_params(req: MessagesRequest) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": req.max_tokens, "stop": req.stop_sequences or []}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as exc:
        param = str(exc).split("=", 1)[0]
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def _stop(c: CompletionOutput, max_tokens: int) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for how `c` ended."""
    if c.finish_reason == "stop":
        if isinstance(c.stop_reason, str):  # a stop string; an int is a stop token (EOS)
            return "stop_sequence", c.stop_reason
        return "end_turn", None
    if c.finish_reason == "length":
        if len(c.token_ids) >= max_tokens:
            return "max_tokens", None
        return "model_context_window_exceeded", None
    return None, None  # aborted, which only a departed client causes


def _usage(out: RequestOutput) -> dict[str, int]:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.outputs[0].token_ids),
    }


@_anthropic_errors
async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, CountTokensRequest)
    return web.json_response({"input_tokens": len(await _prompt(state, req))})


@_anthropic_errors
async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, MessagesRequest)
    params = _sampling_params(req)
    prompt = await _prompt(state, req)
    message_id = f"msg_{uuid.uuid4().hex}"
    run = Run(state.async_llm(), message_id, 1)
    await run.start([prompt], params, req.cache_salt)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name}
    if req.stream:
        return await _stream(request, run, req, head, len(prompt))
    try:
        final = await collect(run)
    finally:
        run.abort()
    out = final[run.ids[0]]
    stop_reason, stop_sequence = _stop(out.outputs[0], req.max_tokens)
    body = head | {
        "content": [{"type": "text", "text": out.outputs[0].text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(out),
    }
    return web.json_response(body)


async def _stream(
    request: web.Request, run: Run, req: MessagesRequest, head: dict[str, Any], prompt_len: int
) -> web.StreamResponse:
    """Anthropic's event sequence for one text block."""

    def event(kind: str, **fields: Any) -> bytes:
        return sse_event(kind, {"type": kind} | fields)

    async def events():
        opening = head | {"content": [], "stop_reason": None, "stop_sequence": None}
        opening["usage"] = {"input_tokens": prompt_len, "output_tokens": 0}
        yield event("message_start", message=opening)
        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield event("ping")
        out = None
        while not run.done:
            out = await run.next()
            delta = out.outputs[0].delta_text
            if delta:
                yield event(
                    "content_block_delta", index=0, delta={"type": "text_delta", "text": delta}
                )
        yield event("content_block_stop", index=0)
        stop_reason, stop_sequence = _stop(out.outputs[0], req.max_tokens)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield event(
            "message_delta", delta=delta, usage={"output_tokens": _usage(out)["output_tokens"]}
        )
        yield event("message_stop")

    def failed() -> bytes:
        return event("error", error=error_body(internal_error())["error"])

    return await stream_events(request, run, events(), failed)
