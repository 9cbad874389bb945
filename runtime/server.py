"""The OpenAI-compatible HTTP server (aiohttp): `compile-engine serve MODEL`.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE or not),
GET /v1/models, GET /v1/models/{model}, GET /health, POST /tokenize, POST /detokenize,
GET /metrics. docs/server.md has the request fields, error shapes and metrics.

Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; an
unexpected exception is logged with its traceback and answered with a bare 500. Requests run on
`AsyncLLM` (runtime/async_engine.py); a handler that is cancelled (the client went away) or whose
stream write fails aborts its requests, which frees their KV blocks before the next step.

The event loop never calls the tokenizer: the engine's detokenizer uses it on the engine thread,
and a fast tokenizer must not be used from two threads at once. Chat templates, /tokenize,
/detokenize and the text echo shows of a token-id prompt run there through
`AsyncLLM.run_in_engine_thread`; the text of single tokens (logprobs, echoed prompt tokens) is
read from a table of the whole vocabulary that the engine thread decodes once at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from compile_engine.runtime.async_engine import AsyncLLM, EngineDead, EngineError
from compile_engine.runtime.engine import CompletionOutput, EngineConfig, LLMEngine, RequestOutput
from compile_engine.runtime.metrics import CONTENT_TYPE
from compile_engine.runtime.model_runner import TokenLogprobs
from compile_engine.runtime.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    refuse_unsupported,
    validation_error,
)
from compile_engine.runtime.sampling_params import InvalidSamplingParams, SamplingParams
from compile_engine.runtime.scheduler import QueueFull, RequestTooLong

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# On SIGTERM in-flight requests get this long to finish before they are cancelled (and aborted).
SHUTDOWN_GRACE_S = 10.0
# Temperatures this small are greedy in effect, and dividing logits by them overflows.
_GREEDY_EPS = 1e-5
# A logprob of -inf is not JSON; OpenAI and vLLM report this floor instead.
_MIN_LOGPROB = -9999.0
# JSON can escape a lone UTF-16 surrogate ("\ud800"), which json.loads turns into a str that no
# tokenizer or UTF-8 encoder takes. Bodies without such an escape skip the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

ASYNC_LLM = web.AppKey("async_llm", AsyncLLM)
_STATE = web.AppKey("state", "_State")
_M = TypeVar("_M", bound=BaseModel)


class _State:
    """What the handlers of one app share."""

    def __init__(
        self, engine: LLMEngine, model_name: str, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        # Both set by the app's start-up, on the running loop and the engine thread.
        self.llm: AsyncLLM | None = None
        self.token_texts: list[str] = []

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, what logprobs report."""
        return self.token_texts[token_id]


def _token_texts(engine: LLMEngine) -> list[str]:
    """Every token id's text decoded on its own; run on the engine thread. A table of the
    whole vocabulary (0.1-0.2 s and 3 MB for SmolLM2's 49k on the 2-core CPU) keeps logprobs off
    the tokenizer, where a per-request decode would wait for the engine thread's current step.
    Ids the tokenizer does not know (a padded embedding) decode to ""."""
    tokenizer = engine.tokenizer
    size = max(len(tokenizer), engine.model_config.vocab_size)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(size)]


