"""What every route of the server shares: the app's state, reading a request's JSON body, the
model check, the prompt length checks, and the errors that more than one module raises.

The event loop never calls the tokenizer (runtime/server.py says why): tokenizer work runs on the
state's TokenizerPool (runtime/tokenizer_pool.py), and `State.token_text` reads the table of
single-token texts that `token_texts` builds on the engine thread at start-up. A text whose size
alone proves that it cannot fit in max_model_len is refused before anything tokenizes it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from compile_engine.runtime.async_engine import AsyncLLM
from compile_engine.runtime.engine import LLMEngine
from compile_engine.runtime.protocol import (
    MAX_PROMPTS,
    APIError,
    refuse_unsupported,
    validation_error,
)
from compile_engine.runtime.reasoning_parsers import reasoning_parser
from compile_engine.runtime.sampling_params import StructuredOutputsParams
from compile_engine.runtime.structured_output import GrammarError
from compile_engine.runtime.tokenizer_pool import TokenizerPool, encode, min_tokens
from compile_engine.runtime.tool_parsers import ToolParser

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Characters of a long text's prefix counted per token it may have: English runs ~4-5 a token,
# so this prefix usually proves a text too long; where it does not, the whole text is encoded.
PREFIX_CHARS = 8
# JSON can escape a lone UTF-16 surrogate ("\ud800"), which json.loads turns into a str that no
# tokenizer or UTF-8 encoder takes. Bodies without such an escape skip the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

STATE = web.AppKey("state", "State")
_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")


class State:
    """What the handlers of one app share."""

    def __init__(
        self,
        engine: LLMEngine,
        model_names: list[str],
        api_key: str | None,
        max_body_bytes: int,
        *,
        tool_parser: type[ToolParser] | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # what responses carry
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        # Set by the app's start-up, on the running loop and the engine thread.
        self.llm: AsyncLLM | None = None
        self.token_texts: list[str] = []
        self.tokenizers: TokenizerPool | None = None
        # At most how many bytes of text one token stands for (None: no sound bound).
        self.bytes_per_token: int | None = None
        # Tools and reasoning (runtime/server_tools.py): build_app's settings.
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        name = engine.config.reasoning_parser
        self.reasoning_parser = reasoning_parser(name) if name is not None else None

    async def compile_grammar(self, spec: StructuredOutputsParams | None) -> None:
        """Compile a request's grammar on the grammar threads, before the engine sees it (which
        then finds it compiled); a 400 naming the field when it cannot be compiled in time."""
        if spec is None:
            return
        compiler = self.engine.structured.compiler
        try:
            await asyncio.wrap_future(compiler.vocabulary())  # once; outside the time limit
            future = compiler.submit(spec)
            await asyncio.wait_for(asyncio.wrap_future(future), compiler.timeout_s)
        except TimeoutError:
            raise _grammar_error(compiler.timeout_error(spec)) from None
        except GrammarError as exc:
            raise _grammar_error(exc) from None

    def async_llm(self) -> AsyncLLM:
        """The running AsyncLLM; a 503 before the app has started it."""
        if self.llm is None:
            raise APIError(503, "the engine is starting", type="server_error", code="starting")
        return self.llm

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, what logprobs report."""
        return self.token_texts[token_id]

    async def tokenize(self, fn: Callable[[Any], _T]) -> _T:
        """`fn(tokenizer)` on a tokenizer thread; a 400 for a model without a tokenizer."""
        if self.tokenizers is None:
            raise APIError(400, "this model has no tokenizer")
        return await self.tokenizers.run(fn)

    def check_text(
        self, text: str, param: str, *, room: int = 1, tokenizer: Any | None = None
    ) -> None:
        """Refuse `text` if it is provably more than max_model_len - `room` tokens (room 1: a
        prompt must leave a token to generate). By its characters always (O(1), for the event
        loop); given `tokenizer` (a worker's, on its thread), by its UTF-8 bytes (O(n)) and by
        the count of a prefix of about 8 characters a token (O(max_model_len), where the whole
        encode is O(n)), so that refusing a huge text never costs tokenizing all of it."""
        limit = self.engine.max_model_len - room
        if self.bytes_per_token is not None:
            self._check_size(len(text), "characters", param, room)
            if tokenizer is not None:
                self._check_size(len(text.encode(errors="surrogatepass")), "bytes", param, room)
        if tokenizer is None or self.tokenizers is None:
            return
        counted = self.tokenizers.count_prefix(tokenizer, text, PREFIX_CHARS * (limit + 1))
        if counted is not None and counted[0] > limit:
            least, cut = counted
            raise APIError(
                400,
                f"this model's maximum context length is {self.engine.max_model_len} tokens, "
                f"and {param}'s first {cut:,} characters alone are at least {least:,} tokens; "
                "shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def _check_size(self, size: int, unit: str, param: str, room: int) -> None:
        least = min_tokens(size, self.bytes_per_token)
        limit = self.engine.max_model_len
        if least > limit - room:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, and {param} is "
                f"{size:,} {unit}, at least {least:,} tokens; shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt_lists(self, body: dict[str, Any]) -> None:
        """Before a completions body is validated: refuse a token-id prompt (or a batch's) of
        max_model_len ids or more by its length alone. Validating millions of ids against the
        prompt's union of types holds the GIL for seconds (2M ids: 0.95 s), stalling the engine
        thread; a list longer than a batch can be is a token-id prompt or invalid."""
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return
        if len(prompt) > MAX_PROMPTS:
            if type(prompt[0]) is int:
                self.check_prompt_tokens(len(prompt), "prompt")
            return
        for item in prompt:
            if isinstance(item, list):
                self.check_prompt_tokens(len(item), "prompt")

    def check_prompt_tokens(self, num_tokens: int, param: str) -> None:
        """Refuse a prompt that leaves no token to generate, before the engine sees it: the
        engine would refuse it too, after O(prompt) work on its thread."""
        limit = self.engine.max_model_len
        if num_tokens >= limit:
            raise APIError(
                400,
                f"the prompt has {num_tokens:,} tokens, which leaves no room to generate within "
                f"max_model_len={limit}; shorten the prompt to at most {limit - 1} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def completion_prompts(
        self, prompts: list[str | list[int]], echo: bool
    ) -> tuple[list[list[int]], list[str]]:
        """Each prompt's token ids (strings encoded with special tokens, as the engine would)
        and, with `echo`, its text (token ids decoded), from one job on a tokenizer thread."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text(prompt, "prompt")
            else:
                self.check_prompt_tokens(len(prompt), "prompt")
        if not echo and not any(isinstance(p, str) for p in prompts):
            return [list(p) for p in prompts], []

        def job(tokenizer: Any) -> tuple[list[list[int]], list[str]]:
            ids, texts = [], []
            for prompt in prompts:
                if isinstance(prompt, str):
                    self.check_text(prompt, "prompt", tokenizer=tokenizer)
                    ids.append(encode(tokenizer, prompt, add_special_tokens=True))
                    texts.append(prompt)
                else:
                    ids.append(list(prompt))
                    texts.append(self.tokenizers.decode(tokenizer, prompt) if echo else "")
            return ids, texts

        ids, texts = await self.tokenize(job)
        for prompt_ids in ids:
            self.check_prompt_tokens(len(prompt_ids), "prompt")
        return ids, texts if echo else []


def token_texts(engine: LLMEngine) -> list[str]:
    """Every token id's text decoded on its own; run on the engine thread. A table of the
    whole vocabulary (0.1-0.2 s and 3 MB for SmolLM2's 49k on the 2-core CPU) keeps logprobs off
    the tokenizer, where a per-request decode would wait for the engine thread's current step.
    Ids the tokenizer does not know (a padded embedding) decode to ""."""
    tokenizer = engine.tokenizer
    size = max(len(tokenizer), engine.model_config.vocab_size)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(size)]


def _grammar_error(exc: GrammarError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code="invalid_value")


def internal_error() -> APIError:
    return APIError(
        500,
        "the server hit an internal error; it is logged on the server",
        type="server_error",
        code="internal_error",
    )


def too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes"


async def read_json(
    request: web.Request,
    model: type[_M],
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> _M:
    """The body as `model`: a 413 beyond the size limit, a 400 naming the field otherwise.
    `precheck` sees the parsed object before it is validated."""
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
    if precheck is not None:
        precheck(body)
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
