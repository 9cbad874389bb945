"""The OpenAI API at the edge: pydantic request models and the error shape (STYLE: pydantic only
here). Field names and defaults follow OpenAI's API reference; the extras (top_k, min_p,
repetition_penalty, ignore_eos, cache_salt, ...) follow vLLM's names so existing clients work.

Unknown fields are ignored, as vLLM does, so that clients sending newer OpenAI fields still get
an answer. Range checks that SamplingParams already makes are not repeated here: its typed
error names the field and the server turns it into a 400. What is checked here is what would
otherwise reach torch as garbage: types, NaN/inf, and integers beyond int64.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# torch.Generator.manual_seed and torch.long tensors take int64.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# One request fans out into n sequences with their own KV; a bound keeps a single body from
# queueing an unbounded number of them.
MAX_N = 64
MAX_PROMPTS = 64

Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingFields(_Model):
    """Fields both generation endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (OpenAI accepts one or a batch of either kind)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]  # an empty token list; the engine rejects it with a clear message
        if isinstance(p[0], list):
            return list(p)
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


# -- errors ---------------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client caused or can act on; the server answers it in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first offending field, e.g. `max_tokens: Input should be ...`."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    # The top-level field is the `param`; the full path (which for unions includes the member
    # type tried, e.g. `prompt.list[int].0`) goes into the message.
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    message = f"{'.'.join(loc)}: {first['msg']}" if loc else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value")