def build_app(
    engine: LLMEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> web.Application:
    """The aiohttp app serving `engine`; it starts and stops its AsyncLLM with the app."""
    state = _State(
        engine, served_model_name or engine.config.model, api_key or None, max_body_bytes
    )
    # client_max_size is the backstop; _read_json refuses by Content-Length before reading.
    app = web.Application(middlewares=[_errors, _auth], client_max_size=max_body_bytes)
    app[_STATE] = state

    async def engine_lifecycle(app: web.Application):
        llm = AsyncLLM(engine, state.model_name)
        await llm.start()
        if engine.tokenizer is not None:
            state.token_texts = await llm.run_in_engine_thread(
                functools.partial(_token_texts, engine)
            )
        state.llm = app[ASYNC_LLM] = llm
        yield
        await llm.shutdown()

    app.cleanup_ctx.append(engine_lifecycle)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    return app


# -- middleware -------------------------------------------------------------------------------

_OPEN_PATHS = frozenset({"/health", "/metrics"})

_HTTP_ERRORS = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def _error_response(error: APIError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return web.json_response(error.body(), status=error.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", None))
        if exc.status == 404:
            message = f"no route for {request.method} {request.path}"
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        elif exc.status == 413:
            message = _too_large_message(request.app[_STATE].max_body_bytes)
        else:
            message = exc.reason
        return _error_response(APIError(exc.status, message, type=type_, code=code))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(_internal_error())


@web.middleware
async def _auth(request: web.Request, handler: Callable) -> web.StreamResponse:
    key = request.app[_STATE].api_key
    if key is not None and request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
    return await handler(request)


def _internal_error() -> APIError:
    return APIError(
        500,
        "the server hit an internal error; it is logged on the server",
        type="server_error",
        code="internal_error",
    )


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes"


# -- request parsing --------------------------------------------------------------------------


async def _read_json(request: web.Request, model: type[_M]) -> _M:
    state = request.app[_STATE]
    limit = state.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, _too_large_message(limit), code="request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, _too_large_message(limit), code="request_too_large") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    refuse_unsupported(body, model)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply", code="invalid_value") from None


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise APIError(
                400,
                f"{name} has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff without its "
                "pair), which is not text; send valid Unicode",
                param=name,
                code="invalid_value",
            ) from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply", code="invalid_value") from None


def _check_model(state: _State, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, **fields: Any
) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
    kwargs: dict[str, Any] = dict(
        n=req.n,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        **fields,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if 0 < kwargs.get("temperature", 1.0) < _GREEDY_EPS:  # negative ones are refused below
        kwargs["temperature"] = 0.0
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as exc:
        param = str(exc).split("=", 1)[0]
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def _add_error(exc: BaseException) -> APIError:
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
        return _internal_error()
    if isinstance(exc, ValueError):  # bad prompt token ids, empty prompt, ...
        return APIError(400, str(exc), code="invalid_value")
    log.error("unexpected error queuing a request", exc_info=exc)
    return _internal_error()


# -- running requests -------------------------------------------------------------------------


class _Run:
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
            raise _add_error(errors[0])

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


def _llm(state: _State) -> AsyncLLM:
    if state.llm is None:
        raise APIError(503, "the engine is starting", type="server_error", code="starting")
    return state.llm


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finite(logprob: float) -> float:
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _collect(run: _Run) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while not run.done:
        out = await run.next()
        if out.finished:
            final[out.request_id] = out
    return final


class _Choice:
    """Streaming bookkeeping of one choice: what has been sent so far."""

    __slots__ = ("started", "finished", "num_logprobs", "text_offset")

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.num_logprobs = 0
        self.text_offset = 0


def _usage_chunk(req, head: dict):
    """The final usage-only chunk of a stream, when stream_options.include_usage asks for it."""
    if req.stream_options is None or not req.stream_options.include_usage:
        return None

    def usage(final: list[RequestOutput]) -> dict:
        return head | {"choices": [], "usage": _total_usage(final)}

    return usage


async def _stream(
    request: web.Request,
    run: _Run,
    make_chunks: Callable[[RequestOutput, CompletionOutput, _Choice], list[dict[str, Any]]],
    make_usage: Callable[[list[RequestOutput]], dict[str, Any]] | None,
    n: int,
) -> web.StreamResponse:
    """Send SSE chunks as outputs arrive; on a dropped connection abort the run."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    choices: dict[int, _Choice] = {}
    final: list[RequestOutput] = []
    try:
        # Inside the try: a client gone before the headers go out must abort the run too.
        await response.prepare(request)
        try:
            while not run.done:
                out = await run.next()
                base = run.prompt_index[out.request_id] * n
                for completion in out.outputs:
                    choice = choices.setdefault(base + completion.index, _Choice())
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
            await response.write(_sse(_internal_error().body()))
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


# -- /v1/completions --------------------------------------------------------------------------


def _completion_logprobs(
    state: _State, entries: list[TokenLogprobs], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy completions logprobs for `entries`; returns it and the next offset."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = state.token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        top = {state.token_text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    return body, offset


def _echo_logprobs(state: _State, prompt_token_ids: list[int]) -> tuple[dict[str, Any], int]:
    """The prompt's part of echoed logprobs: tokens without logprobs (the engine computes no
    prompt logprobs), so clients that zip the lists still line up."""
    tokens = [state.token_text(t) for t in prompt_token_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    none = [None] * len(tokens)
    body = {"tokens": tokens, "token_logprobs": none, "top_logprobs": none, "text_offset": offsets}
    return body, offset


def _merge_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def _echo_texts(tokenizer, prompts: list[str | list[int]]) -> list[str]:
    """What echo shows of each prompt: a string as sent, token ids as the tokenizer decodes
    them. Run on the engine thread."""
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    req = await _read_json(request, CompletionRequest)
    _check_model(state, req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n", param="best_of", code="unsupported")
    prompts = req.prompts()
    if len(prompts) > MAX_PROMPTS:
        raise APIError(
            400, f"at most {MAX_PROMPTS} prompts per request", param="prompt", code="invalid_value"
        )
    if any(len(p) == 0 for p in prompts):
        # Caught here: the scheduler's RequestTooLong would answer context_length_exceeded, on
        # which clients shorten the prompt.
        raise APIError(
            400, "a prompt is empty; send at least one token", param="prompt", code="invalid_value"
        )
    tokenizer = state.engine.tokenizer
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
    want_logprobs = req.logprobs is not None
    if tokenizer is None and (want_logprobs or req.echo):
        param = "logprobs" if want_logprobs else "echo"
        raise APIError(400, f"this model has no tokenizer to give {param} its text", param=param)
    params = _sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    llm = _llm(state)
    echo_texts: list[str] = []
    if req.echo:
        if all(isinstance(p, str) for p in prompts):
            echo_texts = prompts
        else:
            echo = functools.partial(_echo_texts, tokenizer, prompts)
            echo_texts = await llm.run_in_engine_thread(echo)
    run = _Run(llm, response_id, len(prompts))
    await run.start(prompts, params, req.cache_salt)
    head = {"id": response_id, "object": "text_completion", "created": created}
    head["model"] = state.model_name

    if req.stream:

        def chunks(out: RequestOutput, c: CompletionOutput, choice: _Choice) -> list[dict]:
            text, logprobs = c.delta_text, None
            if not choice.started:
                choice.started = True
                if req.echo:
                    text = echo_texts[run.prompt_index[out.request_id]] + text
                    if want_logprobs:
                        logprobs, choice.text_offset = _echo_logprobs(state, out.prompt_token_ids)
            if want_logprobs:
                new = (c.logprobs or [])[choice.num_logprobs :]
                choice.num_logprobs += len(new)
                mine, choice.text_offset = _completion_logprobs(state, new, choice.text_offset)
                logprobs = _merge_logprobs(logprobs, mine) if logprobs else mine
            # A new token always makes a chunk, even with no text yet (a model without a
            # tokenizer, or a held-back partial character): clients time tokens by chunks.
            if (
                not text
                and not c.delta_token_ids
                and not (logprobs and logprobs["tokens"])
                and c.finish_reason is None
            ):
                return []
            index = run.prompt_index[out.request_id] * req.n + c.index
            body = {"index": index, "text": text, "logprobs": logprobs}
            body |= {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            return [head | {"choices": [body]}]

        return await _stream(request, run, chunks, _usage_chunk(req, head), req.n)

    try:
        final = await _collect(run)
    finally:
        run.abort()
    choices = []
    for rid in run.ids:
        out = final[rid]
        for c in out.outputs:
            text, logprobs = c.text, None
            offset = 0
            if req.echo:
                text = echo_texts[run.prompt_index[rid]] + text
                if want_logprobs:
                    logprobs, offset = _echo_logprobs(state, out.prompt_token_ids)
            if want_logprobs:
                mine, _ = _completion_logprobs(state, c.logprobs or [], offset)
                logprobs = _merge_logprobs(logprobs, mine) if logprobs else mine
            choices.append(
                {
                    "index": len(choices),
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    body = head | {"choices": choices, "usage": _total_usage([final[r] for r in run.ids])}
    return web.json_response(body)


def _total_usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return _usage(prompt, completion)


# -- /v1/chat/completions ---------------------------------------------------------------------


def _chat_prompt(
    state: _State,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids; `variables` (chat_template_kwargs) reach the template."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(variables or {}),
        )  # fmt: skip
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _chat_logprobs(state: _State, entries: list[TokenLogprobs], k: int) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = state.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return [
        item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top[:k]]}
        for e in entries
    ]


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    req = await _read_json(request, ChatCompletionRequest)
    _check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    top_k = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else None
    if max_tokens is None:
        max_tokens = req.max_tokens
    params = _sampling_params(req, max_tokens=max_tokens, logprobs=top_k if req.logprobs else None)
    llm = _llm(state)
    messages = [m.template_dict() for m in req.messages]
    # Tokenizing in the engine thread keeps every tokenizer call on one thread.
    prompt = await llm.run_in_engine_thread(
        functools.partial(
            _chat_prompt, state, messages, req.add_generation_prompt, req.chat_template_kwargs
        )
    )
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = _Run(llm, response_id, 1)
    await run.start([prompt], params, req.cache_salt)
    head = {"id": response_id, "object": "chat.completion", "created": int(time.time())}
    head["model"] = state.model_name

    if req.stream:
        head["object"] = "chat.completion.chunk"

        def chunks(out: RequestOutput, c: CompletionOutput, choice: _Choice) -> list[dict]:
            result = []
            if not choice.started:
                choice.started = True
                opening = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                opening |= {"logprobs": None, "finish_reason": None}
                result.append(head | {"choices": [opening]})
            logprobs = None
            if req.logprobs:
                new = (c.logprobs or [])[choice.num_logprobs :]
                choice.num_logprobs += len(new)
                if new:
                    logprobs = {"content": _chat_logprobs(state, new, top_k)}
            if c.delta_text or logprobs or c.finish_reason is not None:
                delta = {"content": c.delta_text} if c.delta_text else {}
                body = {"index": c.index, "delta": delta, "logprobs": logprobs}
                body |= {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                result.append(head | {"choices": [body]})
            return result

        return await _stream(request, run, chunks, _usage_chunk(req, head), req.n)

    try:
        final = await _collect(run)
    finally:
        run.abort()
    out = final[run.ids[0]]
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": _chat_logprobs(state, c.logprobs or [], top_k)}
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return web.json_response(head | {"choices": choices, "usage": _total_usage([out])})


# -- the small endpoints ----------------------------------------------------------------------


def _model_card(state: _State) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "compile-engine",
        "root": state.engine.config.model,
        "max_model_len": state.engine.max_model_len,
    }


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[_STATE])]})


async def _model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: what the openai client's `models.retrieve` asks."""
    state = request.app[_STATE]
    _check_model(state, request.match_info["model"])
    return web.json_response(_model_card(state))


async def _health(request: web.Request) -> web.Response:
    llm = request.app[_STATE].llm
    if llm is None or llm.dead is not None:
        raise APIError(503, "the engine is not running", type="server_error", code="engine_dead")
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    llm = _llm(request.app[_STATE])
    return web.Response(body=llm.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _encode(state: _State, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:
        messages = [m.template_dict() for m in req.messages]
        return _chat_prompt(state, messages, req.add_generation_prompt, req.chat_template_kwargs)
    tokens = state.engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return [int(t) for t in tokens]


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    req = await _read_json(request, TokenizeRequest)
    _check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt")
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    tokens = await _llm(state).run_in_engine_thread(functools.partial(_encode, state, req))
    body = {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len}
    return web.json_response(body)


async def _detokenize(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    req = await _read_json(request, DetokenizeRequest)
    _check_model(state, req.model)
    vocab = state.engine.model_config.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    text = await _llm(state).run_in_engine_thread(
        functools.partial(state.engine.tokenizer.decode, req.tokens)
    )
    return web.json_response({"prompt": text})


# -- entry point ------------------------------------------------------------------------------


async def serve(
    app: web.Application, host: str, port: int, *, grace_s: float = SHUTDOWN_GRACE_S
) -> int:
    """Serve until SIGTERM or SIGINT, then stop accepting, let in-flight requests finish for up
    to `grace_s` (the rest are cancelled, which aborts them) and return 0."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=grace_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        for address in runner.addresses:
            host_, port_ = address[:2]
            print(f"serving {app[_STATE].model_name} on http://{host_}:{port_}", file=sys.stderr)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        message = f"shutting down: finishing in-flight requests (up to {grace_s:.0f} s)"
        print(message, file=sys.stderr)
    finally:
        await runner.cleanup()
    return 0


def main(args: argparse.Namespace) -> int:
    """`compile-engine serve`: load the engine, serve until SIGTERM, return the exit code."""
    from compile_engine.runtime.engine_args import engine_kwargs

    engine = LLMEngine(
        EngineConfig(model=args.model, max_waiting=args.max_waiting, **engine_kwargs(args))
    )
    app = build_app(
        engine,
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get("COMPILE_ENGINE_API_KEY"),
    )
    return asyncio.run(serve(app, args.host, args.port))
