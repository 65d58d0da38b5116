"""What a load-generating agent says: the messages of one run, the same in the simulator and over HTTP.

A run is a task with a context of a given size (deterministic filler text from the run's seed),
a system prompt every run shares, and the fake MCP server's tools. The agent sends the
conversation, and while the reply is a tool call it appends the call and the tool's answer and
sends again; a text reply ends the run. How many tool calls a run makes is the fake engine's rule
(1 to 3, from the first user message), so a workload is reproducible from its seeds.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from luftpause.fake_mcp.server import tool_answer

SYSTEM_PROMPT = (
    "You are a research assistant. Use the tools to check facts before you answer; "
    "call one tool at a time and answer briefly once you have what you need."
)

MAX_TOKENS = 256
"""The reply limit every turn sends: the description's default reply length per turn."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a short fact or definition.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "deep_search",
            "description": "Search several sources in depth and summarise them.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]

_WORDS = (
    "river", "delta", "basin", "flow", "tributary", "source", "mouth", "valley", "flood", "plain",
    "current", "bank", "channel", "estuary", "watershed", "gauge", "season", "rainfall", "glacier",
    "sediment", "bridge", "harbour", "canal", "lock", "dam", "reservoir", "wetland", "meander",
)  # fmt: skip


def context_text(seed: str, chars: int) -> str:
    """`chars` characters of filler words, a deterministic function of `seed`."""
    words: list[str] = []
    length = 0
    counter = 0
    while length < chars:
        digest = hashlib.sha256(f"{seed}/{counter}".encode()).digest()
        counter += 1
        for byte in digest:
            word = _WORDS[byte % len(_WORDS)]
            words.append(word)
            length += len(word) + 1
            if length >= chars:
                break
    return " ".join(words)[:chars]


def first_messages(run_seed: str, context_chars: int) -> list[dict[str, Any]]:
    """The opening of a run: the shared system prompt and a task carrying its context."""
    task = f"Task {run_seed}: summarise what the notes below say, checking facts with the tools.\n\n"
    body = context_text(run_seed, max(context_chars - len(task), 0))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task + body}]


def tool_result_message(call: dict[str, Any]) -> dict[str, Any]:
    """The tool's answer to one tool call from a reply, as the agent appends it."""
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = {}
    query = str(arguments.get("query", "")) if isinstance(arguments, dict) else ""
    return {
        "role": "tool",
        "tool_call_id": call.get("id", ""),
        "content": tool_answer(str(function.get("name", "lookup")), query),
    }
