"""How the fake engine counts tokens: deterministically from text, about four characters a token.

A real engine counts with its tokenizer after applying the chat template. We have neither, and
what matters to the scheduler and the benchmarks is only that longer conversations cost more and
that the same conversation always costs the same, so a character count stands in for both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

CHARS_PER_TOKEN = 4
"""English text averages about four characters per token with Llama-style BPE vocabularies."""

MESSAGE_OVERHEAD_TOKENS = 4
"""What a chat template adds around each message (role header, separators), roughly as Llama 3's."""


def count_tokens(text: str) -> int:
    """Tokens in `text`: one per started group of four characters, zero for the empty string."""
    return -(-len(text) // CHARS_PER_TOKEN)


def content_text(content: Any) -> str:
    """The text of a message's `content`, which OpenAI allows as a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, Mapping) and "text" in part
        )
    return str(content)


def message_tokens(message: Mapping[str, Any]) -> int:
    """Tokens one chat message takes in the prompt, template overhead and tool calls included."""
    total = MESSAGE_OVERHEAD_TOKENS + count_tokens(content_text(message.get("content")))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        total += count_tokens(str(function.get("name", ""))) + count_tokens(
            str(function.get("arguments", ""))
        )
    return total


def tools_tokens(tools: Iterable[Mapping[str, Any]]) -> int:
    """Tokens the tool definitions take (a chat template writes them into the system prompt)."""
    return sum(count_tokens(json.dumps(tool, sort_keys=True, separators=(",", ":"))) for tool in tools)


def prompt_tokens(
    messages: Iterable[Mapping[str, Any]], tools: Iterable[Mapping[str, Any]] | None = None
) -> int:
    """Tokens the engine would prefill for this conversation and these tool definitions."""
    return sum(message_tokens(m) for m in messages) + tools_tokens(tools or ())
