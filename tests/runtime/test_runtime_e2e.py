"""The runtime as a harness sees it: real processes, the official `mcp` client, both wires.

A fake engine stands in for the dataplane (it speaks the same OpenAI API) and the fake MCP server
supplies `lookup` and `deep_search` (about a second each). The fake engine plans 1 to 3 tool calls
per conversation from a hash of its task, so every finished run has made at least one tool call,
and a task can be picked for how many it will make.
"""

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mcp import Client
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from support import Service, call, free_port, task_planning, wait_until, write_runtime_config

from luftpause.runtime.spec import RunSpec

TOOLS = {"spawn", "await", "run", "status", "cancel", "approve", "tools", "decide"}


@dataclass
class Backends:
    engine_port: int
    mcp_port: int


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> Iterator[Backends]:
    logs = tmp_path_factory.mktemp("backends")
    b = Backends(engine_port=free_port(), mcp_port=free_port())
    engine = Service(
        "fake-engine", ["fake-engine", "--name", "fake-a", "--port", str(b.engine_port)], logs / "e.log"
    )
    tools = Service("fake-mcp", ["fake-mcp", "--port", str(b.mcp_port)], logs / "m.log")
    engine.start(), tools.start()
    try:
        engine.wait_http(f"http://127.0.0.1:{b.engine_port}/health")
        tools.wait_http(f"http://127.0.0.1:{b.mcp_port}/health")
        yield b
    finally:
        tools.stop()
        engine.stop()


@dataclass
class Runtime:
    service: Service
    port: int
    state_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def journal(self) -> Path:
        return self.state_dir / "runs.jsonl"

    def start(self) -> "Runtime":
        self.service.start()
        self.service.wait_http(f"http://127.0.0.1:{self.port}/status")
        return self

    def records(self) -> list[dict]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines() if line.endswith("}")]


def make_runtime(directory: Path, backends: Backends) -> Runtime:
    """A runtime whose dataplane is the fake engine itself, with the fake MCP server as its tools."""
    port = free_port()
    state = directory / "state"
    config = write_runtime_config(directory, port, backends.engine_port, backends.mcp_port, state)
    service = Service("runtime", ["runtime", "--config", str(config)], directory / "runtime.log")
    return Runtime(service, port, state)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, backends) -> Iterator[Runtime]:
    rt = make_runtime(tmp_path_factory.mktemp("runtime"), backends).start()
    try:
        yield rt
    finally:
        rt.service.stop()


async def error_of(client: Client, tool: str, **arguments) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error
    return result.content[0].text


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_spawned_runs_use_tools_and_finish_on_both_wires(runtime, mode):
    async with Client(runtime.url, mode=mode) as client:
        if mode == "auto":
            assert client.protocol_version in MODERN_PROTOCOL_VERSIONS  # the sessionless wire
        assert {t.name for t in (await client.list_tools()).tools} == TOOLS
        handles = [
            (await call(client, "spawn", task=f"{mode} fan-out {i}", maxTokens=16))["handle"]
            for i in range(3)
        ]
        assert len(set(handles)) == 3

        awaited = await call(client, "await", handles=handles, timeout=60)

    assert awaited["timedOut"] is False
    assert [r["handle"] for r in awaited["runs"]] == handles
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"http://127.0.0.1:{runtime.port}/status")).json()["runs"]
    callers = {r["caller"] for r in listed if r["handle"] in handles}
    assert len(callers) == 1 and None not in callers  # one client, one caller identity for the scheduler
    for run in awaited["runs"]:
        assert run["status"] == "finished" and run["error"] is None and run["result"]
        assert run["toolCalls"] >= 1 and run["failedToolCalls"] == 0
        assert run["turns"] == run["toolCalls"] + 1


def test_post_mcp_answers_directly_without_a_redirect(runtime):
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "probe", "version": "1"},
        },
    }
    response = httpx.post(
        runtime.url,
        json=initialize,
        headers={"accept": "application/json, text/event-stream"},
        follow_redirects=False,
    )
    assert response.status_code == 200
    assert response.headers.get("mcp-session-id")


