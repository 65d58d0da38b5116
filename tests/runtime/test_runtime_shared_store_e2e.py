"""Two runtimes on one PostgreSQL store, one killed with SIGKILL mid-run (issue 28, acceptance 1).

A real PostgreSQL server (tests/conftest.py), a fake engine standing in for the dataplane, and
two `luftpause runtime` processes on one database, each with its own counting tool server
(tool_fixture.py, over stdio, a second a call, logging every call with its idempotency key).
Sub-agents that plan three tool calls each are spawned through both; once each has a complete
tool round in the store, runtime a is killed with SIGKILL. What a user must see: the runtime that
is left takes a's runs once their leases expire and every run finishes, each awaited from it,
with all three of its calls; no tool call is sent twice under one idempotency key: a call a had in
flight at the kill is not sent again by b (tool calls are at most once), and the run counts it as
failed, its outcome unknown. The time from the kill until a's runs resumed is printed.
"""

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from mcp import Client
from support import (
    PostgresUnavailable,
    Service,
    call,
    free_port,
    running,
    stack_config,
    start_postgres,
    task_planning,
    wait_until,
)

FIXTURE = Path(__file__).resolve().parent / "tool_fixture.py"
# Sub-agents spawned through each runtime.
RUNS_EACH = 16
# Short, for the test's time; long enough that a runtime slowed by a loaded machine still renews
# (every third of it) before another takes its runs.
LEASE_S = 4.0


@dataclass
class SharedRuntime:
    """A runtime on the shared store: its service, port, and the log of its tool server's calls."""

    service: Service
    port: int
    calls: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"


def runtime_on_store(directory: Path, name: str, url: str, engine_port: int) -> SharedRuntime:
    """A runtime (not started) on the store at `url`, its dataplane the fake engine on
    `engine_port`, its tool server the counting fixture."""
    port, calls = free_port(), directory / f"calls-{name}.jsonl"
    tool = {
        "name": "counting",
        "command": [sys.executable, str(FIXTURE), "--log", str(calls), "--delay", "1.0"],
    }
    runtime = {
        "port": port,
        "dataplane": f"http://127.0.0.1:{engine_port}",
        "state_dir": str(directory / f"state-{name}"),
        "store": url,
        "lease_s": LEASE_S,
        "max_running_per_caller": 4 * RUNS_EACH,
        "mcp_servers": [tool],
    }
    config = stack_config.write(directory, {"runtime": runtime}, f"{name}.toml")
    service = Service(f"runtime-{name}", ["runtime", "--config", str(config)], directory / f"{name}.log")
    return SharedRuntime(service, port, calls)


@contextlib.contextmanager
def two_runtimes(directory: Path, url: str) -> Iterator[tuple[SharedRuntime, SharedRuntime]]:
    """A fake engine, and runtimes a and b on the store at `url`, started and answering; all
    three stopped on the way out."""
    engine_port = free_port()
    engine = Service(
        "engine", ["fake-engine", "--name", "fake-a", "--port", str(engine_port)], directory / "e.log"
    )
    a, b = (runtime_on_store(directory, name, url, engine_port) for name in ("a", "b"))
    with running(engine.start(), a.service.start(), b.service.start()):
        engine.wait_http(f"http://127.0.0.1:{engine_port}/health")
        for r in (a, b):
            r.service.wait_http(f"http://127.0.0.1:{r.port}/status")
        yield a, b


def _keys(calls: Path) -> list[str]:
    return (
        [json.loads(line)["key"] for line in calls.read_text().splitlines() if line] if calls.exists() else []
    )


