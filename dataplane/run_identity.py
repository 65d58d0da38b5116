"""Which run a turn belongs to.

An agent that sends `x-luftpause-run-id` names its run. One that cannot set a header per run is
still recognised: every turn of a tool loop echoes back the tool_call_ids of the previous reply
(in the assistant message that asked for the tools and in each role "tool" result), so the ids we
saw in a reply's tool calls point at the run that made them. Those ids are remembered for 30
minutes, the same span after which the scheduler forgets an idle run. A turn matching neither
starts a new run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

TOOL_CALL_ID_MEMORY_S = 30 * 60.0
PRUNE_PERIOD_S = 60.0


@dataclass(frozen=True, slots=True)
class _Sighting:
    run_id: str
    seen_at: float


class ToolCallMemory:
    """tool_call_id -> run id, for the ids seen in replies' tool calls over the last 30 minutes."""

    def __init__(self, ttl_s: float = TOOL_CALL_ID_MEMORY_S) -> None:
        self._ttl_s = ttl_s
        self._runs: dict[str, _Sighting] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def remember(self, tool_call_ids: Iterable[str], run_id: str, now: float | None = None) -> None:
        seen_at = time.monotonic() if now is None else now
        for tool_call_id in tool_call_ids:
            if tool_call_id:
                self._runs[tool_call_id] = _Sighting(run_id, seen_at)

    def run_of(self, tool_call_id: str, now: float | None = None) -> str | None:
        """The run whose reply carried this id, or None when unknown or remembered too long ago."""
        sighting = self._runs.get(tool_call_id)
        if sighting is None:
            return None
        now = time.monotonic() if now is None else now
        # Pruning runs only once a minute; an id past its time must not match in between.
        if now - sighting.seen_at > self._ttl_s:
            return None
        return sighting.run_id

    def forget_run(self, run_id: str) -> None:
        for tool_call_id in [i for i, s in self._runs.items() if s.run_id == run_id]:
            del self._runs[tool_call_id]

    def prune(self, now: float | None = None) -> int:
        """Drops ids remembered longer than the memory lasts; returns how many went."""
        now = time.monotonic() if now is None else now
        stale = [i for i, s in self._runs.items() if now - s.seen_at > self._ttl_s]
        for tool_call_id in stale:
            del self._runs[tool_call_id]
        return len(stale)


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


def resolve_run_id(
    header: str | None, messages: Any, memory: ToolCallMemory, now: float | None = None
) -> str:
    """The run a turn belongs to: the run header, else the run of an echoed tool_call_id, else a new run."""
    if header is not None and header.strip():
        return header.strip()
    for tool_call_id in echoed_tool_call_ids(messages):
        run_id = memory.run_of(tool_call_id, now)
        if run_id is not None:
            return run_id
    return new_run_id()
