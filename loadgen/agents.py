"""Own-loop agents through the proxy: closed-loop runs with fixed-latency tool calls.

Each agent runs one run after another until the deadline: it sends the conversation to
`/v1/chat/completions` with the run's headers (x-luftpause-run-id, -class, -caller), and while
the reply is a tool call it waits the tool's latency, appends the call and the fake MCP server's
answer (`loadgen.conversation`) and sends again. A text reply ends the run: the agent tells the
proxy (`DELETE /v1/runs/{id}`) and starts the next run at once. A failed turn is retried with the
same run id after a second, as the failure-semantics table advises. The messages are the ones
the simulator's agents send, so a real run and a simulated one can be compared turn for turn.

In front of a real model, whose replies are random text as far as the agent can tell, the agent
decides a run's length itself (`LoadSpec.tool_calls`): the run's number of tool calls is a
stable hash of its task (`planned_tool_calls`), and after each turn it appends the reply (the model's tool call, or its text
with a call of the agent's own) and the tool's result, until that many calls are done; the next
reply ends the run. With `LoadSpec.pin_urls` it talks to engines directly, each run pinned to one
of them by a stable hash of its run id (no front, so no run end is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
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
    max_tokens: int = MAX_TOKENS
    tool_calls: tuple[int, int] | None = None
    """When set, (fewest, most) tool calls a run makes, drawn per run from an RNG seeded by the
    seed, caller and agent, whatever the replies say; run ids are then a function of the same."""
    pin_urls: tuple[str, ...] = ()
    """When set, engines' base URLs: each run goes to one of them by its run id (`pinned`), and
    `url` is not used."""
    end_runs: bool = True
    """Whether a run's end is sent (`DELETE /v1/runs/{id}`): the front must be luftpause's."""


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
            cuts = statistics.quantiles(self.run_times, n=100, method="inclusive")
            return round(cuts[round(q * 100) - 1], 2)

        return {
            "agents": spec.agents,
            "duration_s": spec.duration_s,
            "class": spec.service_class,
            "caller": spec.caller,
            "runs": self.runs,
            "runs_per_min": round(self.runs / (spec.duration_s / 60.0), 2),
            "run_time_p50_s": quantile(0.5),
            "run_time_p90_s": quantile(0.9),
            "run_time_p99_s": quantile(0.99),
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
        "max_tokens": spec.max_tokens,
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


def pinned(run_id: str, n: int) -> int:
    """Which of `n` engines a run goes to without a front: a stable hash of its id (the same in
    every process and every Python, unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "big") % n


def planned_tool_calls(task: str, tool_calls: tuple[int, int]) -> int:
    """How many tool calls a run whose first user message is `task` makes, in `tool_calls`
    (lowest, highest): a stable hash of the task, so that anything that reads the conversation
    (the agent, and `bench.tool_model` in front of a real engine) agrees on it."""
    lo, hi = tool_calls
    return lo + int.from_bytes(hashlib.sha256(task.encode()).digest()[:8], "big") % (hi - lo + 1)


def agents_own_call(run_id: str, k: int, rng: random.Random) -> dict[str, Any]:
    """The tool call an agent makes itself after a reply that made none (or one it cannot use)."""
    name = rng.choice([t["function"]["name"] for t in TOOLS])
    query = f"fact {k + 1} of task {run_id[:8]}"
    return {
        "id": f"call_{run_id[:8]}_{k}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"query": query})},
    }


def _usable_call(call: dict[str, Any]) -> bool:
    """A model's tool call the agent can answer and send back: a known tool, JSON object arguments."""
    function = call.get("function") or {}
    if function.get("name") not in {t["function"]["name"] for t in TOOLS}:
        return False
    try:
        return isinstance(json.loads(function.get("arguments") or ""), dict)
    except json.JSONDecodeError:
        return False


def planned_step(
    reply: dict[str, Any], run_id: str, k: int, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any]]:
    """After the k-th (from 0) turn of a run with tool calls still to make: the assistant message
    to append (the reply with one tool call, the model's if usable, else the agent's own, text
    kept) and the call to answer."""
    calls = [c for c in reply.get("tool_calls") or () if isinstance(c, dict)]
    call = calls[0] if calls and _usable_call(calls[0]) else agents_own_call(run_id, k, rng)
    if not call.get("id"):
        call = {**call, "id": f"call_{run_id[:8]}_{k}"}
    message = {"role": "assistant", "content": reply.get("content") or None, "tool_calls": [call]}
    return message, call


async def _agent(
    clients: list[httpx.AsyncClient], spec: LoadSpec, index: int, deadline: float, tally: Tally
) -> None:
    rng = random.Random(f"{spec.seed}/{spec.caller}/{index}")
    k = 0
    while time.monotonic() < deadline:
        if spec.tool_calls is None:
            run_id = uuid.uuid4().hex
            planned: int | None = None
        else:
            run_id = hashlib.sha256(f"{spec.seed}/{spec.caller}/{index}/{k}".encode()).hexdigest()[:32]
        k += 1
        client = clients[pinned(run_id, len(clients))]
        headers = {
            "x-luftpause-run-id": run_id,
            "x-luftpause-class": spec.service_class,
            "x-luftpause-caller": spec.caller,
        }
        messages = first_messages(f"{spec.seed}/{spec.caller}/{index}/{run_id}", spec.context_chars)
        if spec.tool_calls is not None:
            planned = planned_tool_calls(messages[1]["content"], spec.tool_calls)
        started = time.monotonic()
        made = 0
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
            if planned is None:
                call = (reply.get("tool_calls") or [None])[0]
            elif made < planned:
                reply, call = planned_step(reply, run_id, made, rng)
            else:
                call = None
            if tally.counting():
                tally.turns += 1
                tally.replicas[replica] += 1
                tally.tool_calls += 1 if call is not None else 0
            if call is None:
                break
            made += 1
            messages.append(reply)
            await asyncio.sleep(spec.tool_latency_s)
            messages.append(tool_result_message(call))
        if tally.counting() and time.monotonic() <= deadline:
            tally.runs += 1
            tally.run_times.append(time.monotonic() - started)
        if not spec.end_runs:
            continue
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
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits))
            for url in spec.pin_urls or (spec.url,)
        ]
        agents = [asyncio.create_task(_agent(clients, spec, i, deadline, tally)) for i in range(spec.agents)]
        await until_deadline(agents, deadline, tally, progress_every_s)
    if progress_every_s:
        print("\r" + tally.progress(), file=sys.stderr, flush=True)
    return tally.summary(spec)
