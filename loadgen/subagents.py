"""Sub-agents over MCP: runs spawned and awaited through the runtime with the official `mcp` client.

Two ways `luftpause loadgen` drives the runtime, the way a harness such as Claude Code does:

- `--spawn N`: one fan-out. N sub-agents are spawned at once and collected with `await`; the
  summary counts what came back (finished, failed, tool calls) and the time for all of them.
- `--spawn-agents N`: a closed-loop flood. Each of N agents spawns a run, awaits it and spawns
  the next at once, until the deadline, like the own-loop agents of `loadgen.agents` and with
  the same progress line and summary (`Tally`). Each run's task is the own-loop agents' opening
  (`loadgen.conversation`: the shared system prompt as spawn's `system`, the task with its
  context), so the fake engine gives a run the same tool calls over either door.

All agents of one process share one MCP session: the runtime names that session as the caller
of every turn, so one loadgen process is one caller for the scheduler's fairness.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcp import Client

from luftpause.loadgen.agents import Tally, until_deadline
from luftpause.loadgen.conversation import first_messages

AWAIT_TIMEOUT_S = 60
"""One await call's wait: the runtime's default, under MCP clients' own per-request limits."""


class SpawnFailed(RuntimeError):
    """The runtime refused a spawn or an await; the message has what it said."""


async def spawn(client: Client, task: str, **arguments: Any) -> str:
    """Spawns one sub-agent; returns its handle."""
    res = await client.call_tool("spawn", {"task": task, **arguments})
    if res.is_error:
        raise SpawnFailed(f"spawn failed: {res.content}")
    return res.structured_content["handle"]


async def collect(
    client: Client,
    handles: list[str],
    timeout_s: int = AWAIT_TIMEOUT_S,
    on_update: Callable[[dict[str, dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Awaits every run in `handles` (await mode all, as many calls as it takes); returns their
    final views in the order of `handles`. `on_update` sees the runs done so far after each call."""
    done: dict[str, dict[str, Any]] = {}
    pending = list(handles)
    while pending:
        res = await client.call_tool("await", {"handles": pending, "mode": "all", "timeout": timeout_s})
        if res.is_error:
            raise SpawnFailed(f"await failed: {res.content}")
        for run in res.structured_content["runs"]:
            if run["status"] not in ("running", "AwaitingApproval"):
                done[run["handle"]] = run
        pending = [h for h in pending if h not in done]
        if on_update is not None:
            on_update(done)
    return [done[h] for h in handles]


def tasks(n: int, context_chars: int, seed: str = "") -> list[dict[str, Any]]:
    """Spawn arguments for `n` sub-agents: the own-loop agents' opening, one context per run."""
    out = []
    for i in range(n):
        system, user = first_messages(f"{seed}/spawn/{i}", context_chars)
        out.append({"task": user["content"], "system": system["content"]})
    return out


def fan_out_summary(runs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    return {
        "spawned": len(runs),
        "finished": sum(r["status"] == "finished" for r in runs),
        "failed": sum(r["status"] not in ("finished", "running", "AwaitingApproval") for r in runs),
        "turns": sum(r.get("turns", 0) for r in runs),
        "tool_calls": sum(r["toolCalls"] for r in runs),
        "failed_tool_calls": sum(r["failedToolCalls"] for r in runs),
        "seconds": round(seconds, 3),
    }


async def fan_out(
    runtime: str,
    n: int,
    context_chars: int = 8000,
    service_class: str = "interactive",
    seed: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """`--spawn N`: spawns `n` sub-agents at once, awaits them all; returns the summary."""
    started = time.monotonic()

    def show(done: dict[str, dict[str, Any]]) -> None:
        if progress:
            line = f"{time.monotonic() - started:5.0f}s  finished {len(done)} of {n}  " + (
                f"tool calls {sum(r['toolCalls'] for r in done.values())}"
            )
            print("\r" + line, end="", file=sys.stderr, flush=True)

    async with Client(runtime) as client:
        handles = [
            await spawn(client, **t, serviceClass=service_class)
            for t in tasks(n, context_chars, seed or uuid.uuid4().hex)
        ]
        runs = await collect(client, handles, timeout_s=2 if progress else AWAIT_TIMEOUT_S, on_update=show)
    if progress:
        print(file=sys.stderr, flush=True)
    return {"runtime": runtime, "class": service_class, **fan_out_summary(runs, time.monotonic() - started)}


@dataclass(frozen=True)
class FloodSpec:
    """`--spawn-agents N`: what `Tally.summary` reads, with the runtime's URL for the proxy's."""

    url: str
    agents: int
    duration_s: float
    service_class: str
    context_chars: int = 8000
    seed: str = ""
    warmup_s: float = 0.0
    caller: str = "(the MCP session)"
    max_tokens: int | None = None
    """Each run's `maxTokens` (spawn's own default when None)."""


async def _flood_agent(
    client: Client, spec: FloodSpec, index: int, deadline: float, tally: Tally, live: set[str]
) -> None:
    while time.monotonic() < deadline:
        system, user = first_messages(
            f"{spec.seed}/spawn-agent/{index}/{uuid.uuid4().hex}", spec.context_chars
        )
        started = time.monotonic()
        tally.in_flight += 1
        try:
            limit = {} if spec.max_tokens is None else {"maxTokens": spec.max_tokens}
            handle = await spawn(
                client, user["content"], system=system["content"], serviceClass=spec.service_class, **limit
            )
            live.add(handle)
            (run,) = await collect(client, [handle])
            live.discard(handle)
        except (SpawnFailed, OSError) as e:
            tally.errors += 1
            print(f"\nloadgen: {e}", file=sys.stderr)
            await asyncio.sleep(1.0)
            continue
        finally:
            tally.in_flight -= 1
        if run["status"] != "finished":
            tally.errors += 1
            continue
        ended = time.monotonic()
        if tally.counting() and ended <= deadline:
            tally.runs += 1
            tally.run_times.append(ended - started)
            tally.turns += run["turns"]
            tally.tool_calls += run["toolCalls"]


async def flood(
    spec: FloodSpec, tally: Tally | None = None, progress_every_s: float | None = 1.0
) -> dict[str, Any]:
    """Runs `spec.agents` closed-loop sub-agent spawners for `spec.duration_s` after the warm-up;
    returns `Tally.summary`. Runs that end outside the counted window are not counted (their
    turns and tool calls neither); runs still going at the deadline are cancelled."""
    tally = tally or Tally(in_flight_label="runs in flight")
    tally.counting_from = tally.started + spec.warmup_s
    deadline = tally.counting_from + spec.duration_s
    live: set[str] = set()
    async with Client(spec.url) as client:
        agents = [
            asyncio.create_task(_flood_agent(client, spec, i, deadline, tally, live))
            for i in range(spec.agents)
        ]
        await until_deadline(agents, deadline, tally, progress_every_s)
        # What is still running would keep the engines busy after the window: stop it.
        for handle in list(live):
            try:
                await asyncio.wait_for(client.call_tool("cancel", {"handle": handle}), 5.0)
            except (TimeoutError, OSError, SpawnFailed):
                pass
    if progress_every_s:
        print("\r" + tally.progress(), file=sys.stderr, flush=True)
    return tally.summary(spec)
