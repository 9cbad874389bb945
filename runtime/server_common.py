"""What every route of the server shares: the app's state, reading a request's JSON body, the
model check, and the errors that more than one module raises.

The event loop never calls the tokenizer (runtime/server.py says why); `State.token_text` reads
the table of single-token texts that `token_texts` builds on the engine thread at start-up.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from compile_engine.runtime.async_engine import AsyncLLM
from compile_engine.runtime.engine import LLMEngine
from compile_engine.runtime.protocol import APIError, refuse_unsupported, validation_error

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# JSON can escape a lone UTF-16 surrogate ("\ud800"), which json.loads turns into a str that no
# tokenizer or UTF-8 encoder takes. Bodies without such an escape skip the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

STATE = web.AppKey("state", "State")
_M = TypeVar("_M", bound=BaseModel)


class State:
    """What the handlers of one app share."""

    def __init__(
        self, engine: LLMEngine, model_names: list[str], api_key: str | None, max_body_bytes: int
    ) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # what responses carry
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        # Both set by the app's start-up, on the running loop and the engine thread.
        self.llm: AsyncLLM | None = None
        self.token_texts: list[str] = []

    def async_llm(self) -> AsyncLLM:
        """The running AsyncLLM; a 503 before the app has started it."""
        if self.llm is None:
            raise APIError(503, "the engine is starting", type="server_error", code="starting")
        return self.llm

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, what logprobs report."""
        return self.token_texts[token_id]


def token_texts(engine: LLMEngine) -> list[str]:
    """Every token id's text decoded on its own; run on the engine thread. A table of the
    whole vocabulary (0.1-0.2 s and 3 MB for SmolLM2's 49k on the 2-core CPU) keeps logprobs off
    the tokenizer, where a per-request decode would wait for the engine thread's current step.
    Ids the tokenizer does not know (a padded embedding) decode to ""."""
    tokenizer = engine.tokenizer
    size = max(len(tokenizer), engine.model_config.vocab_size)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(size)]


def internal_error() -> APIError:
    return APIError(
        500,
        "the server hit an internal error; it is logged on the server",
        type="server_error",
        code="internal_error",
    )


def too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes"


async def read_json(request: web.Request, model: type[_M]) -> _M:
    """The body as `model`: a 413 beyond the size limit, a 400 naming the field otherwise."""
    state = request.app[STATE]
    limit = state.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, too_large_message(limit), code="request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, too_large_message(limit), code="request_too_large") from None
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


def check_model(state: State, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        served = ", ".join(repr(name) for name in state.model_names)
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
