"""A real runtime started on a damaged journal starts, answers, stays idle and runs nothing twice.

Real processes on loopback: a fake engine (standing in for the dataplane), the fake MCP server
and `luftpause runtime`, driven by the official `mcp` client. Before the runtime first starts,
its `runs.jsonl` holds, as an edited or damaged file may:

- a run that finished, followed by a second `spawned` record of it (a copy pasted back in);
- a `spawned` record whose fields are all there but of the wrong type (`"at": "yesterday"`);
- an unfinished run whose spec names itself as its parent.

The runtime must start and answer over MCP and on /status; its CPU must stay well below one core
(a run that is its own parent made its subtree endless, and walking it never ended); the run
that names itself its parent is restored alone and resumes to the end; the damaged record costs
only its own run; and the finished run stays finished with its answer, never run again (its
copied `spawned` record made it a fresh run that resumed from the start).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
from mcp import Client
from support import running, runtime_beside_fakes

FINISHED = "run-0f1a2b3c4d5e6f708192"
MISTYPED = "run-1a2b3c4d5e6f70819203"
OWN_PARENT = "run-2b3c4d5e6f7081920314"
ANSWER = "The answer it gave before the restart."
CPU_WINDOW_S = 2.0


def spawned(handle: str, task: str, at: object, parent: str | None = None) -> dict:
    spec = {
        "task": task,
        "model": "fake-llama",
        "serviceClass": "interactive",
        "system": None,
        "maxToolCalls": 8,
        "tools": None,
        "maxTokens": 256,
        "parallelToolCalls": False,
        "parent": parent,
        "budgetTokens": None,
        "budgetToolCalls": None,
        "budgetSeconds": None,
        "approveTools": None,
    }
    return {"v": 1, "type": "spawned", "run": handle, "at": at, "spec": spec, "caller": None}


def damaged_journal(now: float) -> list[dict]:
    counters = {
        "toolCalls": 1,
        "failedToolCalls": 0,
        "turns": 2,
        "promptTokens": 500,
        "completionTokens": 250,
    }
    finished = {"v": 1, "type": "finished", "run": FINISHED, "at": now - 50, "status": "finished"}
    return [
        spawned(FINISHED, "a task finished before the restart", now - 60),
        {**finished, "result": ANSWER, "error": None, **counters},
        spawned(FINISHED, "a task finished before the restart", now - 40),
        spawned(MISTYPED, "a task whose record is mistyped", "yesterday"),
        spawned(OWN_PARENT, "a task that names itself its parent", now - 30, parent=OWN_PARENT),
    ]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of the process so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_page(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()


def records(journal: Path, handle: str) -> list[dict]:
    lines = journal.read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.endswith("}")) if r.get("run") == handle]


async def test_a_damaged_journal_neither_stops_nor_spins_the_runtime_nor_runs_a_finished_run_again(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    journal = state / "runs.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in damaged_journal(time.time())))
    fakes = runtime_beside_fakes(tmp_path, state, tool_latency_s=0.2)
    engine, tools, runtime = fakes.engine, fakes.tools, fakes.runtime
    port, engine_port, mcp_port = fakes.port, fakes.engine_port, fakes.mcp_port

    with running(engine, tools, runtime):
        engine.start(), tools.start()
        engine.wait_http(f"http://127.0.0.1:{engine_port}/health")
        tools.wait_http(f"http://127.0.0.1:{mcp_port}/health")
        runtime.start()
        assert runtime.proc is not None
        cpu_at_start, started = cpu_seconds(runtime.proc.pid), time.monotonic()
        try:
            runtime.wait_http(f"http://127.0.0.1:{port}/status", timeout_s=20)
        except TimeoutError:
            share = (cpu_seconds(runtime.proc.pid) - cpu_at_start) / (time.monotonic() - started)
            raise AssertionError(f"the runtime does not answer, using {share:.0%} of a core") from None
        assert {r["handle"] for r in status_page(port)["runs"]} == {FINISHED, OWN_PARENT}

        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            seen = await client.call_tool("status", {})
            assert not seen.is_error, seen.content
            views = {r["handle"]: r for r in seen.structured_content["runs"]}
            assert set(views) == {FINISHED, OWN_PARENT}
            assert (views[FINISHED]["status"], views[FINISHED]["result"]) == ("finished", ANSWER)
            assert views[OWN_PARENT]["children"] == [], "a run that is its own parent stands alone"
            unknown = await client.call_tool("status", {"handle": MISTYPED})
            assert unknown.is_error, "the mistyped record's run is skipped, not half restored"

            # The run that names itself its parent resumes and finishes on its own.
            awaited = await client.call_tool("await", {"handles": [OWN_PARENT], "timeout": 60})
            assert not awaited.is_error, awaited.content
            (own,) = awaited.structured_content["runs"]
            assert own["status"] == "finished" and own["result"], own

            # Nothing left to do: the runtime sits idle, it does not spin.
            before, started = cpu_seconds(runtime.proc.pid), time.monotonic()
            await asyncio.sleep(CPU_WINDOW_S)  # the window CPU time is measured over, not a wait
            share = (cpu_seconds(runtime.proc.pid) - before) / (time.monotonic() - started)
            # The runtime's own CPU time, which other processes' load can only lower (a spinning
            # one gets less of a core on a busy machine), never raise: no flake from a slow machine.
            assert share < 0.25, f"the idle runtime used {share:.0%} of a core"

            again = await client.call_tool("status", {"handle": FINISHED})
            assert not again.is_error, again.content
            (view,) = again.structured_content["runs"]
            assert (view["status"], view["result"], view["turns"]) == ("finished", ANSWER, 2)

        # The finished run was not run again: the journal has no new step of it, only its end.
        mine = records(journal, FINISHED)
        assert [r["type"] for r in mine if r["type"] != "spawned"] == ["finished"], mine
        assert mine[-1]["result"] == ANSWER
        assert "malformed" in runtime.output() and "spawned a second time" in runtime.output()
