"""A streamed chat completion put back together: the chunks of an SSE reply in, the whole reply out.

The runtime streams its turns so that the dataplane, and through it the scheduler, sees each
turn's first token as it comes (scheduler/admission.py: a placed turn counts against its
engine's lookahead until something shows the engine started it). Everything after the client
wants the reply whole, in the shape of a completion that was not streamed, so
`CompletionStream` takes the stream's lines one by one and `completion()` gives that shape:

- each choice's deltas joined in order: text fields (`content`, `reasoning_content`, ...)
  concatenated, `role` kept, tool calls gathered by their `index` (a call's first fragment
  carries its id, type and name; the rest append to its arguments), the last finish reason and
  logprobs kept;
- `usage` from the chunk that carries it (the last one, with `stream_options.include_usage`);
- `id`, `created`, `model` and `system_fingerprint` from the first chunk that names them.

A reply with tool calls and no text has `content` None, as a reply not streamed has. An event
that carries an error (`{"error": {...}}`, as engines send mid-stream) raises `StreamError`
with its message. `finished` says whether the reply ended as a reply ends (a finish reason or
the closing `[DONE]`) rather than breaking off. Each event's JSON is read as soon as its `data:`
line is whole, and a line that is not JSON on its own waits for the rest of its event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_DONE = "[DONE]"
_FIRST_NAMED = ("id", "created", "model", "system_fingerprint")


class StreamError(Exception):
    """The stream carried an error event; the message is the error's."""


@dataclass
class _Call:
    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: Any = ""

    def part(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class _Choice:
    role: str = "assistant"
    texts: dict[str, list[str]] = field(default_factory=dict)
    others: dict[str, Any] = field(default_factory=dict)
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: str | None = None
    logprobs: list[Any] | None = None

    def take(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key, value in delta.items():
                if key == "role":
                    if isinstance(value, str) and value:
                        self.role = value
                elif key == "tool_calls":
                    for part in value if isinstance(value, list) else ():
                        if isinstance(part, dict):
                            self._take_call(part)
                elif isinstance(value, str):
                    self.texts.setdefault(key, []).append(value)
                elif value is not None:
                    self.others[key] = value
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.finish_reason = reason
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs["content"])

    def _take_call(self, part: dict[str, Any]) -> None:
        index = part.get("index")
        if not isinstance(index, int):
            # No index: a fragment of the last call, unless it opens a call with an id of its own.
            last = max(self.calls, default=None)
            if last is None or (part.get("id") and part.get("id") != self.calls[last].id):
                index = len(self.calls)
            else:
                index = last
        call = self.calls.setdefault(index, _Call())
        if isinstance(part.get("id"), str) and part["id"] and not call.id:
            call.id = part["id"]
        if isinstance(part.get("type"), str) and part["type"]:
            call.type = part["type"]
        function = part.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                call.name += function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call.arguments = (call.arguments if isinstance(call.arguments, str) else "") + arguments
            elif arguments is not None:
                call.arguments = arguments  # an object, as some servers send: calls_in copes

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, **self.others}
        for key, parts in self.texts.items():
            message[key] = "".join(parts)
        if self.calls:
            message["tool_calls"] = [self.calls[i].part() for i in sorted(self.calls)]
            if not message.get("content"):
                message["content"] = None
        message.setdefault("content", None)
        return message


class CompletionStream:
    """One streamed reply being read; feed it the stream's lines, then ask for `completion()`."""

    def __init__(self) -> None:
        self.done = False
        self._named: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._data: list[str] = []

    @property
    def finished(self) -> bool:
        """Whether the reply ended as a reply ends, not broken off."""
        return self.done or any(c.finish_reason for c in self._choices.values())

    def feed_line(self, line: str) -> None:
        """Takes one line of the stream (without its line ending); raises `StreamError`."""
        if not line:
            self._flush()
        elif line.startswith("data:"):
            value = line[5:]
            value = value[1:] if value.startswith(" ") else value
            if self._data or not self._take(value):
                self._data.append(value)
        # Comments (":"), event names, ids and retry fields carry nothing of the reply.

    def close(self) -> None:
        """The stream ended: reads what is left of its last event."""
        self._flush()

    def completion(self) -> dict[str, Any]:
        """The reply in the shape of a chat completion that was not streamed."""
        reply: dict[str, Any] = {"object": "chat.completion", **self._named}
        reply["choices"] = [
            {
                "index": index,
                "message": choice.message(),
                "logprobs": None if choice.logprobs is None else {"content": choice.logprobs},
                "finish_reason": choice.finish_reason,
            }
            for index, choice in sorted(self._choices.items())
        ]
        if self._usage is not None:
            reply["usage"] = self._usage
        return reply

    def _flush(self) -> None:
        if self._data:
            data, self._data = "\n".join(self._data), []
            self._take(data)

    def _take(self, data: str) -> bool:
        """Reads one event's data; False when it is not (yet) a whole JSON value."""
        if data.strip() == _DONE:
            self.done = True
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return False
        if not isinstance(payload, dict):
            return True
        error = payload.get("error")
        if error:
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(message if isinstance(message, str) and message else json.dumps(error))
        for key in _FIRST_NAMED:
            if payload.get(key) is not None:
                self._named.setdefault(key, payload[key])
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict):
                index = choice.get("index")
                self._choices.setdefault(index if isinstance(index, int) else 0, _Choice()).take(choice)
        return True
