"""Own-loop agents through the proxy: closed-loop runs with fixed-latency tool calls.

Each agent runs one run after another until the deadline: it sends the conversation to
`/v1/chat/completions` with the run's headers (x-luftpause-run-id, -class, -caller), and while
the reply is a tool call it waits the tool's latency, appends the call and the fake MCP server's
answer (`loadgen.conversation`) and sends again. A text reply ends the run: the agent tells the
proxy (`DELETE /v1/runs/{id}`) and starts the next run at once. A failed turn is retried with the
same run id after a second, as the failure-semantics table advises. The messages are the ones
the simulator's agents send, so a real run and a simulated one can be compared turn for turn.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from luftpause.config import DEFAULT_MODEL
from luftpause.loadgen.conversation import MAX_TOKENS, TOOLS, first_messages, tool_result_message

RETRY_PAUSE_S = 1.0


class SummarySpec(Protocol):
    """What `Tally.summary` reads of a load's spec: a `LoadSpec`, or the runtime flood's `FloodSpec`."""

    @property
    def agents(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def service_class(self) -> str: ...
    @property
    def caller(self) -> str: ...


@dataclass(frozen=True)
class LoadSpec:
    url: str
    agents: int
    duration_s: float
    service_class: str
    caller: str
    context_chars: int = 8000
    tool_latency_s: float = 2.0
    model: str = DEFAULT_MODEL
    stream: bool = False
    seed: str = ""
    """Distinguishes the contexts of two loadgen processes started with the same options."""
    warmup_s: float = 0.0
    """Runs and turns ending before this are not counted: the pool first fills from cold."""


@dataclass
class Tally:
    """What the agents did so far; the progress line and the summary read it."""

    started: float = field(default_factory=time.monotonic)
    counting_from: float = 0.0
    runs: int = 0
    run_times: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    errors: int = 0
    in_flight: int = 0
    replicas: Counter[str] = field(default_factory=Counter)
    in_flight_label: str = "turns in flight"

    def counting(self) -> bool:
        return time.monotonic() >= self.counting_from

    def progress(self) -> str:
        elapsed = time.monotonic() - self.started
        phase = "" if self.counting() else "  (warming up)"
        return (
            f"{elapsed:5.0f}s{phase}  runs {self.runs}  turns {self.turns}  tool calls {self.tool_calls}  "
            f"errors {self.errors}  {self.in_flight_label} {self.in_flight}"
        )

    def summary(self, spec: SummarySpec) -> dict[str, Any]:
        def quantile(q: float) -> float | None:
            if not self.run_times:
                return None
            if len(self.run_times) == 1:
                return round(self.run_times[0], 2)
            return round(statistics.quantiles(self.run_times, n=10, method="inclusive")[int(q * 10) - 1], 2)

        return {
            "agents": spec.agents,
            "duration_s": spec.duration_s,
            "class": spec.service_class,
            "caller": spec.caller,
            "runs": self.runs,
            "runs_per_min": round(self.runs / (spec.duration_s / 60.0), 2),
            "run_time_p50_s": quantile(0.5),
            "run_time_p90_s": quantile(0.9),
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "errors": self.errors,
            "turns_by_replica": dict(sorted(self.replicas.items())),
        }


async def _turn(
    client: httpx.AsyncClient, spec: LoadSpec, headers: dict[str, str], messages: list[dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """One turn; returns the assistant message and the replica that served it."""
    body: dict[str, Any] = {
        "model": spec.model,
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
    }
    if not spec.stream:
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        data = r.json()
        return data["choices"][0]["message"], data.get("system_fingerprint") or "?"
    body["stream"] = True
    content: list[str] = []
    call: dict[str, Any] | None = None
    replica = "?"
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            replica = chunk.get("system_fingerprint") or replica
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for part in delta.get("tool_calls") or ():
                    if call is None:
                        call = {
                            "id": part.get("id", ""),
                            "type": "function",
                            "function": {"name": "", "arguments": ""},
                        }
                    function = part.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": None if call else "".join(content)}
    if call is not None:
        message["tool_calls"] = [call]
    return message, replica


async def _agent(
    client: httpx.AsyncClient, spec: LoadSpec, index: int, deadline: float, tally: Tally
) -> None:
    while time.monotonic() < deadline:
        run_id = uuid.uuid4().hex
        headers = {
            "x-luftpause-run-id": run_id,
            "x-luftpause-class": spec.service_class,
            "x-luftpause-caller": spec.caller,
        }
        messages = first_messages(f"{spec.seed}/{spec.caller}/{index}/{run_id}", spec.context_chars)
        started = time.monotonic()
        while True:
            tally.in_flight += 1
            try:
                reply, replica = await _turn(client, spec, headers, messages)
            except (httpx.HTTPError, KeyError, ValueError):
                tally.errors += 1
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            finally:
                tally.in_flight -= 1
            calls = reply.get("tool_calls") or []
            if tally.counting():
                tally.turns += 1
                tally.replicas[replica] += 1
                tally.tool_calls += 1 if calls else 0
            if not calls:
                break
            messages.append(reply)
            await asyncio.sleep(spec.tool_latency_s)
            messages.append(tool_result_message(calls[0]))
        if tally.counting() and time.monotonic() <= deadline:
            tally.runs += 1
            tally.run_times.append(time.monotonic() - started)
        try:
            await client.delete(f"/v1/runs/{run_id}", headers=headers)
        except httpx.HTTPError:
            tally.errors += 1


async def until_deadline(
    agents: list[asyncio.Task[None]], deadline: float, tally: Tally, progress_every_s: float | None
) -> None:
    """Rewrites the progress line on stderr every `progress_every_s` until `deadline`, then
    cancels the agents and waits for them to go."""
    import sys

    while time.monotonic() < deadline:
        await asyncio.sleep(min(progress_every_s or 1.0, max(deadline - time.monotonic(), 0)))
        if progress_every_s:
            print("\r" + tally.progress(), end="", file=sys.stderr, flush=True)
    for task in agents:
        task.cancel()
    await asyncio.gather(*agents, return_exceptions=True)


async def run_load(
    spec: LoadSpec, tally: Tally | None = None, progress_every_s: float | None = 1.0
) -> dict[str, Any]:
    """Runs `spec.agents` closed-loop agents for `spec.duration_s`; returns the summary.

    Runs still going at the deadline are cut off and not counted, and so is everything that ends
    during the warm-up before the counted `duration_s`. With `progress_every_s`, a progress line
    is rewritten on stderr that often.
    """
    import sys

    tally = tally or Tally()
    tally.counting_from = tally.started + spec.warmup_s
    deadline = tally.counting_from + spec.duration_s
    limits = httpx.Limits(max_connections=spec.agents + 8, max_keepalive_connections=spec.agents + 8)
    async with httpx.AsyncClient(base_url=spec.url, timeout=600.0, limits=limits) as client:
        agents = [asyncio.create_task(_agent(client, spec, i, deadline, tally)) for i in range(spec.agents)]
        await until_deadline(agents, deadline, tally, progress_every_s)
    if progress_every_s:
        print("\r" + tally.progress(), file=sys.stderr, flush=True)
    return tally.summary(spec)
