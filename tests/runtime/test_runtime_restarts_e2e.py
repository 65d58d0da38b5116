"""Sub-agents ride out a dataplane or an engine dying under them.

`luftpause up --with-fakes` runs the whole stack; the runtime's tool server is the counting
fixture (a second a call). Eight sub-agents that plan three tool calls each are spawned; once
each has a complete tool round in the journal, the dataplane (or one fake engine) is killed with
SIGKILL and `up` starts it again. Turns in flight lose their connection or get a 502, and turns
sent meanwhile find nobody there. What a user must see: every sub-agent finishes, with all
three of its tool calls, none failed for a restart shorter than its retry window.
"""

import os
import re
import signal

import pytest
from mcp import Client
from support import Ports, call, start_up, stop_up, task_planning, wait_until
from test_runtime_durable_up import journal, write_stack_config

RUNS = 8


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["dataplane", "fake-a"])
async def test_every_sub_agent_finishes_across_a_kill_9_and_restart(tmp_path, victim: str):
    ports = Ports()
    config = write_stack_config(tmp_path, ports, tmp_path / "calls.jsonl")
    log = tmp_path / "up.log"
    up = start_up(config, log)
    url = f"http://127.0.0.1:{ports.runtime}/mcp"
    try:
        tasks = [task_planning(3, f"restart {victim} {i}") for i in range(RUNS)]
        async with Client(url, mode="legacy") as client:
            handles = [
                (await call(client, "spawn", task=t, tools=["lookup"], maxTokens=16))["handle"] for t in tasks
            ]

            def every_run_has_a_round() -> bool:
                return {r["run"] for r in journal(tmp_path) if r["type"] == "round"} >= set(handles)

            wait_until(every_run_has_a_round, timeout_s=90, what="a complete tool round of every run")
            (pid,) = [int(p) for p in re.findall(rf"started {victim} \(pid (\d+)\)", log.read_text())]
            os.kill(pid, signal.SIGKILL)
            finished = {r["run"] for r in journal(tmp_path) if r["type"] == "finished"}
            assert set(handles) - finished, "every run finished before the kill: nothing rode it out"
            wait_until(
                lambda: f"restarted {victim}" in log.read_text(), timeout_s=30, what="up to restart it"
            )
            awaited = await call(client, "await", handles=handles, timeout=150)
        assert awaited["timedOut"] is False
        assert [(r["status"], r.get("error")) for r in awaited["runs"]] == [("finished", None)] * RUNS
        assert [r["toolCalls"] for r in awaited["runs"]] == [3] * RUNS
    except BaseException:
        # Failed once (6 December, [dataplane]) and not reproduced since: what up said goes with it.
        print(f"--- the tail of {log} ---\n{log.read_text(errors='replace')[-12_000:]}")
        raise
    finally:
        code = stop_up(up)
        assert code == 0, f"up exited with {code}:\n{log.read_text(errors='replace')[-4000:]}"
