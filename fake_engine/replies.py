"""What the fake engine says: a deterministic function of the conversation, the tools and max_tokens.

The rule, so that a workload of "up to three tool calls" is reproducible:

- A conversation plans `1 + (sha256(first user message) mod N)` tool calls, so 1 to N, with N
  `MAX_TOOL_CALLS` (3: 1, 2 or 3) unless the caller gives another most (the simulator's
  `--tool-calls`).
- While tools are offered (and `tool_choice` is not "none") and the conversation holds fewer
  tool results (messages with role "tool") than planned, the reply is exactly one tool call,
  finish_reason "tool_calls". `tool_choice` "required" or a named function forces a call whatever
  the count. The tool is picked by hash among the offered ones (or is the named one), and its
  arguments are filled from its JSON schema.
- Otherwise the reply is filler text of `EngineParams.reply_tokens` tokens, finish_reason "stop",
  or fewer tokens and finish_reason "length" when max_tokens cuts it. A tool call is never cut.

Hashes are sha256 (never Python's salted `hash()`), so replies are the same in every process.
A tool call id is `call_` plus 24 hex digits of the hash of the whole conversation so far: each
call of a run gets its own id, and the same conversation sent twice gets the same id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from luftpause.fake_engine.tokens import CHARS_PER_TOKEN, content_text

MAX_TOOL_CALLS = 3
"""The most tool calls a conversation plans by default: the workload of "up to three tool calls"."""

_FILLER_WORDS = (
    "the", "result", "shows", "that", "each", "step", "was", "checked", "against", "notes",
    "from", "earlier", "turns", "and", "nothing", "new", "came", "up", "so", "answer",
    "stays", "short", "while", "sources", "agree", "on", "main", "points", "here", "summary",
    "follows", "plainly",
)  # fmt: skip


class ReplyError(ValueError):
    """The request cannot be answered as asked (e.g. tool_choice names a tool that is not offered)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


@dataclass(frozen=True)
class Reply:
    """One assistant message, as the tokens the engine decodes one by one.

    For text, each piece is one token of content. For a tool call, the first piece is the
    function name and the rest are fragments of the arguments' JSON text.
    """

    pieces: tuple[str, ...]
    finish_reason: str
    tool_call: ToolCall | None = None

    @property
    def text(self) -> str | None:
        return None if self.tool_call else "".join(self.pieces)

    @property
    def completion_tokens(self) -> int:
        return len(self.pieces)


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def first_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for message in messages:
        if message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def planned_tool_calls(messages: Sequence[Mapping[str, Any]], max_tool_calls: int = MAX_TOOL_CALLS) -> int:
    """How many tool calls this conversation makes when tools are offered: 1 to `max_tool_calls`."""
    if max_tool_calls < 1:
        raise ValueError(f"a conversation plans at least one tool call, got a most of {max_tool_calls}")
    return 1 + int.from_bytes(_digest(first_user_text(messages))[:8], "big") % max_tool_calls


def tool_results(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "tool")


def compose_reply(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    max_tokens: int | None,
    reply_tokens: int,
    max_tool_calls: int = MAX_TOOL_CALLS,
) -> Reply:
    """The reply to `messages`; `tools` and `tool_choice` as in OpenAI's chat completions body."""
    conversation = json.dumps(list(messages), sort_keys=True, separators=(",", ":"), default=str)
    offered = [t for t in tools or () if isinstance(t.get("function"), Mapping)]
    named = _named_choice(tool_choice)
    if named is not None:
        chosen = [t for t in offered if t["function"].get("name") == named]
        if not chosen:
            raise ReplyError(f"tool_choice names function '{named}', which is not among the offered tools")
        return _tool_call_reply(chosen[0], messages, conversation)
    if offered and tool_choice != "none":
        if tool_choice == "required" or tool_results(messages) < planned_tool_calls(messages, max_tool_calls):
            index = int.from_bytes(_digest(first_user_text(messages), str(tool_results(messages)))[:8], "big")
            return _tool_call_reply(offered[index % len(offered)], messages, conversation)
    return _text_reply(conversation, max_tokens, reply_tokens)


def _named_choice(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def _text_reply(conversation: str, max_tokens: int | None, reply_tokens: int) -> Reply:
    length, finish = reply_tokens, "stop"
    if max_tokens is not None and max_tokens < reply_tokens:
        length, finish = max_tokens, "length"
    choices = hashlib.shake_256(conversation.encode()).digest(max(length, 1))
    words = [_FILLER_WORDS[b % len(_FILLER_WORDS)] for b in choices[:length]]
    pieces = [(" " if i else "") + word for i, word in enumerate(words)]
    if pieces:
        pieces[0] = pieces[0].capitalize()
        if finish == "stop":
            pieces[-1] += "."
    return Reply(pieces=tuple(pieces), finish_reason=finish)


def _tool_call_reply(
    tool: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], conversation: str
) -> Reply:
    function = tool["function"]
    name = str(function.get("name", "tool"))
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    seed = _digest(conversation, name)
    arguments = json.dumps(_fill(schema, schema, seed, _phrase(first_user_text(messages)), 0))
    call = ToolCall(id="call_" + _digest(conversation).hex()[:24], name=name, arguments=arguments)
    fragments = [arguments[i : i + CHARS_PER_TOKEN] for i in range(0, len(arguments), CHARS_PER_TOKEN)]
    return Reply(pieces=(name, *fragments), finish_reason="tool_calls", tool_call=call)


def _phrase(text: str) -> str:
    """A short string from the user's message, what a model would put in a query argument."""
    words = text.split()[:6]
    return " ".join(words)[:60] or "general question"


def _fill(schema: Any, root: Mapping[str, Any], seed: bytes, phrase: str, depth: int) -> Any:
    """A value valid for a (simple) JSON schema: required properties only, first option of a union."""
    if not isinstance(schema, Mapping) or depth > 8:
        return None
    if isinstance(schema.get("$ref"), str):
        return _fill(_resolve(schema["$ref"], root), root, seed, phrase, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][seed[depth % len(seed)] % len(schema["enum"])]
    if "default" in schema:
        return schema["default"]
    for union in ("anyOf", "oneOf", "allOf"):
        options = [
            o for o in schema.get(union) or () if not (isinstance(o, Mapping) and o.get("type") == "null")
        ]
        if options:
            return _fill(options[0], root, seed, phrase, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    small = 1 + seed[(depth + 1) % len(seed)] % 5
    if kind == "string":
        return phrase[: schema.get("maxLength", len(phrase))]
    if kind in ("integer", "number"):
        if "minimum" in schema:
            low = schema["minimum"]
        elif "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        else:
            low = 1
        value = low + small - 1
        if "maximum" in schema:
            value = min(value, schema["maximum"])
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return bool(seed[depth % len(seed)] & 1)
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [_fill(schema.get("items", {}), root, seed, phrase, depth + 1) for _ in range(count)]
    if kind == "object":
        properties = schema.get("properties") or {}
        return {
            key: _fill(properties.get(key, {}), root, seed, phrase, depth + 1)
            for key in schema.get("required") or ()
        }
    return None


def _resolve(ref: str, root: Mapping[str, Any]) -> Any:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node
