"""The fault drill: kill -9 of each service in turn under load, and what each one costs.

`luftpause up --with-fakes` on ports of its own (bench/soak.py's stack), under own-loop agents of
both classes (`luftpause loadgen`, streamed) and sub-agents over MCP spawned in waves of
`--spawn` and awaited. Every `--gap-s` (20) one service is killed with SIGKILL, in this order:
scheduler, dataplane, runtime, fake-a (an engine), fake-mcp (the tool server); `up` starts it
again. For each kill: seconds until `up` has restarted it and its health route answers, and
seconds until a turn through the proxy is answered again. At the end, with the load stopped:
how the sub-agents ended (every one should finish: none may fail for a restart shorter than its
retry window), how many tool calls the tool server received twice under one idempotency key
(only calls in flight when the runtime died may be), and the scheduler's in-flight and held
counts (back to zero). JSON and markdown under bench/results/.

    luftpause bench faults [--gap-s 20] [--agents 6] [--spawn 6]

The other drills, each a module of its own with its own options after `--drill NAME`:

    luftpause bench faults --drill ports [--idle 10000] [--slowloris 300]    # bench/faults_ports.py
    luftpause bench faults --drill engines [--seconds 40] [--clients 8]      # bench/faults_engines.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from mcp import Client

from luftpause.bench import results
from luftpause.bench.soak import LoadedStack
from luftpause.fake_mcp.server import CALLS_ENV

# The drills beside the kills: `--drill NAME` runs that module's main with the options that follow.
DRILLS = {"ports": "luftpause.bench.faults_ports", "engines": "luftpause.bench.faults_engines"}
VICTIMS = ("scheduler", "dataplane", "runtime", "fake-a", "fake-mcp")


def _health_urls(ports: dict[str, int]) -> dict[str, str]:
    return {
        "scheduler": f"http://127.0.0.1:{ports['status']}/status",
        "dataplane": f"http://127.0.0.1:{ports['dataplane']}/health",
        "runtime": f"http://127.0.0.1:{ports['runtime']}/status",
        "fake-a": f"http://127.0.0.1:{ports['a']}/health",
        "fake-mcp": f"http://127.0.0.1:{ports['mcp']}/health",
    }


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def _turn_answered(dataplane: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                f"{dataplane}/v1/chat/completions",
                json={
                    "model": "fake-llama",
                    "messages": [{"role": "user", "content": "drill probe"}],
                    "max_tokens": 8,
                },
            )
            return r.status_code == 200
    except httpx.HTTPError:
        return False


async def _kill_and_time(name: str, stack: LoadedStack, health: str) -> dict[str, Any]:
    pid = stack.pids()[name]
    killed = time.monotonic()
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    healthy_s = turn_s = None
    while time.monotonic() - killed < 60 and (healthy_s is None or turn_s is None):
        now = time.monotonic() - killed
        if healthy_s is None and stack.pids().get(name) != pid and await _answers(health):
            healthy_s = round(now, 2)
        if turn_s is None and await _turn_answered(stack.dataplane):
            turn_s = round(time.monotonic() - killed, 2)
        await asyncio.sleep(0.1)
    return {"service": name, "killed_at": killed_at, "back_healthy_s": healthy_s, "turn_answered_s": turn_s}


def run(gap_s: float, agents: int, spawn: int) -> dict[str, Any]:
    calls = Path(tempfile.mkdtemp(prefix="luftpause-faults-calls-")) / "calls.jsonl"
    duration_s = gap_s * (len(VICTIMS) + 1)
    with LoadedStack("luftpause-faults-", env={CALLS_ENV: str(calls)}) as stack:
        stack.own_loop_agents(agents, duration_s, "drill")
        counts: dict[str, int] = {"spawn_errors": 0}
        kills: list[dict[str, Any]] = []

        async def drill() -> None:
            started = time.monotonic()
            waves = asyncio.create_task(
                _sub_agents_riding_out(stack.mcp, spawn, started + duration_s, counts)
            )
            health = _health_urls(stack.ports)
            for i, name in enumerate(VICTIMS, start=1):
                await asyncio.sleep(max(0.0, started + i * gap_s - time.monotonic()))
                kill = await _kill_and_time(name, stack, health[name])
                kills.append(kill)
                print(f"killed {name}: healthy again after {kill['back_healthy_s']} s, "
                      f"a turn answered after {kill['turn_answered_s']} s", flush=True)  # fmt: skip
            await waves

        asyncio.run(drill())
        after = stack.counts_after_load()
        received = (
            [json.loads(line) for line in calls.read_text().splitlines() if line] if calls.exists() else []
        )
        # Tool calls are at most once: a key twice is a call made again (expected: none, the one in
        # flight when the runtime died included).
        twice = {k for k, n in Counter(c["key"] for c in received if c.get("key")).items() if n > 1}
        return {"gap_s": gap_s, "agents": agents, "spawn": spawn, "kills": kills, "sub_agents": counts,
                "tool_calls": len(received), "tool_calls_repeated": len(twice), "after": after}  # fmt: skip


async def _sub_agents_riding_out(url: str, per_wave: int, until: float, counts: dict[str, int]) -> None:
    """Waves of sub-agents, each spawned and awaited; when the runtime dies under a wave, its
    handles are awaited again once the runtime is back (it resumes them from its journal)."""
    wave = 0
    while time.monotonic() < until:
        wave += 1
        handles: list[str] = []
        while not handles:
            try:
                async with Client(url) as client:
                    for i in range(per_wave):
                        res = await client.call_tool(
                            "spawn", {"task": f"Drill wave {wave}, task {i}: a river."}
                        )
                        if res.is_error:
                            counts["spawn_errors"] += 1
                        else:
                            handles.append(res.structured_content["handle"])
            except Exception:  # noqa: BLE001 (the runtime is down: try the wave again)
                await asyncio.sleep(0.5)
        while True:
            try:
                async with Client(url) as client:
                    done = await client.call_tool(
                        "await", {"handles": handles, "mode": "all", "timeout": 300}
                    )
                break
            except Exception:  # noqa: BLE001 (the runtime died under the wait: await again once it is back)
                counts["awaits_cut"] = counts.get("awaits_cut", 0) + 1
                await asyncio.sleep(0.5)
        for run in (done.structured_content or {}).get("runs", []):
            counts[run["status"]] = counts.get(run["status"], 0) + 1
            if run["status"] != "finished":
                print(f"sub-agent {run['handle']} {run['status']}: {run.get('error')}", flush=True)


def _table(record: dict[str, Any]) -> str:
    lines = ["| killed | healthy again after s | a turn answered after s |", "|---|---:|---:|"]
    for k in record["kills"]:
        lines.append(
            f"| {k['service']} | {results.cell(k['back_healthy_s'])} | {results.cell(k['turn_answered_s'])} |"
        )
    a = record["after"]
    lines += [
        "",
        f"Sub-agents: {record['sub_agents']}. Tool calls received: {record['tool_calls']}, "
        f"{record['tool_calls_repeated']} of them twice under one idempotency key "
        "(tool calls are at most once: a call in flight when the runtime died is not made again). "
        "After the load: "
        f"{a['in_flight']} in flight, {a['held']} held at the scheduler.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--gap-s", type=float, default=20.0, help="seconds between kills")
    p.add_argument("--agents", type=int, default=6, help="own-loop agents per class")
    p.add_argument("--spawn", type=int, default=6, help="sub-agents per wave over MCP")
    p.add_argument("--no-record", action="store_true")
    p.add_argument(
        "--drill",
        choices=("kills", *DRILLS),
        default="kills",
        help="kills (this module, default), or another drill given the options that follow",
    )
    args, rest = p.parse_known_args(argv)
    if args.drill != "kills":
        forwarded = [*rest, *(["--no-record"] if args.no_record else [])]
        drill_main: Any = importlib.import_module(DRILLS[args.drill]).main
        return int(drill_main(forwarded))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    record = run(args.gap_s, args.agents, args.spawn)
    table = _table(record)
    print(table)
    if not args.no_record:
        print(f"\nrecord: {results.write('faults', record, table)}")
    return 0 if record["after"] == {"in_flight": 0, "held": 0} else 1
