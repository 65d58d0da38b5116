"""Reading an engine's reply on the side: first token, usage, finish reason, tool-call ids.

The bytes the engine sends go to the client untouched (but for usage the client did not ask
for, below); `StreamObserver` looks at them as they pass, splitting them into server-sent-event lines and decoding the JSON of a `data:` event
to learn what the scheduler needs to know about the turn. Most events of a stream are one more
token and say nothing new once the first token is known, so after it a byte scan decides which
events are worth decoding: those with a finish reason or usage that is not null, tool calls, an
error, or `[DONE]`; a chunk made only of other events is not even split into lines.
`observe_completion` reads a reply that was not streamed.

What they do not understand in a reply that is otherwise a reply (an unknown key, a choice of
an odd shape, a usage out of range) they pass over: that reply is still the client's. What is
not a reply at all is the engine failing (issue 29: a replica that streamed garbage had it
relayed and counted completed): a non-streamed body that is not a JSON object
(`ReplyObservation.unreadable`), and a stream with a line that is not a server-sent-event line
(a `data:`, `event:`, `id:` or `retry:` field, a `:` comment, or blank), an event whose data is
not JSON (or `[DONE]`), or a line longer than MAX_LINE_BYTES: `feed` and `close` raise
`NotAnEventStream` at the first such line, before the chunk that holds it is passed on. The
check costs the token-only chunks nothing they did not cost already, but for one: such a chunk
must begin with `data:` to be passed unsplit; a garbled event amid whole token events in one
chunk is not looked for.

For a turn whose usage the dataplane asked of the engine and the client did not (`usage`), the
observer also says what of the stream goes on to the client (`hide_usage`, then `take`): all of
it but the usage-only event (`choices` empty, a `usage` object), which is dropped with the blank
line that ends it, and the `usage` member of an event that carries choices too, which alone is
encoded anew. The usage events are among those decoded anyway, so this costs the other events
nothing but being handed on; only a line the engine split across reads is held until its end
arrives, which a client could not have read any sooner. Two things pass unchanged: `"usage":
null`, which the OpenAI API writes on every chunk once usage is asked for (and SGLang always):
the same to every client as no usage, and taking it out would cost a rewrite of every chunk;
and an event whose JSON spans several `data:` lines, which no engine sends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from luftpause import counts
from luftpause.dataplane.body import encoded

_DATA = b"data:"
_DONE = b"[DONE]"
# What in a delta counts as the model having produced its first token: text, a tool call, or
# the reasoning some engines stream ahead of the text.
_TOKEN_FIELDS = ("content", "tool_calls", "reasoning_content", "reasoning")
# Keys whose mere presence makes an event worth decoding, and keys engines send in every event,
# as null until they have a value.
_ALWAYS_READ = (b"[DONE]", b'"tool_calls"', b'"error"')
_READ_UNLESS_NULL = (b'"finish_reason"', b'"usage"')
_JSON_SPACE = b" \t\r\n"
# The fields a server-sent event may carry (a line may also be blank, or a ":" comment).
_FIELDS = (b"data", b"event", b"id", b"retry")
# The longest line (or event's data) of a stream; no engine's event comes near.
MAX_LINE_BYTES = 8 * 1024 * 1024


class NotAnEventStream(ValueError):
    """A streamed reply that is not a stream of server-sent events of JSON: the message says where."""


def says_something(data: bytes) -> bool:
    """Whether stream bytes may hold more than another token: a cheap scan, never a false no.

    A key's name cannot occur unescaped inside a JSON string, so finding it means the key (or
    an event worth a look anyway); a false yes only costs a decode.
    """
    for marker in _ALWAYS_READ:
        if marker in data:
            return True
    for key in _READ_UNLESS_NULL:
        at = data.find(key)
        while at >= 0:
            at = data.find(b":", at + len(key))
            if at < 0:
                return True
            value = data[at + 1 : at + 16].lstrip(_JSON_SPACE)
            if not value.startswith(b"null"):
                return True
            at = data.find(key, at)
    return False


@dataclass
class ReplyObservation:
    """What a reply says about its turn."""

    first_token: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_call_ids: list[str] = field(default_factory=list)
    # The names of the tools it called, as the calls named them (`counts.tool_names` bounds them).
    tool_names: list[str] = field(default_factory=list)
    # An error the engine reported inside a 200 reply (some engines do, mid-stream).
    error: str = ""
    # The stream's closing `data: [DONE]` arrived.
    done: bool = False
    # A usage the engine sent with a count out of range (`luftpause.counts`), as it was sent;
    # the turn's usage is then unknown (both counts 0, as for a reply that carries none).
    bad_usage: str = ""
    # Why the reply is not one (a body that is not a JSON object); "" for a reply.
    unreadable: str = ""

    @property
    def ran_to_its_end(self) -> bool:
        """Whether the reply ended as a reply ends (a finish reason, or the closing [DONE]) rather
        than breaking off; it may still carry an error the engine reported in it."""
        return self.done or bool(self.finish_reason)

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
                    # In a stream only a call's first fragment carries its id and its name.
                    call_id = call.get("id") if isinstance(call, dict) else None
                    if isinstance(call_id, str) and call_id and call_id not in self.tool_call_ids:
                        self.tool_call_ids.append(call_id)
                        function = call.get("function")
                        name = function.get("name") if isinstance(function, dict) else None
                        self.tool_names = list(counts.tool_names((*self.tool_names, name)))
        reason = choice.get("finish_reason")
        # With several choices, one ending in tool calls is what decides whether the run pauses.
        if isinstance(reason, str) and reason and self.finish_reason != "tool_calls":
            self.finish_reason = reason

    def _note_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict) or self.bad_usage:
            return
        sent = usage.get("prompt_tokens"), usage.get("completion_tokens")
        prompt, completion = (counts.token_count(value) for value in sent)
        if any(
            value is not None and count is None
            for value, count in zip(sent, (prompt, completion), strict=True)
        ):
            # One count out of range and the other cannot be trusted either: usage unknown.
            self.bad_usage = f"prompt_tokens {sent[0]!r}, completion_tokens {sent[1]!r}"[:200]
            self.prompt_tokens = self.completion_tokens = 0
            return
        if prompt is not None:
            self.prompt_tokens = prompt
        if completion is not None:
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
    """Follows a streamed chat completion chunk by chunk, as the bytes pass to the client.

    With `hide_usage`, what goes on to the client is what `take` returns after each `feed` and
    after `close`, not the chunks as fed (module docstring).
    """

    def __init__(self, hide_usage: bool = False) -> None:
        self.observation = ReplyObservation()
        self._pending = b""
        self._data: list[bytes] = []
        self._hide = hide_usage
        # With hide_usage: the bytes for the client not yet taken; what the data line just read
        # is to become (None: itself, b"": nothing); and whether a dropped event's blank line is
        # still to come.
        self._out: list[bytes] = []
        self._instead: bytes | None = None
        self._drop_blank = False

    def feed(self, chunk: bytes) -> bool:
        """Reads one chunk; returns True when this chunk carried the reply's first token."""
        had_token = self.observation.first_token
        if (
            had_token
            and chunk.startswith(_DATA)
            and not self._pending
            and not self._data
            and not self._drop_blank
            and chunk.endswith(b"\n")
            and not says_something(chunk)
        ):
            # Whole lines of nothing but more tokens: nothing to learn, no need to split them.
            if self._hide:
                self._out.append(chunk)
            return False
        buffered = self._pending + chunk
        lines = buffered.splitlines(keepends=True)
        self._pending = b""
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            # An unfinished line, or one ending in "\r" whose "\n" may open the next chunk:
            # keep it until the rest arrives.
            self._pending = lines.pop()
            if len(self._pending) > MAX_LINE_BYTES:
                raise NotAnEventStream(f"a line longer than {MAX_LINE_BYTES} bytes")
        for line in lines:
            bare = line.rstrip(b"\r\n")
            self._line(bare)
            if self._hide:
                self._pass_on(line, bare)
        return self.observation.first_token and not had_token

    def take(self) -> bytes:
        """With hide_usage: the bytes for the client from what was fed since the last take."""
        out = self._out
        if len(out) == 1:
            return out.pop()
        taken = b"".join(out)
        out.clear()
        return taken

    def close(self) -> ReplyObservation:
        """Ends the stream: reads what is left of it and returns what was observed."""
        if self._pending:
            line, self._pending = self._pending, b""
            bare = line.rstrip(b"\r\n")
            self._line(bare)
            if self._hide:
                self._pass_on(line, bare)
        # An event the stream stopped inside of was cut short, not garbled: whether the reply
        # ran to its end says what became of it.
        self._line(b"", cut_short=True)
        return self.observation

    def _pass_on(self, line: bytes, bare: bytes) -> None:
        """Hands on `line` (`bare` without its line break), or what it becomes without usage."""
        instead, self._instead = self._instead, None
        if self._drop_blank:
            self._drop_blank = False
            if not bare:
                return
        if instead is None:
            self._out.append(line)
        elif instead:
            self._out.append(b"data: " + instead + line[len(bare) :])
        else:
            self._drop_blank = True

    def _line(self, line: bytes, cut_short: bool = False) -> None:
        if not line:
            if self._data:
                data, self._data = b"\n".join(self._data), []
                if not self._take(data) and not cut_short:
                    raise NotAnEventStream(f"an event whose data is not JSON: {data[:60]!r}")
        elif line.startswith(_DATA):
            value = line[len(_DATA) :]
            value = value[1:] if value.startswith(b" ") else value
            # Engines put each event's JSON on one data line; reading it at once reports the
            # first token without waiting for the blank line, and copes with streams that never
            # send one. Only a line that does not parse alone waits for the rest of its event.
            if self._data:
                self._data.append(value)
                if sum(map(len, self._data)) > MAX_LINE_BYTES:
                    raise NotAnEventStream(f"an event longer than {MAX_LINE_BYTES} bytes")
            elif self.observation.first_token and value.startswith(b"{") and not says_something(value):
                return
            elif not self._take(value, one_line=True):
                self._data.append(value)
        elif not line.startswith(b":") and line.partition(b":")[0] not in _FIELDS:
            raise NotAnEventStream(f"a line that is not a server-sent event's: {line[:60]!r}")
        # Comments (":"), event names, ids and retry fields say nothing about the turn.

    def _take(self, data: bytes, one_line: bool = False) -> bool:
        """Reads one event's data; False when it is not (yet) a whole JSON value."""
        if data.strip() == _DONE:
            self.observation.done = True
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return False
        self.observation.note_payload(payload, "delta")
        if self._hide and one_line and isinstance(payload, dict) and payload.get("usage") is not None:
            self._instead = _without_usage(payload)
        return True


def _without_usage(payload: dict[str, Any]) -> bytes:
    """A stream event with usage as a client that did not ask for it would have had it: nothing
    for the usage-only event, else the event without its `usage`."""
    if not payload.get("choices") and not payload.get("error"):
        return b""
    return encoded({key: value for key, value in payload.items() if key != "usage"})


def observe_completion(body: bytes) -> ReplyObservation:
    """What a non-streamed chat completion says about its turn."""
    observation = ReplyObservation()
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        observation.unreadable = f"its reply is not a JSON object: {body[:60]!r}"
        return observation
    observation.note_payload(payload, "message")
    return observation
