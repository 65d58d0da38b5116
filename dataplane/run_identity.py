"""What a request says about the run it belongs to, when it carries no run header.

An agent that sends `x-luftpause-run-id` names its run. One that cannot set a header per run is
still recognised: every turn of a tool loop echoes back the tool_call_ids of the previous reply
(in the assistant message that asked for the tools and in each role "tool" result). The dataplane
reads those ids here and sends them with the admission; the scheduler, which saw every reply's
tool calls through whichever dataplane carried them, says which run they belong to
(scheduler/run_identity.py). A turn whose ids name no run starts a new one, under the id chosen
here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any


def echoed_tool_call_ids(messages: Any) -> Iterator[str]:
    """The tool_call_ids a request's messages echo back, newest message first.

    Role "tool" messages give their `tool_call_id`, assistant messages the ids of their
    `tool_calls`. Anything not shaped like that is skipped: the engine, not the dataplane,
    judges whether the request is valid.
    """
    if not isinstance(messages, list):
        return
    for message in reversed(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if isinstance(tool_call_id, str) and tool_call_id:
                yield tool_call_id
        elif role == "assistant":
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, list):
                for call in tool_calls:
                    if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]:
                        yield call["id"]


def new_run_id() -> str:
    return uuid.uuid4().hex
