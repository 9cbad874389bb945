"""The OpenAI-compatible HTTP server (aiohttp): `compile-engine serve MODEL`.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE or not),
GET /v1/models, GET /v1/models/{model}, GET /health, POST /tokenize, POST /detokenize,
GET /metrics. docs/server.md has the request fields, error shapes and metrics.

This module is the app: `build_app`, the error and auth middleware, the small routes, and the
entry point (`serve`, `main`). The OpenAI routes are in runtime/server_openai.py, running and
streaming an API call's requests in runtime/server_stream.py, and what every route shares (the
app's state, reading a body) in runtime/server_common.py.

Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; an
unexpected exception is logged with its traceback and answered with a bare 500. Requests run on
`AsyncLLM` (runtime/async_engine.py); a handler that is cancelled (the client went away) or whose
stream write fails aborts its requests, which frees their KV blocks before the next step.

The event loop and the engine thread never tokenize a request: prompts, chat templates, /tokenize,
/detokenize and the text echo shows of a token-id prompt run on a small pool of tokenizer
threads, each with its own copy of the tokenizer (runtime/tokenizer_pool.py; a fast tokenizer
must not be used from two threads at once, and the engine's detokenizer keeps the engine's own on
the engine thread), and the engine gets token ids. A text whose size alone proves that it cannot
fit in max_model_len is refused before it is tokenized. The text of single tokens (logprobs,
echoed prompt tokens) is read from a table of the whole vocabulary that the engine thread decodes
once at start-up.

Each connection is watched (runtime/server_connections.py): headers, body and keep-alive idle
time are bounded, and so is the number of open connections; `serve` and `start_site` serve
through that watch.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import hmac
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from compile_engine.compiler.artifact import ENGINE_VERSION
from compile_engine.runtime import server_anthropic, server_responses
from compile_engine.runtime.async_engine import AsyncLLM
from compile_engine.runtime.engine import EngineConfig, LLMEngine
from compile_engine.runtime.metrics import CONTENT_TYPE, HTTPCollector, HTTPStats
from compile_engine.runtime.progress import start_engine
from compile_engine.runtime.protocol import APIError, DetokenizeRequest, TokenizeRequest
from compile_engine.runtime.server_common import (
    DEFAULT_MAX_BODY_BYTES,
    STATE,
    State,
    check_model,
    internal_error,
    read_json,
    token_texts,
    too_large_message,
)
from compile_engine.runtime.server_connections import (
    FILE_RESERVE,
    ConnectionGuard,
    ConnectionLimits,
    GuardedSite,
    LimitsError,
    default_max_connections,
    file_limit,
)
from compile_engine.runtime.server_openai import chat_completions, chat_prompt, completions
from compile_engine.runtime.tokenizer_pool import TokenizerPool, bytes_per_token, encode
from compile_engine.runtime.tool_parsers import tool_parser

log = logging.getLogger(__name__)

# On SIGTERM in-flight requests get this long to finish before they are cancelled (and aborted).
SHUTDOWN_GRACE_S = 10.0

# Threads that tokenize requests, each with its own copy of the tokenizer (~0.1 s to make).
DEFAULT_TOKENIZER_WORKERS = 2

ASYNC_LLM = web.AppKey("async_llm", AsyncLLM)
GUARD = web.AppKey("connection_guard", ConnectionGuard)


def build_app(
    engine: LLMEngine,
    *,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: ConnectionLimits | None = None,
    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> web.Application:
    """The aiohttp app serving `engine`; it starts and stops its AsyncLLM with the app.
    served_model_name: the name, or names, a request's `model` may give (responses carry the
    first, as vLLM's do); default the engine's model. `limits`: what a connection may take
    (default ConnectionLimits()); they apply where `serve` or `start_site` serves the app.
    tool_call_parser: the model's tool-call format (runtime/tool_parsers.py), which
    `tool_choice: auto` parses; enable_auto_tool_choice allows that choice (vLLM's flags)."""
    if tokenizer_workers < 1:
        raise ValueError(f"tokenizer_workers must be >= 1, got {tokenizer_workers}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
    parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    state = State(
        engine,
        names or [engine.config.model],
        api_key or None,
        max_body_bytes,
        tool_parser=parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )
    guard = ConnectionGuard(limits or ConnectionLimits(), max_body_bytes)
    # client_max_size is the backstop; read_json refuses by Content-Length before reading.
    app = web.Application(
        middlewares=[guard.middleware(), _errors, _auth], client_max_size=max_body_bytes
    )
    app[STATE] = state
    app[GUARD] = guard

    def http_stats() -> HTTPStats:
        pending = state.tokenizers.pending if state.tokenizers is not None else 0
        return HTTPStats(guard.open, dict(guard.dropped), pending)

    def tokenizer_setup() -> tuple[list[str], TokenizerPool, int | None]:
        # On the engine thread, the one that uses engine.tokenizer.
        texts = token_texts(engine)
        pool = TokenizerPool.build(engine.tokenizer, tokenizer_workers)
        return texts, pool, bytes_per_token(engine.tokenizer, texts)

    async def engine_lifecycle(app: web.Application):
        llm = AsyncLLM(
            engine, state.model_name, collectors=[HTTPCollector(state.model_name, http_stats)]
        )
        await llm.start()
        if engine.tokenizer is not None:
            setup = await llm.run_in_engine_thread(tokenizer_setup)
            state.token_texts, state.tokenizers, state.bytes_per_token = setup
        state.llm = app[ASYNC_LLM] = llm
        yield
        await llm.shutdown()
        if state.tokenizers is not None:
            state.tokenizers.shutdown()

    app.cleanup_ctx.append(engine_lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    server_responses.add_routes(app)
    server_anthropic.add_routes(app)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    return app


# -- middleware -------------------------------------------------------------------------------

_OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})

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
            message = too_large_message(request.app[STATE].max_body_bytes)
        else:
            message = exc.reason
        return _error_response(APIError(exc.status, message, type=type_, code=code))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(internal_error())


@web.middleware
async def _auth(request: web.Request, handler: Callable) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key is not None and request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if "x-api-key" in request.headers and request.path in server_anthropic.PATHS:
            scheme, token = "bearer", request.headers["x-api-key"]  # what Anthropic clients send
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


# -- the small endpoints ----------------------------------------------------------------------


def _model_card(state: State, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "compile-engine",
        "root": state.engine.config.model,
        "max_model_len": state.engine.max_model_len,
    }


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [_model_card(state, name) for name in state.model_names]
    return web.json_response({"object": "list", "data": cards})


async def _model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: what the openai client's `models.retrieve` asks."""
    state = request.app[STATE]
    check_model(state, request.match_info["model"])
    return web.json_response(_model_card(state, request.match_info["model"]))


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": ENGINE_VERSION})


async def _health(request: web.Request) -> web.Response:
    """GET /health, and /ping as vLLM answers it (load balancers probe both): 200 while the
    engine runs, 503 before it starts or once it has died."""
    llm = request.app[STATE].llm
    if llm is None or llm.dead is not None:
        raise APIError(503, "the engine is not running", type="server_error", code="engine_dead")
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    llm = request.app[STATE].async_llm()
    return web.Response(body=llm.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _encode(state: State, req: TokenizeRequest, tokenizer) -> list[int]:
    """/tokenize's tokens, on a tokenizer thread. A text that cannot fit in max_model_len is
    refused (room 0: a context may fill it); one that fits is returned whatever its count."""
    check = functools.partial(state.check_text, room=0, tokenizer=tokenizer)
    if req.messages is not None:
        messages = [m.template_dict() for m in req.messages]
        return chat_prompt(
            tokenizer,
            messages,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            functools.partial(check, param="messages"),
        )
    check(req.prompt, param="prompt")
    return encode(tokenizer, req.prompt, req.add_special_tokens)


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, TokenizeRequest)
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt")
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    if req.prompt is not None:
        state.check_text(req.prompt, "prompt", room=0)
    tokens = await state.tokenize(functools.partial(_encode, state, req))
    body = {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len}
    return web.json_response(body)


async def _detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, DetokenizeRequest)
    check_model(state, req.model)
    vocab = state.engine.model_config.vocab_size
    if req.tokens and max(req.tokens) >= vocab:  # max() in C: a 1M-id list in ~10 ms
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    text = await state.tokenize(lambda tokenizer: state.tokenizers.decode(tokenizer, req.tokens))
    return web.json_response({"prompt": text})


