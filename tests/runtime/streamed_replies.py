"""A chat completion as an engine streams it: the scripted dataplanes of the runtime's tests answer
a streamed turn with these chunks, so that the runtime's reading of a stream is what they test."""

import json
from typing import Any

import httpx


def _split(text: str, parts: int) -> list[str]:
    step = max(1, -(-len(text) // parts))
    return [text[i : i + step] for i in range(0, len(text), step)] or [""]


def chunks(completion: dict[str, Any], pieces: int = 3) -> list[dict[str, Any]]:
    """The chunks of `completion` (a reply not streamed, one choice), each field in `pieces`
    fragments: text first, then each tool call (id, type and name, then its arguments), the finish
    reason, and the usage alone in a last chunk with no choices."""
    base = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint") if k in completion}
    base["object"] = "chat.completion.chunk"
    (choice,) = completion["choices"]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    out = [chunk({"role": message.get("role", "assistant"), "content": ""})]
    out += [chunk({"content": part}) for part in _split(message.get("content") or "", pieces) if part]
    for index, call in enumerate(message.get("tool_calls") or []):
        arguments = _split(call["function"]["arguments"], pieces)
        head = {"index": index, "id": call["id"], "type": "function"}
        out.append(chunk({"tool_calls": [{**head, "function": {"name": call["function"]["name"]}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": a}}]}) for a in arguments]
    out.append(chunk({}, choice.get("finish_reason")))
    if "usage" in completion:
        out.append({**base, "choices": [], "usage": completion["usage"]})
    return out


def calls_message(*calls: tuple[str, str, str]) -> dict[str, Any]:
    """An assistant message that only makes tool calls, each given as (id, name, arguments)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls
        ],
    }


def sse(events: list[Any], done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def sse_response(events: list[Any], done: bool = True) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(events, done))
