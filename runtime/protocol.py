"""The OpenAI API at the edge: pydantic request models and the error shape (STYLE: pydantic only
here). Field names and defaults follow OpenAI's API reference; the extras (top_k, min_p,
repetition_penalty, ignore_eos, cache_salt, ...) follow vLLM's names so existing clients work.

Unknown fields are ignored, as vLLM does, so that clients sending newer OpenAI fields still get
an answer; the exception is a field this server does not implement and whose absence would change
what the answer means (logit_bias, beam search, ...): each request model lists those in
`UNSUPPORTED`, and `refuse_unsupported` turns one that is switched on into a 400 naming it. Range
checks that SamplingParams already makes are not repeated here: its typed error names the field
and the server turns it into a 400. What is checked here is what would otherwise reach torch as
garbage: types (strictly, as OpenAI does: "5" is not a number and true is not 1), NaN/inf, and
integers beyond int64.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# torch.Generator.manual_seed and torch.long tensors take int64.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# One request fans out into n sequences with their own KV; a bound keeps a single body from
# queueing an unbounded number of them.
MAX_N = 64
MAX_PROMPTS = 64
# Every stop string is searched for after every token, in the engine's one thread: a list of
# 150k of them from one client doubled the latency of every other request on the server.
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 1024  # a model's special tokens fit many times over
MAX_TOOLS = 128  # OpenAI's bound
MAX_CHOICES = 1024  # guided_choice's; runtime/sampling_params.py checks structured_outputs'

Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]


class _Model(BaseModel):
    # strict: JSON types are taken as sent (a float field still takes an integer). Lax mode would
    # read max_tokens "5" as 5, true as 1, and stream "yes" as true.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    # Field -> the values that mean "off"; any other value is refused (see refuse_unsupported).
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}


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
    # Looked up after every token like the stop strings; ids are vocabulary indices.
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    # vLLM's: score the prompt, each token with its logprob and this many alternatives.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo):
        # As OpenAI and vLLM: usage in a last chunk means nothing without chunks.
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "stream_options", "stream_options needs stream: true; leave it out otherwise"
            )
        return options

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        # As vLLM: a stream has no place for them (0 asks for none, so it passes).
        if value and info.data.get("stream"):
            raise PydanticCustomError(
                "prompt_logprobs_stream",
                "prompt_logprobs are not available with stream: true; leave them out, or use "
                "echo with logprobs on /v1/completions, whose first chunk carries the prompt's",
            )
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise PydanticCustomError(
                "too_many_stops",
                "at most {limit} stop strings per request, got {count}",
                {"limit": MAX_STOP, "count": len(stop)},
            )
        return stop

    # Structured output (runtime/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise PydanticCustomError(
                "json_schema", "response_format of type json_schema needs json_schema.schema"
            )
        return self


# Generation features of OpenAI's API or vLLM's extras that this engine does not implement.
_UNSUPPORTED_SAMPLING: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
}


class CompletionRequest(_SamplingFields):
    UNSUPPORTED = _UNSUPPORTED_SAMPLING

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One message for a prompt of none of the four shapes, naming what is wrong, instead
        of the union's one complaint per shape it tried."""
        shapes = (
            "a string, a list of strings, a list of token ids (integers >= 0), or a list of "
            "such lists"
        )
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("prompt_shape", f"the prompt must be {shapes}")
        if all(isinstance(item, str) for item in value):  # an empty one too: "is empty", later
            return value
        batches = value if all(isinstance(item, list) for item in value) else [value]
        for b, ids in enumerate(batches):
            for i, token in enumerate(ids):
                where = f"prompt[{b}][{i}]" if batches is value else f"prompt[{i}]"
                if type(token) is not int:
                    raise PydanticCustomError(
                        "prompt_shape", f"{where} is {token!r}: the prompt must be {shapes}"
                    )
                if token < 0:
                    raise PydanticCustomError(
                        "prompt_shape", f"{where} is {token}: token ids are integers >= 0"
                    )
        return value

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


class FunctionCall(_Model):
    name: str
    arguments: str  # a JSON object, as the model wrote it


class ToolCallItem(_Model):
    """A call an earlier assistant turn made, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# OpenAI's roles. Another role would reach the chat template as is and be rendered as a speaker
# the model has never seen.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Model):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    # The deprecated single function call: accepted only empty.
    function_call: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """One clear reason for bad content, rather than pydantic's per-union-member list."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise PydanticCustomError(
                "content_type", "content must be a string or a list of text parts"
            )
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "unsupported_content",
                    "content part {index} has type {kind}, but this server's model reads text "
                    "only; send the text as a string or as parts of type 'text'",
                    {"index": i, "kind": repr(kind)},
                )
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "text_part",
                    "content part {index} of type 'text' needs a string 'text'",
                    {"index": i},
                )
        return content

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value:
            raise PydanticCustomError(
                "unsupported",
                "function_call (deprecated by OpenAI) is not supported; send tool_calls",
            )
        return value

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # Only an assistant turn may lack content (OpenAI allows it beside tool calls).
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError(
                "missing_content", "a {role} message needs content", {"role": self.role}
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message has tool_calls")
        return self

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM joins them
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates index the arguments (Qwen's `tool_call.arguments | tojson`, Llama's
            # items()), so they get the object, as vLLM gives it; text that is not a JSON
            # object stays text.
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call)},
                }
                for call in self.tool_calls
            ]
        return message


def _arguments(call: ToolCallItem) -> Any:
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ToolChoiceFunction


# apply_chat_template's own arguments, which a template variable must not replace.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's chat_template_kwargs: extra variables for the chat template (Qwen3's
    enable_thinking, for one)."""
    clash = sorted(set(kwargs or ()) & _TEMPLATE_ARGUMENTS)
    if clash:
        raise PydanticCustomError(
            "template_argument",
            "{names} is an argument of the chat template call, not a template variable; set it "
            "with the request's own field or leave it out",
            {"names": ", ".join(clash)},
        )
    return kwargs


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_variables)]


class ChatCompletionRequest(_SamplingFields):
    UNSUPPORTED = _UNSUPPORTED_SAMPLING | {
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "echo": (None, False),
        "continue_final_message": (None, False),
        "chat_template": (None,),
        "documents": (None, []),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None


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


def refuse_unsupported(body: dict[str, Any], model: type[_Model]) -> None:
    """Raise a 400 naming the first field of `model.UNSUPPORTED` that `body` switches on."""
    for name, off in model.UNSUPPORTED.items():
        if name in body and body[name] not in off:
            hint = " or ".join(json.dumps(v) for v in off if v is not None)
            raise APIError(
                400,
                f"{name} is not supported by this server; leave it out"
                + (f" or set it to {hint}" if hint else ""),
                param=name,
                code="unsupported",
            )


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