# -- entry point ------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use or a host that does
    not resolve fails in a second, not after minutes of loading. ServerError says why."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        hint = "; choose another --port" if exc.errno == errno.EADDRINUSE else ""
        raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.setblocking(False)
    return sock


class ServerError(RuntimeError):
    """The server cannot start as asked; the message says what to change."""


async def start_site(
    app: web.Application, sock: socket.socket, *, shutdown_timeout: float = SHUTDOWN_GRACE_S
) -> web.AppRunner:
    """Start `app` (its engine and tokenizer pool) and serve it on `sock` (from `bind`), each
    connection watched by the app's ConnectionGuard; `runner.cleanup()` stops it, giving
    in-flight requests `shutdown_timeout` seconds."""
    guard = app[GUARD]
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        **guard.runner_options(),
    )
    await runner.setup()
    try:
        await GuardedSite(runner, sock, guard).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    grace_s: float = SHUTDOWN_GRACE_S,
    sock: socket.socket | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT, then stop accepting, let in-flight requests finish for up
    to `grace_s` (the rest are cancelled, which aborts them) and return 0. `sock`: a socket
    `bind` returned (host and port then only name it); without one, `serve` binds its own."""
    own = sock is None
    sock = bind(host, port) if own else sock
    try:
        runner = await start_site(app, sock, shutdown_timeout=grace_s)
    except BaseException:
        if own:
            sock.close()
        raise
    try:
        for address in runner.addresses:
            host_, port_ = address[:2]
            print(f"serving {app[STATE].model_name} on http://{host_}:{port_}", file=sys.stderr)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        message = f"shutting down: finishing in-flight requests (up to {grace_s:.0f} s)"
        print(message, file=sys.stderr)
    finally:
        await runner.cleanup()
        if own:
            sock.close()
    return 0


def main(args: argparse.Namespace) -> int:
    """`compile-engine serve`: check the settings and take the port, load the engine, serve
    until SIGTERM, return the exit code."""
    from compile_engine.runtime.engine_args import engine_kwargs

    config = EngineConfig(model=args.model, max_waiting=args.max_waiting, **engine_kwargs(args))
    limits = connection_limits(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ServerError("--enable-auto-tool-choice needs --tool-call-parser (hermes, ...)")
    sock = bind(args.host, args.port)
    try:
        engine = start_engine(config)
        app = build_app(
            engine,
            served_model_name=args.served_model_name or [args.model],
            api_key=args.api_key or os.environ.get("COMPILE_ENGINE_API_KEY"),
            limits=limits,
            tokenizer_workers=args.tokenizer_workers,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
        )
        return asyncio.run(serve(app, args.host, args.port, sock=sock))
    finally:
        sock.close()


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The limits `compile-engine serve`'s flags ask for; ServerError if they cannot work."""
    max_connections = args.max_connections
    if max_connections is None:
        max_connections = default_max_connections()
    elif max_connections > file_limit() - FILE_RESERVE:
        raise ServerError(
            f"--max-connections {max_connections} is more than the open-file limit "
            f"(ulimit -n {file_limit()}) leaves for connections ({file_limit() - FILE_RESERVE}); "
            "raise the limit or lower --max-connections"
        )
    if args.tokenizer_workers < 1:
        raise ServerError(f"--tokenizer-workers must be >= 1, got {args.tokenizer_workers}")
    try:
        return ConnectionLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_timeout_s=args.timeout_keep_alive,
            max_connections=max_connections,
        )
    except LimitsError as exc:
        raise ServerError(str(exc)) from None
