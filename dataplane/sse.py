"""Reading an engine's reply on the side: first token, usage, finish reason, tool-call ids.

The bytes the engine sends go to the client untouched; `StreamObserver` only looks at a copy of
each chunk as it passes, splitting it into server-sent-event lines and decoding the JSON of each
`data:` event to learn what the scheduler needs to know about the turn. `observe_completion` does
the same for a reply that was not streamed. Neither ever re-encodes anything, and neither raises
on a payload it does not understand: a reply we cannot read is still the client's reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_DATA = b"data:"
_DONE = b"[DONE]"
# What in a delta counts as the model having produced its first token: text, a tool call, or
# the reasoning some engines stream ahead of the text.
_TOKEN_FIELDS = ("content", "tool_calls", "reasoning_content", "reasoning")


@dataclass
class ReplyObservation:
    """What a reply says about its turn."""

    first_token: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_call_ids: list[str] = field(default_factory=list)
    # An error the engine reported inside a 200 reply (some engines do, mid-stream).
    error: str = ""
    # The stream's closing `data: [DONE]` arrived.
    done: bool = False

    @property
    def finished(self) -> bool:
        """Whether the reply ran to its end rather than breaking off."""
        return not self.error and (self.done or bool(self.finish_reason))

    def _note_choice(self, choice: Any, part: str) -> None:
        if not isinstance(choice, dict):
            return
        body = choice.get(part)
        if isinstance(body, dict):
            if any(body.get(name) for name in _TOKEN_FIELDS):
                self.first_token = True
            tool_calls = body.get("tool_calls")
            if isinstance(tool_calls, list):
                for call in tool_calls:
                    # In a stream only a call's first fragment carries its id.
                    call_id = call.get("id") if isinstance(call, dict) else None
                    if isinstance(call_id, str) and call_id and call_id not in self.tool_call_ids:
                        self.tool_call_ids.append(call_id)
        reason = choice.get("finish_reason")
        # With several choices, one ending in tool calls is what decides whether the run pauses.
        if isinstance(reason, str) and reason and self.finish_reason != "tool_calls":
            self.finish_reason = reason

    def _note_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                self.prompt_tokens = prompt
            if isinstance(completion, int):
                self.completion_tokens = completion

    def _note_error(self, error: Any) -> None:
        if error:
            message = error.get("message") if isinstance(error, dict) else None
            self.error = message if isinstance(message, str) and message else json.dumps(error)

    def note_payload(self, payload: Any, part: str) -> None:
        """Takes in one decoded chunk (`part` "delta") or whole reply (`part` "message")."""
        if not isinstance(payload, dict):
            return
        choices = payload.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                self._note_choice(choice, part)
        self._note_usage(payload.get("usage"))
        self._note_error(payload.get("error"))


class StreamObserver:
    """Follows a streamed chat completion chunk by chunk, as the bytes pass to the client."""

    def __init__(self) -> None:
        self.observation = ReplyObservation()
        self._pending = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> bool:
        """Reads one chunk; returns True when this chunk carried the reply's first token."""
        had_token = self.observation.first_token
        buffered = self._pending + chunk
        lines = buffered.splitlines(keepends=True)
        self._pending = b""
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            # An unfinished line, or one ending in "\r" whose "\n" may open the next chunk:
            # keep it until the rest arrives.
            self._pending = lines.pop()
        for line in lines:
            self._line(line.rstrip(b"\r\n"))
        return self.observation.first_token and not had_token

    def close(self) -> ReplyObservation:
        """Ends the stream: reads what is left of it and returns what was observed."""
        if self._pending:
            self._line(self._pending.rstrip(b"\r\n"))
            self._pending = b""
        self._line(b"")
        return self.observation

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                self._take(b"\n".join(self._data))
                self._data = []
        elif line.startswith(_DATA):
            value = line[len(_DATA) :]
            value = value[1:] if value.startswith(b" ") else value
            # Engines put each event's JSON on one data line; reading it at once reports the
            # first token without waiting for the blank line, and copes with streams that never
            # send one. Only a line that does not parse alone waits for the rest of its event.
            if self._data or not self._take(value):
                self._data.append(value)
        # Comments (":"), event names, ids and retry fields say nothing about the turn.

    def _take(self, data: bytes) -> bool:
        """Reads one event's data; False when it is not (yet) a whole JSON value."""
        if data.strip() == _DONE:
            self.observation.done = True
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return False
        self.observation.note_payload(payload, "delta")
        return True


def observe_completion(body: bytes) -> ReplyObservation:
    """What a non-streamed chat completion says about its turn."""
    observation = ReplyObservation()
    try:
        payload = json.loads(body)
    except ValueError:
        return observation
    observation.note_payload(payload, "message")
    return observation
