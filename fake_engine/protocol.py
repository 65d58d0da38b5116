"""OpenAI chat-completions wire shapes for the fake engine: the request it accepts and what it sends.

The request model checks only what the engine needs and lets every other field through, because
routers add their own (SGLang's router sends `no_stop_trim`, `ignore_eos`, `skip_special_tokens`,
`rid`, ...). `max_completion_tokens`, OpenAI's newer name, counts as `max_tokens`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from luftpause.fake_engine.replies import Reply

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class RequestError(ValueError):
    """The body is not a chat-completions request this engine can take; the message says why."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: ToolFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    priority: int | None = None
    """SGLang's request priority; only an engine with priority scheduling on looks at it."""

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def parse_request(data: Any) -> ChatRequest:
    """Validates a decoded JSON body; a `RequestError` names each field that is wrong."""
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        raise RequestError("invalid chat completions request: " + describe(e)) from None


def describe(error: ValidationError) -> str:
    """Each problem as `field.path: what is wrong`, in one line."""
    problems = []
    for err in error.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        problems.append(f"{where}: {err['msg']}")
    return "; ".join(problems)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Envelope:
    """The fields every response object of one request shares: id, created, model, fingerprint."""

    def __init__(self, model: str, fingerprint: str) -> None:
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def _base(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def completion(
        self, reply: Reply, prompt_tokens: int, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        message = reply_message(reply)
        return {
            **self._base("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                    "finish_reason": reply.finish_reason,
                }
            ],
            "usage": usage(prompt_tokens, reply.completion_tokens),
        }

    def chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        with_usage_field: bool = False,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        body = {
            **self._base("chat.completion.chunk"),
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                    "finish_reason": finish_reason,
                }
            ],
        }
        if with_usage_field:
            # OpenAI sends "usage": null on every chunk but the last when usage was asked for.
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            **self._base("chat.completion.chunk"),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }


def reply_message(reply: Reply) -> dict[str, Any]:
    """The assistant message a client appends to its conversation after this reply."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_call is not None:
        message["tool_calls"] = [
            {
                "id": reply.tool_call.id,
                "type": "function",
                "function": {"name": reply.tool_call.name, "arguments": reply.tool_call.arguments},
            }
        ]
    return message


def delta_for_range(reply: Reply, start: int, end: int) -> dict[str, Any]:
    """The stream delta that carries the reply's tokens `start` to `end` (one chunk of the stream)."""
    pieces = reply.pieces[start:end]
    call = reply.tool_call
    if call is None:
        return {"content": "".join(pieces)}
    if start == 0:
        # The first piece of a tool call is its name; arguments follow in later pieces.
        return {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": "".join(pieces[1:])},
                }
            ]
        }
    return {"tool_calls": [{"index": 0, "function": {"arguments": "".join(pieces)}}]}
