"""OpenAI's Responses API: POST /v1/responses, answered in full or streamed as its typed events,
and GET / DELETE /v1/responses/{id} on the responses this server keeps.

A request's conversation is its `instructions` (a system turn), then the conversation of the
response its `previous_response_id` names (that response's input and output, but not its
instructions, which OpenAI does not carry over), then its `input`. The chat template renders it
on the engine thread and it runs as one `Run` (runtime/server_stream.py). Responses are kept in
memory, the newest `MAX_STORED_RESPONSES` (`store: false` keeps none), so a long-running server
neither grows without bound nor can continue a conversation from before a restart. Text only:
tools, reasoning, structured outputs and logprobs are refused by name
(runtime/protocol_responses.py); errors have OpenAI's shape, as on the other OpenAI routes.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from compile_engine.runtime.engine import RequestOutput
from compile_engine.runtime.protocol import APIError
from compile_engine.runtime.protocol_responses import ResponsesRequest
from compile_engine.runtime.sampling_params import InvalidSamplingParams, SamplingParams
from compile_engine.runtime.server_common import STATE, check_model, internal_error, read_json
from compile_engine.runtime.server_openai import chat_prompt
from compile_engine.runtime.server_stream import Run, collect, sse_event, stream_events

# Each kept response holds its whole conversation (a list sharing its strings with the
# response it continues, so a chain costs its new text, not its length squared).
MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # what GET /v1/responses/{id} answers
    conversation: list[dict[str, str]]  # input and output turns, without the instructions


class ResponseStore:
    """The responses kept for `previous_response_id` and GET, the newest `limit` of them. Used
    from the event loop only."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES) -> None:
        if limit < 1:
            raise ValueError(f"a response store keeps at least one response, got limit={limit}")
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


RESPONSES = web.AppKey("responses", ResponseStore)


def add_routes(app: web.Application, max_stored: int = MAX_STORED_RESPONSES) -> None:
    """Register the Responses API on `app`, with its store of responses."""
    app[RESPONSES] = ResponseStore(max_stored)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


# -- the body ---------------------------------------------------------------------------------


def _sampling_params(req: ResponsesRequest) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": req.max_output_tokens}
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as exc:
        param = str(exc).split("=", 1)[0]
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    item = {"id": item_id, "type": "message", "role": "assistant", "status": status}
    return item | {"content": content}


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, output = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        # The engine does not report prefix-cache hits per request.
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's status and incomplete_details for how its one output ended."""
    if finish_reason == "stop":
        return "completed", None
    if finish_reason == "length":  # max_output_tokens, or the end of the context
        return "incomplete", {"reason": "max_output_tokens"}
    return "incomplete", None  # aborted by the engine


class _Response:
    """One response being made: what its bodies share, and its end."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.head: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            # SamplingParams' defaults, which are OpenAI's.
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "user": req.user,
            "background": False,
        }

    def body(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        base = {"status": status, "output": output, "usage": None}
        return self.head | base | {"error": None, "incomplete_details": None} | fields

    def finished(self, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        status, incomplete = _status(c.finish_reason)
        output = [_message(self.message_id, status, c.text)]
        return self.body(
            status,
            output,
            usage=_usage(out),
            incomplete_details=incomplete,
            completed_at=int(time.time()),
        )


# -- the routes -------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    store = request.app[RESPONSES]
    req = await read_json(request, ResponsesRequest)
    check_model(state, req.model)
    req.refuse_unsupported()
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                400,
                f"previous response {req.previous_response_id!r} not found: this server keeps "
                f"the newest {store.limit} responses made with store: true, in memory",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.conversation
    turns = req.messages()
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    params = _sampling_params(req)
    llm = state.async_llm()
    # On a tokenizer thread, refused by its size or a prefix's count before tokenizing all of
    # it where it can be (State.check_text), as the chat route does.
    template = functools.partial(
        chat_prompt, messages=system + history + turns, add_generation_prompt=True,
        check=functools.partial(state.check_text, param="input"),
    )  # fmt: skip
    prompt = await state.tokenize(template)
    state.check_prompt_tokens(len(prompt), "input")
    response = _Response(req, state.model_name)
    run = Run(llm, response.id, 1)
    try:
        await run.start([prompt], params, req.cache_salt)
    except APIError as exc:
        if exc.code == "context_length_exceeded":  # the engine's message names its own field
            exc.message = exc.message.replace("max_tokens", "max_output_tokens")
        raise

    def keep(body: dict[str, Any], text: str) -> None:
        if req.store:
            conversation = history + turns + [{"role": "assistant", "content": text}]
            store.put(response.id, StoredResponse(body, conversation))

    if req.stream:
        return await _stream(request, run, response, keep)
    try:
        final = await collect(run)
    finally:
        run.abort()
    out = final[run.ids[0]]
    body = response.finished(out)
    keep(body, out.outputs[0].text)
    return web.json_response(body)


async def _stream(
    request: web.Request,
    run: Run,
    response: _Response,
    keep: Callable[[dict[str, Any], str], None],
) -> web.StreamResponse:
    """OpenAI's event sequence for one message of one text part, each event numbered."""
    numbers = itertools.count()
    item = {"item_id": response.message_id, "output_index": 0}
    part = item | {"content_index": 0}

    def event(kind: str, **fields: Any) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(numbers)} | fields)

    async def events():
        opening = response.body("in_progress", [])
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        yield event(
            "response.output_item.added",
            output_index=0,
            item=_message(response.message_id, "in_progress", None),
        )
        yield event("response.content_part.added", **part, part=_text_part(""))
        out = None
        while not run.done:
            out = await run.next()
            delta = out.outputs[0].delta_text
            if delta:
                yield event("response.output_text.delta", **part, delta=delta, logprobs=[])
        body = response.finished(out)
        message = body["output"][0]
        text = out.outputs[0].text
        yield event("response.output_text.done", **part, text=text, logprobs=[])
        yield event("response.content_part.done", **part, part=message["content"][0])
        yield event("response.output_item.done", output_index=0, item=message)
        keep(body, text)
        # OpenAI ends a response cut short with response.incomplete, not response.completed.
        done = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield event(done, response=body)

    def failed() -> bytes:
        error = internal_error()
        body = response.body("failed", [], error={"code": "server_error", "message": error.message})
        return event("response.failed", response=body)

    return await stream_events(request, run, events(), failed)


def _stored(request: web.Request) -> tuple[str, StoredResponse]:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES].get(response_id)
    if stored is None:
        raise APIError(
            404,
            f"response {response_id!r} not found: this server keeps the newest "
            f"{request.app[RESPONSES].limit} responses made with store: true, in memory",
            type="not_found_error",
            param="response_id",
            code="not_found",
        )
    return response_id, stored


async def retrieve_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a kept response, as it was answered (the openai client's
    `responses.retrieve`)."""
    return web.json_response(_stored(request)[1].body)


async def delete_response(request: web.Request) -> web.Response:
    response_id, _ = _stored(request)
    request.app[RESPONSES].delete(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})