async def test_await_times_out_then_any_then_all(runtime):
    async with Client(runtime.url) as client:
        tasks = [task_planning(1, "timeout probe"), task_planning(1, "another timeout probe")]
        handles = [(await call(client, "spawn", task=task, maxTokens=16))["handle"] for task in tasks]

        # Every run makes at least one tool call of about a second, so none is done yet.
        early = await call(client, "await", handles=handles, timeout=0.05)
        assert early["timedOut"] is True
        assert [r["status"] for r in early["runs"]] == ["running", "running"]

        first = await call(client, "await", handles=handles, mode="any", timeout=60)
        assert first["timedOut"] is False
        assert any(r["status"] == "finished" for r in first["runs"])

        both = await call(client, "await", handles=handles, mode="all", timeout=60)
        assert both["timedOut"] is False and all(r["status"] == "finished" for r in both["runs"])


async def test_status_and_cancel(runtime):
    async with Client(runtime.url, mode="legacy") as client:
        handle = (await call(client, "spawn", task=task_planning(3, "long job"), serviceClass="batch"))[
            "handle"
        ]
        (running,) = (await call(client, "status", handle=handle))["runs"]
        assert running["status"] == "running" and running["result"] is None

        cancelled = await call(client, "cancel", handle=handle)
        assert cancelled["status"] == "cancelled" and cancelled["error"]

        awaited = await call(client, "await", handles=[handle], timeout=5)
        assert awaited["timedOut"] is False and awaited["runs"][0]["status"] == "cancelled"
        everyone = (await call(client, "status"))["runs"]
        assert {r["handle"]: r["status"] for r in everyone}[handle] == "cancelled"

        assert "unknown run handle 'run-nope'" in await error_of(client, "cancel", handle="run-nope")
        assert "unknown run handle 'run-nope'" in await error_of(client, "await", handles=["run-nope"])
        assert "maxToolCalls" in await error_of(client, "spawn", task="x", maxToolCalls=-1)
        message = await error_of(client, "spawn", task="x", tools=["lookup", "telepathy"])
        assert "unknown tools: telepathy" in message and "deep_search, lookup" in message

    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"http://127.0.0.1:{runtime.port}/status")).json()["runs"]
    (entry,) = [r for r in listed if r["handle"] == handle]
    assert entry["status"] == "cancelled" and entry["parent"] is None and entry["serviceClass"] == "batch"
    assert entry["task"].startswith("long job")
    assert {"toolCalls", "failedToolCalls", "turns", "promptTokens", "completionTokens"} <= entry.keys()
    ends = [r for r in runtime.records() if r["run"] == handle and r["type"] == "finished"]
    assert [e["status"] for e in ends] == ["cancelled"]


async def test_the_journal_records_spawn_each_tool_round_and_the_end(runtime):
    task = task_planning(2, "journaled")
    async with Client(runtime.url) as client:
        handle = (await call(client, "spawn", task=task, maxTokens=16))["handle"]
        (run,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]

    records = [r for r in runtime.records() if r["run"] == handle]
    # Each round is journaled as it happens (the reply asking for a tool, the call's answer),
    # then whole.
    assert [r["type"] for r in records] == [
        "spawned",
        *["turn", "sent", "call", "round"] * 2,
        "finished",
    ]
    spawned, turn, sent, call_record, round_one = records[:5]
    finished = records[-1]
    assert round_one["messages"] == [turn["message"], call_record["message"]]
    # The call is journaled as sent, under its idempotency key, before it leaves.
    assert sent["call"] == turn["message"]["tool_calls"][0]["id"] == call_record["message"]["tool_call_id"]
    assert sent["key"] == f"{spawned['run']}/0/0" and sent["toolCalls"] == 1
    assert spawned["spec"]["task"] == task and spawned["spec"]["maxTokens"] == 16
    assert spawned["spec"]["maxToolCalls"] == 8 and spawned["spec"]["serviceClass"] == "interactive"
    assistant, tool = round_one["messages"]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["function"]["name"] in {
        "lookup",
        "deep_search",
    }
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert finished["status"] == "finished" and finished["result"] == run["result"]
    assert finished["toolCalls"] == 2 and finished["turns"] == 3


