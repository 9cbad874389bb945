"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) at the edge: its
pydantic request models and its error shape (STYLE: pydantic only here). Field names and ranges
follow Anthropic's API reference.

As on the OpenAI routes (runtime/protocol.py), JSON types are taken strictly, unknown fields are
ignored, and a field of a feature this server does not implement (tools, extended thinking,
structured outputs, MCP servers, ...) is refused by name unless sent at its "off" value. Text
only: a content block other than text (images, documents, tool use and results, thinking) is a
400 naming where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from compile_engine.runtime.protocol import MAX_STOP, APIError, Int64

# The chat template renders a conversation in one piece on the engine thread; a bound keeps one
# body from holding it on millions of turns.
MAX_MESSAGES = 4096

# Anthropic's error types by HTTP status; the OpenAI-side `type` of an APIError is not reused
# because the names differ (api_error, overloaded_error, request_too_large).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """`error` in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else None)
    return {
        "type": "error",
        "error": {"type": kind or "invalid_request_error", "message": error.message},
    }


class _Model(BaseModel):
    # strict, as runtime/protocol.py's models: "5" is not a number and true is not 1.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}


class TextBlock(_Model):
    # cache_control and citations are accepted and ignored: neither changes the text.
    type: Literal["text"]
    text: str


def _text_blocks(value: Any, what: str) -> Any:
    """One clear reason for content that is neither a string nor text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError(
            "content_type", "{what} must be a string or a list of text blocks", {"what": what}
        )
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_content",
                "{what} block {index} has type {kind}, but this server reads text blocks only "
                "(no images, documents, tool use or results, or thinking)",
                {"what": what, "index": i, "kind": repr(kind)},
            )
        if not isinstance(block.get("text"), str):
            raise PydanticCustomError(
                "text_block",
                "{what} block {index} of type 'text' needs a string 'text'",
                {"what": what, "index": i},
            )
    return value


def _joined(content: str | list[TextBlock]) -> str:
    # Blocks joined by newlines, as the chat route joins text parts.
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return _text_blocks(content, "content")

    def chat_message(self) -> dict[str, str]:
        return {"role": self.role, "content": _joined(self.content)}


class _Conversation(_Model):
    """What a prompt is made of, shared by messages and count_tokens."""

    UNSUPPORTED = {
        "tools": (None, []),
        "tool_choice": (None, {"type": "none"}, {"type": "auto"}),
        "thinking": (None, {"type": "disabled"}),
        "mcp_servers": (None, []),
        "container": (None,),
        "output_format": (None,),
        "output_config": (None, {}),
    }

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    # vLLM's extra: isolates prefix-cache entries between tenants.
    cache_salt: str | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _text_only(cls, system: Any) -> Any:
        return system if system is None else _text_blocks(system, "system")

    @model_validator(mode="after")
    def _ends_with_user(self) -> _Conversation:
        # Anthropic continues a final assistant turn (a prefill); the chat template here would
        # open a new turn after it instead, and answer something else.
        if self.messages[-1].role != "user":
            raise PydanticCustomError(
                "prefill",
                "the last message is the assistant's: continuing a prefilled assistant turn is "
                "not supported by this server; end with a user message",
            )
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        system = (
            [] if self.system is None else [{"role": "system", "content": _joined(self.system)}]
        )
        return system + [m.chat_message() for m in self.messages]


class MessagesRequest(_Conversation):
    max_tokens: Annotated[Int64, Field(ge=1)]
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int64 | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, stops: list[str] | None) -> list[str] | None:
        # An empty stop string would match before every token.
        if stops and any(not s for s in stops):
            raise PydanticCustomError("empty_stop", "a stop sequence is empty")
        return stops


class CountTokensRequest(_Conversation):
    pass
