"""The OpenAI routes: POST /v1/completions and POST /v1/chat/completions, each answered in
full or streamed over SSE, with logprobs in each endpoint's own shape.

A request becomes SamplingParams here (OpenAI's fields and vLLM's extras, docs/server.md); its
prompts run as one `Run` (runtime/server_stream.py). The tokenizer work a request needs (its
prompts' token ids, a chat template, the text echo shows of a token-id prompt) runs on the
state's tokenizer threads, and the engine gets token ids; token texts come from the app state's
table, never from the tokenizer on the event loop.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from compile_engine.runtime.engine import CompletionOutput, RequestOutput
from compile_engine.runtime.model_runner import TokenLogprobs
from compile_engine.runtime.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from compile_engine.runtime.sampling_params import InvalidSamplingParams, SamplingParams
from compile_engine.runtime.server_common import STATE, State, check_model, read_json
from compile_engine.runtime.server_stream import (
    Choice,
    Run,
    collect,
    stream,
    total_usage,
    usage,
    usage_chunk,
)
from compile_engine.runtime.server_tools import ChatStream, chat_message, structured_spec, tool_plan
from compile_engine.runtime.tokenizer_pool import encode

# Temperatures this small are greedy in effect, and dividing logits by them overflows.
_GREEDY_EPS = 1e-5
# A logprob of -inf is not JSON; OpenAI and vLLM report this floor instead.
_MIN_LOGPROB = -9999.0


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, vocab_size: int, **fields: Any
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
    if any(t >= vocab_size for t in kwargs["stop_token_ids"]):
        raise APIError(
            400,
            f"stop_token_ids must be token ids of this model's vocabulary, in [0, {vocab_size})",
            param="stop_token_ids",
            code="invalid_value",
        )
    if 0 < kwargs.get("temperature", 1.0) < _GREEDY_EPS:  # negative ones are refused below
        kwargs["temperature"] = 0.0
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as exc:
        param = str(exc).split("=", 1)[0]
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def _finite(logprob: float) -> float:
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB


# -- /v1/completions --------------------------------------------------------------------------


def _completion_logprobs(
    state: State,
    token_ids: list[int],
    entries: list[TokenLogprobs | None],
    offset: int,
    k: int,
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy completions logprobs of `token_ids`, whose scores are `entries` (None:
    a token without one, the prompt's first), each with its `k` most likely alternatives plus
    itself; returns it and the text offset after it."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = state.token_text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        top = {state.token_text(t): _finite(lp) for t, lp in entry.top[:k]}
        top.setdefault(text, _finite(entry.logprob))
        top_logprobs.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    return body, offset


def _generated_logprobs(
    state: State, entries: list[TokenLogprobs], offset: int, k: int
) -> tuple[dict[str, Any], int]:
    return _completion_logprobs(state, [e.token_id for e in entries], entries, offset, k)


def _echo_logprobs(state: State, out: RequestOutput, k: int) -> tuple[dict[str, Any], int]:
    """The prompt's part of echoed logprobs, as vLLM answers it: every prompt token scored
    (echo with logprobs asks the engine for prompt logprobs) but the first, which nothing
    precedes: its logprob and top_logprobs are null."""
    scores = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return _completion_logprobs(state, out.prompt_token_ids, scores, 0, k)


def _prompt_logprobs_body(
    state: State, scores: list[TokenLogprobs | None]
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token null (the first) or, by token id, the
    token itself and its most likely alternatives as {logprob, rank, decoded_token}."""

    def item(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        text = state.token_text(token_id)
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}

    body: list[dict[str, Any] | None] = []
    for entry in scores:
        if entry is None:
            body.append(None)
            continue
        by_id = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
        for rank, (t, lp) in enumerate(entry.top, 1):
            by_id.setdefault(str(t), item(t, lp, rank))
        body.append(by_id)
    return body


