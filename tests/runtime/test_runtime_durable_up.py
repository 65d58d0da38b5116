"""Durable runs on the whole stack: kill -9 of the runtime under `luftpause up` mid-run.

`luftpause up --with-fakes` runs the scheduler, the dataplane, two fake engines and the runtime;
the runtime's only tool server is the counting fixture (tool_fixture.py, over stdio, a second a
call), so every call the tools received is on record. Eight sub-agents that plan three tool calls
each are spawned; once each has a complete tool round in the journal, the runtime is killed with
SIGKILL, `up` restarts it, and a new MCP session awaits the old handles.
"""

import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
from mcp import Client
from support import Ports, call, http_ok, start_up, stop_up, task_planning, wait_until, write_config

FIXTURE = Path(__file__).resolve().parent / "tool_fixture.py"
RUNS = 8


def write_stack_config(directory: Path, ports: Ports, calls_log: Path) -> Path:
    command = json.dumps([sys.executable, str(FIXTURE), "--log", str(calls_log), "--delay", "1.0"])
    return write_config(directory, ports, tool_server=f'name = "counting"\ncommand = {command}')


def journal(directory: Path) -> list[dict]:
    path = directory / "state" / "runs.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def received(calls_log: Path) -> list[tuple[int, str]]:
    """(tool server pid, query) of every call the tool server received, in order. The fake
    engine's query is the run's task, so it names the run; the pid tells the tool server the
    killed runtime had started from the one its successor started."""
    if not calls_log.exists():
        return []
    entries = [json.loads(line) for line in calls_log.read_text().splitlines() if line]
    return [(e["pid"], e["arguments"]["query"]) for e in entries]


def journaled_queries(records: list[dict], kind: str = "call") -> list[str]:
    """The query of every call journaled as answered (`call` records; rounds repeat them), or
    as sent (`sent` records, written before a call leaves)."""
    by_id = {}
    for r in records:
        if r["type"] == "turn":
            for c in r["message"]["tool_calls"]:
                by_id[c["id"]] = json.loads(c["function"]["arguments"])["query"]
    ids = [
        r["message"]["tool_call_id"] if kind == "call" else r["call"] for r in records if r["type"] == kind
    ]
    return [by_id[i] for i in ids]


@pytest.mark.timeout(240)
async def test_kill_9_mid_run_resumes_every_run_and_sends_no_call_twice(tmp_path):
    ports = Ports()
    calls_log = tmp_path / "calls.jsonl"
    config = write_stack_config(tmp_path, ports, calls_log)
    log = tmp_path / "up.log"
    up = start_up(config, log)
    url = f"http://127.0.0.1:{ports.runtime}/mcp"
    try:
        tasks = [task_planning(3, f"durable {i}") for i in range(RUNS)]
        async with Client(url, mode="legacy") as client:
            handles = [
                (await call(client, "spawn", task=t, tools=["lookup"], maxTokens=16))["handle"] for t in tasks
            ]
            # decide goes through the dataplane's /v1/decide to a fake engine's first-token logprobs.
            decided = await call(client, "decide", input="Is water wet?", labels=["yes", "no"])
        assert decided["label"] in ("yes", "no") and set(decided["probabilities"]) == {"yes", "no"}
        assert sum(decided["probabilities"].values()) == pytest.approx(1.0)

        def every_run_has_a_round() -> bool:
            rounds = {r["run"] for r in journal(tmp_path) if r["type"] == "round"}
            return rounds >= set(handles)

        wait_until(every_run_has_a_round, timeout_s=90, what="a complete tool round of every run")
        (pid,) = [int(p) for p in re.findall(r"started runtime \(pid (\d+)\)", log.read_text())]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: f"runtime (pid {pid}) exited" in log.read_text(), what="up to see the runtime die")
        before = journal(tmp_path)
        unfinished = set(handles) - {r["run"] for r in before if r["type"] == "finished"}
        assert unfinished, "every run finished before the kill: nothing was resumed"
        answered_before = journaled_queries(before)
        sent_before = journaled_queries(before, "sent")

        wait_until(
            lambda: "restarted runtime" in log.read_text(), timeout_s=30, what="up to restart the runtime"
        )
        wait_until(lambda: http_ok(f"http://127.0.0.1:{ports.runtime}/status"), what="the new runtime")
        async with Client(url) as client:  # a new session, on the sessionless wire
            awaited = await call(client, "await", handles=handles, timeout=120)
            again = await call(client, "decide", input="Is fire cold?", labels=["yes", "no"])
        assert again["label"] in ("yes", "no")
    finally:
        assert stop_up(up) == 0

    assert awaited["timedOut"] is False
    assert [r["status"] for r in awaited["runs"]] == ["finished"] * RUNS
    assert [r["toolCalls"] for r in awaited["runs"]] == [3] * RUNS

    # After the restart the tool server received exactly the calls that were not journaled as
    # sent: none that a round or an answered call had recorded, and none in flight at the kill
    # (tool calls are at most once), which the model was told has an unknown outcome.
    calls = received(calls_log)
    first_pid = calls[0][0]
    after = Counter(q for pid, q in calls if pid != first_pid)
    assert {t: after[t] for t in tasks} == {t: 3 - Counter(sent_before)[t] for t in tasks}
    in_flight_at_kill = len(sent_before) - len(answered_before)
    assert 0 <= in_flight_at_kill <= len(unfinished)
    assert sum(r["failedToolCalls"] for r in awaited["runs"]) == in_flight_at_kill
    # Each call carries an idempotency key of its own, and no key reached the tool server twice.
    keys = [(e["pid"], e["key"]) for e in map(json.loads, calls_log.read_text().splitlines())]
    assert all(key for _, key in keys)
    assert len({key for _, key in keys}) == len(keys) <= 3 * RUNS
    print(
        f"\n{in_flight_at_kill} calls in flight at the kill, answered as of unknown outcome, not sent again"
    )
    assert "resuming after 1 journaled tool rounds" in log.read_text()