async def test_after_a_crash_finished_runs_answer_and_unfinished_ones_resume(tmp_path, backends):
    rt = make_runtime(tmp_path, backends).start()
    try:
        async with Client(rt.url, mode="legacy") as client:
            done = (await call(client, "spawn", task=task_planning(1, "quick"), maxTokens=16))["handle"]
            (before,) = (await call(client, "await", handles=[done], timeout=60))["runs"]
            long = (await call(client, "spawn", task=task_planning(2, "long"), maxTokens=16))["handle"]
        wait_until(
            lambda: any(r["run"] == long and r["type"] == "round" for r in rt.records()),
            timeout_s=30,
            what="the long run's first tool round in the journal",
        )
        rt.service.kill(signal.SIGKILL)
        with rt.journal.open("a") as f:
            f.write('{"v":1,"type":"round","run":"' + long + '","messages":[{"ro')  # torn by the crash

        rt.start()
        async with Client(rt.url) as client:
            (after,) = (await call(client, "await", handles=[done], timeout=0))["runs"]
            assert after == before
            (resumed,) = (await call(client, "await", handles=[long], timeout=60))["runs"]
        # Resumed after its first round: one more tool call, then the answer, as if never stopped.
        assert resumed["status"] == "finished" and resumed["toolCalls"] == 2 and resumed["turns"] == 3
        assert "not a complete JSON record" in rt.service.output()
        assert f"run {long}: resuming" in rt.service.output()
    finally:
        rt.service.stop()


def test_the_journal_is_created_where_the_state_dir_says(tmp_path, backends):
    rt = make_runtime(tmp_path, backends)
    assert not rt.state_dir.exists()
    rt.start()
    try:
        assert rt.journal.exists()
    finally:
        rt.service.stop()


def _journaled_run(
    handle: str, task: str, finished_ago_s: float | None, parent: str | None = None
) -> list[dict]:
    """A run's records as a runtime writes them (journal.py), ended `finished_ago_s` ago."""
    now = time.time()
    spec = RunSpec(task=task, model="fake-llama", parent=parent).model_dump()
    records = [
        {"v": 1, "type": "spawned", "run": handle, "at": now - 3600, "spec": spec, "caller": "a-session"}
    ]
    if finished_ago_s is not None:
        records.append({"v": 1, "type": "finished", "run": handle, "at": now - finished_ago_s, "status": "finished",
                        "result": f"answer to {task}", "error": None, "toolCalls": 1, "turns": 2})  # fmt: skip
    return records


async def test_with_the_default_window_runs_finished_minutes_ago_answer_from_the_archive(tmp_path, backends):
    """The default config: a tree whose runs all finished ten minutes ago is not held in memory
    (the start moves it to the archive; a running runtime does the same within a tenth of the
    window once it has passed), but each of its runs still answers by handle; the listing
    without a handle holds the runs that are running or finished within the window."""
    rt = make_runtime(tmp_path, backends)
    assert "retention_s" not in (tmp_path / "luftpause.toml").read_text()
    rt.state_dir.mkdir()
    records = [
        *_journaled_run("run-old-root", "old root", finished_ago_s=600),
        *_journaled_run("run-old-child", "old child", finished_ago_s=610, parent="run-old-root"),
        *_journaled_run("run-recent", "recent", finished_ago_s=5),
    ]
    rt.journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    rt.start()
    try:
        async with Client(rt.url, mode="legacy") as client:
            fresh = (await call(client, "spawn", task=task_planning(1, "fresh"), maxTokens=16))["handle"]
            listed = {r["handle"]: r["status"] for r in (await call(client, "status"))["runs"]}
            assert listed == {"run-recent": "finished", fresh: "running"}

            (root,) = (await call(client, "status", handle="run-old-root"))["runs"]
            assert (root["status"], root["result"]) == ("finished", "answer to old root")
            awaited = await call(client, "await", handles=["run-old-child", fresh], timeout=60)
            child, done = awaited["runs"]
            assert (child["status"], child["result"]) == ("finished", "answer to old child")
            assert child["parent"] == "run-old-root"
            assert done["status"] == "finished" and not awaited["timedOut"]
            unchanged = await call(client, "cancel", handle="run-old-root")
            assert unchanged == root, "an ended run is returned unchanged"
            listed = {r["handle"] for r in (await call(client, "status"))["runs"]}
            assert listed == {"run-recent", fresh}
        async with httpx.AsyncClient() as http:
            document = (await http.get(f"http://127.0.0.1:{rt.port}/status")).json()
        assert {r["handle"] for r in document["runs"]} == {"run-recent", fresh}
        archive = (rt.state_dir / "archive.jsonl").read_text().splitlines()
        assert sorted(json.loads(line)["run"] for line in archive) == ["run-old-child", "run-old-root"]
    finally:
        rt.service.stop()