def _prompt_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt and, with logprobs, its scores (vLLM's
    and the legacy OpenAI API's way to score a text). The engine still samples one token to
    finish the request; the answer leaves it out, from text, logprobs and usage alike."""
    return req.echo and req.max_tokens == 0


def _completion_params(req: CompletionRequest, vocab_size: int) -> SamplingParams:
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400,
            "max_tokens=0 generates nothing: it scores the prompt only, with echo: true (and "
            "logprobs for the scores); otherwise send max_tokens >= 1",
            param="max_tokens",
            code="invalid_value",
        )
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs  # as vLLM: echoed logprobs score the prompt too
    return _sampling_params(
        req,
        vocab_size,
        max_tokens=1 if _prompt_only(req) else req.max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_spec(req),
    )


def _finish(req: CompletionRequest, c: CompletionOutput) -> tuple[str | None, int | str | None]:
    """A choice's finish_reason and stop_reason; a prompt-only one ends at its length."""
    if _prompt_only(req):
        return ("length" if c.finish_reason is not None else None), None
    return c.finish_reason, c.stop_reason


def _completion_choice(
    state: State,
    req: CompletionRequest,
    out: RequestOutput,
    c: CompletionOutput,
    echo: str,
    index: int,
) -> dict[str, Any]:
    """One choice of a full answer; `echo` is the prompt's text when echo is on, else ""."""
    prompt_only = _prompt_only(req)
    logprobs, offset = None, 0
    if req.logprobs is not None and req.echo:
        logprobs, offset = _echo_logprobs(state, out, req.logprobs)
    if req.logprobs is not None and not prompt_only:
        mine, _ = _generated_logprobs(state, c.logprobs or [], offset, req.logprobs)
        logprobs = _merge_logprobs(logprobs, mine) if logprobs else mine
    finish_reason, stop_reason = _finish(req, c)
    text = echo + ("" if prompt_only else c.text)
    body = {"index": index, "text": text, "logprobs": logprobs}
    body |= {"finish_reason": finish_reason, "stop_reason": stop_reason}
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = _prompt_logprobs_body(state, out.prompt_logprobs)
    return body


def _merge_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, CompletionRequest, state.check_prompt_lists)
    check_model(state, req.model)
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
    vocab = state.engine.model_config.vocab_size
    params = _completion_params(req, vocab)
    await state.compile_grammar(params.structured_outputs)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    llm = state.async_llm()
    # echo_texts: what echo shows of each prompt, a string as sent, token ids decoded.
    prompt_ids, echo_texts = await state.completion_prompts(prompts, req.echo)
    run = Run(llm, response_id, len(prompts))
    await run.start(prompt_ids, params, req.cache_salt)
    head = {"id": response_id, "object": "text_completion", "created": created}
    head["model"] = state.model_name

    prompt_only = _prompt_only(req)

    if req.stream:

        def chunks(out: RequestOutput, c: CompletionOutput, choice: Choice) -> list[dict]:
            text, logprobs = ("" if prompt_only else c.delta_text), None
            if not choice.started:
                choice.started = True
                if req.echo:
                    text = echo_texts[run.prompt_index[out.request_id]] + text
                    if want_logprobs:
                        logprobs, choice.text_offset = _echo_logprobs(state, out, req.logprobs)
            if want_logprobs and not prompt_only:
                new = (c.logprobs or [])[choice.num_logprobs :]
                choice.num_logprobs += len(new)
                mine, choice.text_offset = _generated_logprobs(
                    state, new, choice.text_offset, req.logprobs
                )
                logprobs = _merge_logprobs(logprobs, mine) if logprobs else mine
            finish_reason, stop_reason = _finish(req, c)
            # A new token always makes a chunk, even with no text yet (a model without a
            # tokenizer, or a held-back partial character): clients time tokens by chunks.
            if (
                not text
                and (prompt_only or not c.delta_token_ids)
                and not (logprobs and logprobs["tokens"])
                and finish_reason is None
            ):
                return []
            index = run.prompt_index[out.request_id] * req.n + c.index
            body = {"index": index, "text": text, "logprobs": logprobs}
            body |= {"finish_reason": finish_reason, "stop_reason": stop_reason}
            return [head | {"choices": [body]}]

        make_usage = usage_chunk(req, head)
        if prompt_only and make_usage is not None:
            make_usage = functools.partial(_prompt_only_usage, make_usage)
        return await stream(request, run, chunks, make_usage, req.n)

    try:
        final = await collect(run)
    finally:
        run.abort()
    choices = []
    for rid in run.ids:
        out = final[rid]
        echo = echo_texts[run.prompt_index[rid]] if req.echo else ""
        for c in out.outputs:
            choices.append(_completion_choice(state, req, out, c, echo, len(choices)))
    outputs = [final[r] for r in run.ids]
    counts = total_usage(outputs)
    if prompt_only:
        counts = usage(counts["prompt_tokens"], 0)
    return web.json_response(head | {"choices": choices, "usage": counts})


