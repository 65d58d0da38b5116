"""The dataplane end to end: real scheduler, two real fake engines and the dataplane as processes.

One stack serves the whole module. Its scheduler probes once a long while, so that a third
replica, "ghost" (model "ghost-llama"), which answered its first health probe and then closed
its port, stays in rotation: that is the engine-unreachable case. After every test the
scheduler's /status must show nothing in flight and nothing held.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from support import HealthOnly, Ports, Service, amend_config, free_port, running, wait_until, write_config

MODEL = "fake-llama"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


@dataclass
class Stack:
    ports: Ports
    dataplane: str
    status: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("dataplane-stack")
    ports = Ports()
    ghost = ThreadingHTTPServer(("127.0.0.1", free_port()), HealthOnly)
    threading.Thread(target=ghost.serve_forever, daemon=True).start()
    ghost_replica = f'[[replicas]]\nname = "ghost"\nurl = "http://127.0.0.1:{ghost.server_port}"\nmodels = ["ghost-llama"]\n'
    path = write_config(tmp, ports, extra=ghost_replica)
    amend_config(path, "[scheduler]\nprobe_period_s = 600")

    engines = [
        Service(name, ["fake-engine", "--name", name, "--port", str(port)], tmp / f"{name}.log")
        for name, port in zip(("fake-a", "fake-b"), ports.engines, strict=True)
    ]
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp / "dataplane.log")
    status = f"http://127.0.0.1:{ports.status}/status"
    try:
        with running(*engines, scheduler, dataplane):
            for engine in engines:
                engine.start()
            for engine, port in zip(engines, ports.engines, strict=True):
                engine.wait_http(f"http://127.0.0.1:{port}/health")
            scheduler.start()
            dataplane.start()
            scheduler.wait_http(status)
            dataplane.wait_http(f"http://127.0.0.1:{ports.dataplane}/health")

            def all_probed() -> bool:
                replicas = httpx.get(status).json()["replicas"]
                return all(r["probed"] and r["healthy"] for r in replicas)

            wait_until(all_probed, what="every replica to pass its first probe")
            ghost.shutdown()
            ghost.server_close()
            wait_until(
                lambda: (
                    httpx.get(f"http://127.0.0.1:{ports.dataplane}/health").json()["scheduler"] == "connected"
                ),
                what="the dataplane to connect to the scheduler",
            )
            yield Stack(ports, f"http://127.0.0.1:{ports.dataplane}", status)
    finally:
        ghost.server_close()


@pytest.fixture(autouse=True)
def nothing_left_in_flight(stack: Stack) -> Iterator[None]:
    yield

    def settled() -> bool:
        doc = httpx.get(stack.status).json()
        return sum(r["in_flight"] for r in doc["replicas"]) == 0 and doc["held"]["count"] == 0

    wait_until(settled, timeout_s=10, what="the scheduler to show no turn in flight or held")


def _chat(stack: Stack, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{stack.dataplane}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def test_a_whole_completion_passes_through_with_run_and_replica(stack: Stack):
    r = _chat(
        stack,
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]},
        {"x-luftpause-run-id": "plain-1"},
    )
    assert r.status_code == 200
    assert r.headers["x-luftpause-run-id"] == "plain-1"
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
    assert body["system_fingerprint"] == r.headers["x-luftpause-replica"]
    assert body["system_fingerprint"] in ("fake-a", "fake-b")


def test_a_stream_passes_through_chunk_by_chunk(stack: Stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream it"}], "stream": True}
    with httpx.stream("POST", f"{stack.dataplane}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        replica = r.headers["x-luftpause-replica"]
        run_id = r.headers["x-luftpause-run-id"]
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) > 2
    assert {c["system_fingerprint"] for c in chunks} == {replica}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(run_id) == 32


def test_the_openai_client_streams_a_completion(stack: Stack):
    client = OpenAI(base_url=f"{stack.dataplane}/v1", api_key="x")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "from the openai package"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-luftpause-run-id": "openai-1", "x-luftpause-caller": "tests"},
    )
    assert raw.headers["x-luftpause-run-id"] == "openai-1"
    replica = raw.headers["x-luftpause-replica"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert {c.system_fingerprint for c in chunks} == {replica}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def _tool_run(stack: Stack, task: str, run_id: str | None) -> tuple[list[str], list[str], int]:
    """Runs one agent loop to its end; returns the replica and run id of each turn, and the tool calls."""
    messages: list[dict] = [{"role": "user", "content": task}]
    replicas, run_ids, tool_calls = [], [], 0
    for _ in range(6):
        r = _chat(
            stack,
            {"model": MODEL, "messages": messages, "tools": [LOOKUP]},
            {"x-luftpause-run-id": run_id} if run_id else None,
        )
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["system_fingerprint"] == r.headers["x-luftpause-replica"]
        replicas.append(reply["system_fingerprint"])
        run_ids.append(r.headers["x-luftpause-run-id"])
        choice = reply["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            return replicas, run_ids, tool_calls
        messages.append(choice["message"])
        for call in choice["message"]["tool_calls"]:
            tool_calls += 1
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"result of {call['id']}"}
            )
    raise AssertionError(f"run {task!r} did not finish")


def test_runs_paused_on_tools_come_back_to_the_same_replica(stack: Stack):
    tasks = [f"research topic {i}" for i in range(8)]
    with ThreadPoolExecutor(len(tasks)) as pool:
        results = list(pool.map(lambda i: _tool_run(stack, tasks[i], f"tool-run-{i}"), range(len(tasks))))
    for (replicas, run_ids, tool_calls), i in zip(results, range(len(tasks)), strict=True):
        assert tool_calls >= 1
        assert len(set(replicas)) == 1, f"run {i} moved between replicas: {replicas}"
        assert set(run_ids) == {f"tool-run-{i}"}


def test_runs_without_a_header_are_found_by_the_tool_call_ids_they_echo(stack: Stack):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _tool_run(stack, f"no header, task {i}", None), range(4)))
    for replicas, run_ids, tool_calls in results:
        assert tool_calls >= 1
        assert len(set(run_ids)) == 1, "every turn of the run got the run id of its first"
        assert len(set(replicas)) == 1
    assert len({run_ids[0] for _, run_ids, _ in results}) == 4, "each run has its own id"


def test_an_unknown_model_is_a_404_at_once(stack: Stack):
    # Held, the turn would wait for a replica that never comes until the client's timeout ended
    # the request: the 404 answering it at all is its refusal on arrival (no clock needed).
    r = _chat(stack, {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no Generative replica serves model 'no-such-model'"}}
    assert r.headers["x-luftpause-run-id"]


def test_a_bad_class_header_is_a_400(stack: Stack):
    r = _chat(
        stack,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        {"x-luftpause-class": "premium"},
    )
    assert r.status_code == 400
    assert "interactive" in r.json()["error"]["message"] and "batch" in r.json()["error"]["message"]
    assert r.headers["x-luftpause-run-id"]


def test_an_unreachable_engine_is_a_502_naming_the_replica(stack: Stack):
    r = _chat(
        stack,
        {"model": "ghost-llama", "messages": [{"role": "user", "content": "hi"}]},
        {"x-luftpause-run-id": "ghost-run"},
    )
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert message.startswith("engine ghost: ") and len(message) > len("engine ghost: ")
    assert r.headers["x-luftpause-run-id"] == "ghost-run"
    assert r.headers["x-luftpause-replica"] == "ghost"


def test_ending_a_run_makes_the_scheduler_forget_it(stack: Stack):
    r = _chat(
        stack,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        {"x-luftpause-run-id": "ending"},
    )
    assert r.status_code == 200
    run_url = f"{stack.status}/runs/ending"
    wait_until(lambda: httpx.get(run_url).status_code == 200, timeout_s=5, what="the run to be known")
    ended = httpx.delete(f"{stack.dataplane}/v1/runs/ending")
    assert ended.status_code == 204 and ended.headers["x-luftpause-run-id"] == "ending"
    wait_until(
        lambda: httpx.get(run_url).status_code == 404, timeout_s=5, what="the scheduler to forget the run"
    )
