"""The whole stack as a user runs it: `luftpause up` with every service a real child process.

One stack per module, on ports of its own (a config file with `--with-fakes`), driven by the
official `mcp` and `openai` clients the way the README tells a newcomer to.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mcp import Client
from openai import OpenAI
from support import Ports, start_up, stop_up, tcp_open, wait_until, write_config

STACK_START_S = 60.0


@dataclass
class Stack:
    ports: Ports
    proc: subprocess.Popen
    log: Path
    state_dir: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pid_of(self, child: str) -> int:
        pids = re.findall(rf"started {re.escape(child)} \(pid (\d+)", self.output())
        assert pids, f"no start line for {child} in:\n{self.output()[-2000:]}"
        return int(pids[-1])

    @property
    def mcp_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.runtime}/mcp"

    @property
    def openai_base(self) -> str:
        return f"http://127.0.0.1:{self.ports.dataplane}/v1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("stack")
    ports = Ports()
    conf = write_config(directory, ports)
    log = directory / "up.log"
    proc = start_up(conf, log, STACK_START_S)
    s = Stack(ports, proc, log, directory / "state")
    try:
        yield s
    finally:
        stop_up(proc)


def test_up_shows_each_service_healthy_and_how_to_connect(stack: Stack) -> None:
    out = stack.output()
    for child in ("fake-a", "fake-b", "fake-mcp", "scheduler", "dataplane", "runtime"):
        assert re.search(rf"{re.escape(child)}\s+healthy", out), f"{child} not reported healthy:\n{out}"
    assert f"claude mcp add --transport http luftpause http://localhost:{stack.ports.runtime}/mcp" in out
    assert f"http://localhost:{stack.ports.dataplane}/v1" in out


async def test_sixteen_sub_agents_fan_out_and_come_back_in_one_await(stack: Stack) -> None:
    async with Client(stack.mcp_url) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"spawn", "await", "status", "cancel"} <= names
        handles = []
        for i in range(16):
            spawned = await client.call_tool("spawn", {"task": f"Find three facts about river number {i}."})
            assert not spawned.is_error, spawned.content
            handles.append(spawned.structured_content["handle"])
        assert len(set(handles)) == 16
        awaited = await client.call_tool("await", {"handles": handles, "mode": "all", "timeout": 120})
        assert not awaited.is_error, awaited.content
    body = awaited.structured_content
    assert body["timedOut"] is False
    runs = body["runs"]
    assert sorted(r["handle"] for r in runs) == sorted(handles)
    assert all(r["status"] == "finished" for r in runs), runs
    assert all(r["toolCalls"] >= 1 for r in runs), [r["toolCalls"] for r in runs]
    assert all(r["result"] for r in runs)

    journal = [json.loads(line) for line in (stack.state_dir / "runs.jsonl").read_text().splitlines()]
    finished = {rec["run"] for rec in journal if rec["type"] == "finished"}
    assert set(handles) <= finished


def test_openai_client_streams_and_a_continuation_stays_on_its_replica(stack: Stack) -> None:
    client = OpenAI(base_url=stack.openai_base, api_key="unused")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look something up.",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            },
        }
    ]
    messages: list[dict] = [{"role": "user", "content": "What is the longest river in Europe?"}]
    raw = client.chat.completions.with_raw_response.create(
        model="fake-llama", messages=messages, tools=tools, stream=True
    )
    run_id = raw.headers["x-luftpause-run-id"]
    assert run_id
    chunks = list(raw.parse())
    fingerprint = next(c.system_fingerprint for c in chunks if c.system_fingerprint)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] = (tc.function.name if tc.function else None) or slot["name"]
                slot["arguments"] += (tc.function.arguments if tc.function else None) or ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and calls

    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ],
        }
    )
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "The Volga."} for c in calls.values()]
    # Several continuations in a row: every one must land where the run's prefix is.
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="fake-llama",
            messages=messages,
            tools=tools,
            extra_headers={"x-luftpause-run-id": run_id},
        )
        assert raw.headers["x-luftpause-run-id"] == run_id
        reply = raw.parse()
        assert reply.system_fingerprint == fingerprint
        msg = reply.choices[0].message
        if reply.choices[0].finish_reason != "tool_calls":
            break
        messages.append(msg.model_dump(exclude_none=True))
        messages += [
            {"role": "tool", "tool_call_id": tc.id, "content": "More."} for tc in msg.tool_calls or []
        ]


def test_unknown_model_is_refused_at_once(stack: Stack) -> None:
    # A held turn waits until a replica takes it or its client leaves, and no replica will take
    # this one: had it queued, this client would be waiting still when its timeout came. So an
    # answer at all, the 404 naming the model, is the refusal at its arrival, however loaded the
    # machine (a bound on the clock told nothing more, and failed when the machine was slow).
    try:
        r = httpx.post(
            f"{stack.openai_base}/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    except httpx.TimeoutException:
        pytest.fail("no answer in 30 s: the turn of a model no replica serves was held, not refused")
    assert r.status_code == 404
    assert "no-such-model" in r.json()["error"]["message"]


def test_a_child_that_dies_is_restarted_and_reported(stack: Stack) -> None:
    import os

    pid = stack.pid_of("fake-mcp")
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: "fake-mcp healthy again" in stack.output(),
        30,
        what="luftpause up to restart fake-mcp",
    )
    out = stack.output()
    assert re.search(rf"fake-mcp \(pid {pid}\) exited with code -9; restarting", out), out[-2000:]
    assert stack.pid_of("fake-mcp") != pid
    assert tcp_open(stack.ports.fake_mcp)


def test_the_own_loop_example_keeps_its_run_on_one_replica(
    stack: Stack, capsys: pytest.CaptureFixture
) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "own_loop_agent.py"
    spec = importlib.util.spec_from_file_location("own_loop_agent", path)
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for task in ("How long is the Volga?", "Where does the Rhine rise?", "Name a river in Portugal."):
        result = example.run_agent(stack.openai_base, "fake-llama", task, caller="example-test")
        assert result["answer"]
        assert len(result["replicas"]) >= 2  # at least one tool round
        assert len(set(result["replicas"])) == 1, result["replicas"]
        status = httpx.get(f"http://127.0.0.1:{stack.ports.status}/status/runs/{result['run_id']}").json()
        assert status["replica"] == result["replicas"][0] and status["caller"] == "example-test"
    assert "turn 1 on fake-" in capsys.readouterr().out