def _prompt_only_usage(make_usage, final: list[RequestOutput]) -> dict[str, Any]:
    chunk = make_usage(final)
    return chunk | {"usage": usage(chunk["usage"]["prompt_tokens"], 0)}


# -- /v1/chat/completions ---------------------------------------------------------------------


def chat_prompt(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: dict[str, Any] | None = None,
    check: Callable[..., None] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt's token ids; `variables` (chat_template_kwargs) reach the template. Run on a
    tokenizer thread (also for /tokenize). The template's text is rendered first and passed to
    `check` (State.check_text, with this tokenizer) before it is tokenized, as
    apply_chat_template(tokenize=True) tokenizes it: without adding special tokens. `tools`
    (OpenAI's) reach the template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools,
            **(variables or {}),
        )  # fmt: skip
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    if check is not None:
        check(text, tokenizer=tokenizer)
    return encode(tokenizer, text, add_special_tokens=False)


def _chat_logprobs(state: State, entries: list[TokenLogprobs], k: int) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = state.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return [
        item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top[:k]]}
        for e in entries
    ]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, ChatCompletionRequest)
    check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    top_k = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else None
    if max_tokens is None:
        max_tokens = req.max_tokens
    plan = tool_plan(req, state.tool_parser, state.enable_auto_tool_choice)
    params = _sampling_params(
        req,
        state.engine.model_config.vocab_size,
        max_tokens=max_tokens,
        logprobs=top_k if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        structured_outputs=plan.spec or structured_spec(req),
    )
    await state.compile_grammar(params.structured_outputs)
    llm = state.async_llm()
    messages = [m.template_dict() for m in req.messages]
    template = functools.partial(
        chat_prompt,
        messages=messages,
        add_generation_prompt=req.add_generation_prompt,
        variables=req.chat_template_kwargs,
        check=functools.partial(state.check_text, param="messages"),
        tools=plan.tools,
    )
    prompt = await state.tokenize(template)
    state.check_prompt_tokens(len(prompt), "messages")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = Run(llm, response_id, 1)
    await run.start([prompt], params, req.cache_salt)
    head = {"id": response_id, "object": "chat.completion", "created": int(time.time())}
    head["model"] = state.model_name
    reasoning = state.reasoning_parser

    if req.stream:
        head["object"] = "chat.completion.chunk"
        streams: dict[int, ChatStream] = {}

        def chunks(out: RequestOutput, c: CompletionOutput, choice: Choice) -> list[dict]:
            result = []
            if not choice.started:
                choice.started = True
                opening = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                opening |= {"logprobs": None, "finish_reason": None}
                result.append(head | {"choices": [opening]})
            parts = streams.setdefault(c.index, ChatStream.start(plan, reasoning))
            deltas = parts.feed(c.delta_text) if c.delta_text else []
            if c.finish_reason is not None:
                deltas += parts.finish()
            logprobs = None
            if req.logprobs:
                new = (c.logprobs or [])[choice.num_logprobs :]
                choice.num_logprobs += len(new)
                if new:
                    logprobs = {"content": _chat_logprobs(state, new, top_k)}
            if not deltas and (logprobs or c.finish_reason is not None):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                finish = _chat_finish(c.finish_reason, parts.called) if last else None
                body = {"index": c.index, "delta": delta, "logprobs": logprobs if i == 0 else None}
                body |= {"finish_reason": finish, "stop_reason": c.stop_reason if last else None}
                result.append(head | {"choices": [body]})
            return result

        return await stream(request, run, chunks, usage_chunk(req, head), req.n)

    try:
        final = await collect(run)
    finally:
        run.abort()
    out = final[run.ids[0]]
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": _chat_logprobs(state, c.logprobs or [], top_k)}
        message, called = chat_message(c.text, plan, reasoning)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _chat_finish(c.finish_reason, called),
                "stop_reason": c.stop_reason,
            }
        )
    body = head | {"choices": choices, "usage": total_usage([out])}
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = _prompt_logprobs_body(state, out.prompt_logprobs)
    return web.json_response(body)


def _chat_finish(reason: str | None, called: bool) -> str | None:
    """ "tool_calls" for an answer that ended by itself with calls (see server_tools.py)."""
    return "tool_calls" if called and reason == "stop" else reason
