"""The Responses API (POST /v1/responses) at the edge: its pydantic request model (STYLE: pydantic
only here). Field names and defaults follow OpenAI's API reference.

As for the other OpenAI routes (runtime/protocol.py), JSON types are taken strictly, unknown
fields are ignored, and a field of a feature this server does not implement is refused by name
unless sent at its "off" value: `UNSUPPORTED` lists the simple ones; `text` (a format other than
plain text) and `reasoning` (any setting) are checked by `ResponsesRequest.refuse_unsupported`,
since their "off" values are open-ended. Text only: an input item other than a message, or a
content part other than text, is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from compile_engine.runtime.protocol import APIError, Int64

# A conversation is rendered by the chat template in one piece; a bound keeps one body from
# holding the engine thread on a template of millions of turns.
MAX_INPUT_ITEMS = 4096


class _Model(BaseModel):
    # strict, as runtime/protocol.py's models: "5" is not a number and true is not 1.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}


class TextPart(_Model):
    """input_text in a turn of the conversation, output_text in an assistant turn sent back."""

    type: Literal["input_text", "output_text"]
    text: str


_TEXT_PARTS = ("input_text", "output_text")


class InputMessage(_Model):
    """A message item: OpenAI's short form {role, content} or the full item; an output message
    sent back also carries id and status, which are accepted and ignored."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """One clear reason for bad content, rather than pydantic's list per union member."""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise PydanticCustomError(
                "content_type", "content must be a string or a list of input_text parts"
            )
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS:
                raise PydanticCustomError(
                    "unsupported_content",
                    "content part {index} has type {kind}, but this server's model reads text "
                    "only; send parts of type 'input_text' (or 'output_text' in an assistant "
                    "turn)",
                    {"index": i, "kind": repr(kind)},
                )
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "text_part", "content part {index} needs a string 'text'", {"index": i}
                )
        return content

    def chat_message(self) -> dict[str, str]:
        """The turn as the chat template takes it; parts joined by newlines, as the chat route
        joins them."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ResponsesRequest(_Model):
    UNSUPPORTED = {
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),
        "include": (None, []),
        "top_logprobs": (None, 0),
        "truncation": (None, "disabled"),
        "background": (None, False),
        "conversation": (None,),
        "prompt": (None,),
        "max_tool_calls": (None,),
    }

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: Annotated[Int64, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extra: isolates prefix-cache entries between tenants.
    cache_salt: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_only(cls, value: Any) -> Any:
        """Name the first item that is not a message (tool calls and outputs, reasoning, item
        references), rather than pydantic's complaint about each union member."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError(
                "input_type", "input must be a string or a list of message items"
            )
        if not value:
            raise PydanticCustomError("empty_input", "input is an empty list; send a message")
        if len(value) > MAX_INPUT_ITEMS:
            raise PydanticCustomError(
                "too_many_items",
                "at most {limit} input items per request, got {count}",
                {"limit": MAX_INPUT_ITEMS, "count": len(value)},
            )
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind != "message":
                raise PydanticCustomError(
                    "unsupported_item",
                    "input item {index} has type {kind}; this server takes message items only "
                    "(it does not implement tools or reasoning)",
                    {"index": i, "kind": repr(kind)},
                )
        return value

    def messages(self) -> list[dict[str, str]]:
        """The input as chat turns: a string is one user message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [item.chat_message() for item in self.input]

    def refuse_unsupported(self) -> None:
        """The two fields whose "off" value is a whole family: a text format other than plain
        text (structured outputs), and any reasoning setting."""
        text_format = (self.text or {}).get("format")
        if text_format is not None and text_format != {"type": "text"}:
            raise APIError(
                400,
                "text.format other than {'type': 'text'} (structured outputs) is not supported "
                "by this server; leave it out",
                param="text",
                code="unsupported",
            )
        if any(value is not None for value in (self.reasoning or {}).values()):
            raise APIError(
                400,
                "reasoning is not supported by this server; leave it out",
                param="reasoning",
                code="unsupported",
            )