def _in_flight(url: str, runs: set[str]) -> set[str]:
    """The idempotency keys of the calls of `runs` journaled as sent and not answered."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT type, record FROM luftpause_records WHERE run = ANY(%s) AND type IN ('sent', 'call')",
            (list(runs),),
        ).fetchall()
    answered = {r["message"]["tool_call_id"] for kind, r in rows if kind == "call"}
    return {r["key"] for kind, r in rows if kind == "sent" and r["call"] not in answered}


def _stored(url: str, kind: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {
            r for (r,) in conn.execute("SELECT DISTINCT run FROM luftpause_records WHERE type = %s", (kind,))
        }


@pytest.mark.timeout(300)
async def test_the_runtime_left_finishes_the_runs_of_one_killed_mid_run(tmp_path, postgres_url):
    with two_runtimes(tmp_path, postgres_url) as (runtime_a, runtime_b):
        a, b = runtime_a.service, runtime_b.service
        tasks = [task_planning(3, f"shared {i}") for i in range(2 * RUNS_EACH)]
        async with (
            Client(runtime_a.url) as to_a,
            Client(runtime_b.url) as to_b,
        ):
            handles = []
            for i, task in enumerate(tasks):
                client = to_a if i % 2 == 0 else to_b
                handles.append(
                    (await call(client, "spawn", task=task, tools=["lookup"], maxTokens=16))["handle"]
                )
            of_a = handles[0::2]
            wait_until(
                lambda: _stored(postgres_url, "round") >= set(handles),
                timeout_s=120,
                what="a tool round of every run",
            )
            shown = (await call(to_b, "status", handle=of_a[0]))["runs"]
            listed = {r["handle"] for r in (await call(to_b, "status"))["runs"]}
            os.kill(a.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            a.proc.wait()
            unfinished = set(of_a) - _stored(postgres_url, "finished")
            assert unfinished, "a's runs all finished before the kill: nothing was taken over"
            a_sent = Counter(_keys(runtime_a.calls))
            in_flight = _in_flight(postgres_url, unfinished)

            wait_until(
                lambda: "took over" in b.output(), timeout_s=60, interval_s=0.02, what="b to take a's runs"
            )
            resumed_s = time.monotonic() - killed
            awaited = await call(to_b, "await", handles=handles, timeout=240)
        print(f"\na's {len(unfinished)} unfinished runs resumed on b {resumed_s:.2f} s after the kill -9 "
              f"(lease_s = {LEASE_S:g}); {2 * RUNS_EACH} runs in all")  # fmt: skip

    assert [r["handle"] for r in shown] == [of_a[0]], "b answers status for a run a drives"
    assert listed == set(handles), "b lists the caller's runs on both runtimes"
    assert awaited["timedOut"] is False
    assert [(r["status"], r["toolCalls"]) for r in awaited["runs"]] == [("finished", 3)] * len(handles)
    # Its last renewal was at most a third of the lease before the kill; the taker's round comes a
    # third of the lease after expiry at the latest; and room for a loaded machine.
    assert resumed_s <= LEASE_S + LEASE_S / 3 + 5.0
    taken = re.findall(r"took over (\d+) runs", b.output())
    assert sum(map(int, taken)) == len(unfinished)

    b_sent = Counter(_keys(runtime_b.calls))
    assert max(a_sent.values()) == 1 and max(b_sent.values()) == 1, "no runtime sends one call twice"
    assert not set(a_sent) & set(b_sent), "b sends none of the calls a sent"
    every_key = {f"{h}/{r}/0" for h in handles for r in range(3)}
    # A call a journaled as sent may not have reached its tool server before the kill.
    assert set(a_sent) | set(b_sent) | in_flight == every_key and not set(b_sent) & in_flight
    print(f"calls a had in flight at the kill, not sent again: {len(in_flight)}")
    # One in flight a run at most (its calls run one by one); each counted failed, its outcome unknown.
    assert len(in_flight) <= len(unfinished)
    assert sum(r["failedToolCalls"] for r in awaited["runs"]) == len(in_flight)


@pytest.mark.timeout(300)
async def test_runs_ride_out_the_database_going_down_and_spawn_is_refused_meanwhile(tmp_path):
    """The database stopped mid-run under two runtimes for longer than a lease: a spawn is refused
    naming the store, and once it is back every run goes on from where it was, on the runtime
    that drove it (every lease expired in the outage; each runtime renews its own before either
    takes the other's), and finishes, nothing lost and no call sent twice."""
    try:
        server = start_postgres()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    try:
        with two_runtimes(tmp_path, server.url()) as (a, b):
            tasks = [task_planning(3, f"outage {i}") for i in range(4)]
            async with Client(a.url) as to_a, Client(b.url) as to_b:
                handles = [
                    (await call(c, "spawn", task=t, tools=["lookup"], maxTokens=16))["handle"]
                    for c, t in zip((to_a, to_b, to_a, to_b), tasks, strict=True)
                ]
                wait_until(lambda: _stored(server.url(), "round") >= set(handles), timeout_s=120,
                           what="a tool round of every run")  # fmt: skip
                unfinished = set(handles) - _stored(server.url(), "finished")
                server.stop()
                stopped = time.monotonic()
                refused = await to_a.call_tool("spawn", {"task": "during the outage", "tools": ["lookup"]})
                asked = time.monotonic()
                async with httpx.AsyncClient() as http:
                    outage_status = (await http.get(f"http://127.0.0.1:{a.port}/status", timeout=10)).json()
                outage_status_s = time.monotonic() - asked
                # The outage outlasts every lease (the scenario, not a wait for a condition).
                await asyncio.sleep(max(0.0, LEASE_S + 1.0 - (time.monotonic() - stopped)))
                server.start()
                awaited = await call(to_b, "await", handles=handles, timeout=180)
    finally:
        server.remove()

    assert unfinished, "every run finished before the database went down: nothing rode it out"
    assert refused.is_error
    assert "([runtime] store) cannot be reached" in refused.content[0].text
    assert "spawn is refused until it is back" in refused.content[0].text
    # a's GET /status answers within the health check's 2 s: its own runs, and why b's are missing.
    assert outage_status_s < 2.0, f"GET /status took {outage_status_s:.2f} s with the database down"
    assert sorted(r["handle"] for r in outage_status["runs"]) == sorted(handles[0::2])
    assert outage_status["notListed"].startswith("the runs other runtimes drive are not listed: ")
    assert "([runtime] store) cannot be reached" in outage_status["notListed"]
    assert [(r["status"], r["toolCalls"], r["error"]) for r in awaited["runs"]] == [("finished", 3, None)] * 4
    assert "took over" not in a.service.output() + b.service.output(), "each runtime kept its own runs"
    sent = Counter(_keys(a.calls) + _keys(b.calls))
    assert set(sent) == {f"{h}/{r}/0" for h in handles for r in range(3)} and max(sent.values()) == 1
