"""Own-loop agents in front of a model whose replies mean nothing: the agent decides each run's
tool calls, keeps its tools in every turn, pins runs to engines without a front (a stub engine
over httpx's mock transport, no processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
from support import until

from luftpause.loadgen import agents
from luftpause.loadgen.conversation import TOOLS


class StubEngine:
    """Answers every chat turn with text (or, when told, a tool call) and records what it got."""

    def __init__(self, name: str, tool_call: dict[str, Any] | None = None) -> None:
        self.name = name
        self.tool_call = tool_call
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.deleted: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.deleted.append(request.url.path.rsplit("/", 1)[1])
            return httpx.Response(204)
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        message: dict[str, Any] = {"role": "assistant", "content": "qzx blorp vant"}
        if self.tool_call is not None:
            message["tool_calls"] = [self.tool_call]
        return httpx.Response(200, json={"choices": [{"message": message}], "system_fingerprint": self.name})


def _client(engine: StubEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://{engine.name}", transport=httpx.MockTransport(engine))


def _spec(**kw: Any) -> agents.LoadSpec:
    defaults: dict[str, Any] = {
        "url": "http://unused",
        "agents": 1,
        "duration_s": 60.0,
        "service_class": "interactive",
        "caller": "tester",
        "context_chars": 600,
        "tool_latency_s": 0.0,
        "seed": "s",
        "max_tokens": 32,
        "tool_calls": (1, 3),
    }
    return agents.LoadSpec(**{**defaults, **kw})


def _run(clients: list[httpx.AsyncClient], spec: agents.LoadSpec, runs: int) -> agents.Tally:
    """Runs one agent until it has finished `runs` runs (then cancels it)."""
    tally = agents.Tally()

    async def main() -> None:
        task = asyncio.create_task(agents._agent(clients, spec, 0, time.monotonic() + 60, tally))
        try:
            await until(lambda: tally.runs >= runs, timeout_s=20, what=f"the agent to finish {runs} runs")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for c in clients:
                await c.aclose()

    asyncio.run(main())
    return tally


def _runs(engine: StubEngine) -> list[list[dict[str, Any]]]:
    """The turns the engine got, grouped by run id."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for body, headers in zip(engine.bodies, engine.headers, strict=True):
        by_run.setdefault(headers["x-luftpause-run-id"], []).append(body)
    return list(by_run.values())


def test_the_agent_decides_each_runs_tool_calls_from_its_task_and_keeps_its_tools() -> None:
    engine = StubEngine("a")
    tally = _run([_client(engine)], _spec(), runs=6)
    # Each run's calls are a stable hash of its first user message, in the range given.
    expected = [
        agents.planned_tool_calls(turns[0]["messages"][1]["content"], (1, 3)) for turns in _runs(engine)[:6]
    ]
    assert set(expected) <= {1, 2, 3}
    runs = _runs(engine)[:6]
    assert [len(turns) - 1 for turns in runs] == expected  # n tool calls, then the turn that ends it
    for turns in runs:
        for k, body in enumerate(turns):
            assert body["tools"] == TOOLS and body["max_tokens"] == 32  # the prefix never changes
            # Each turn adds the last reply, with a call of the agent's own, and the tool's result.
            assert len(body["messages"]) == 2 + 2 * k
            if k:
                said, answer = body["messages"][-2], body["messages"][-1]
                assert said["role"] == "assistant" and said["content"] == "qzx blorp vant"
                (call,) = said["tool_calls"]
                assert json.loads(call["function"]["arguments"])["query"].startswith(f"fact {k} of task")
                assert answer == {"role": "tool", "tool_call_id": call["id"], "content": answer["content"]}
            assert turns[0]["messages"] == body["messages"][:2]  # the same opening
    assert tally.errors == 0 and tally.tool_calls >= sum(expected)
    # Each run ends with its run end, in order, once its last turn is answered.
    run_ids = list(dict.fromkeys(h["x-luftpause-run-id"] for h in engine.headers))
    assert engine.deleted[:6] == run_ids[:6]


def test_run_ids_and_run_lengths_are_a_function_of_the_seed() -> None:
    first, second, other = StubEngine("a"), StubEngine("a"), StubEngine("a")
    _run([_client(first)], _spec(), runs=4)
    _run([_client(second)], _spec(), runs=4)
    _run([_client(other)], _spec(seed="t"), runs=4)

    def shape(engine: StubEngine) -> list[tuple[str, int]]:
        ids = list(dict.fromkeys(h["x-luftpause-run-id"] for h in engine.headers))[:4]
        return [(i, sum(h["x-luftpause-run-id"] == i for h in engine.headers)) for i in ids]

    assert shape(first) == shape(second)
    assert [i for i, _ in shape(other)] != [i for i, _ in shape(first)]


def test_a_usable_tool_call_of_the_models_is_kept_and_an_unusable_one_replaced() -> None:
    usable = {"id": "m1", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "q"}'}}
    engine = StubEngine("a", tool_call=usable)
    _run([_client(engine)], _spec(tool_calls=(2, 2)), runs=1)
    turns = _runs(engine)[0]
    assert len(turns) == 3
    assert turns[-1]["messages"][2]["tool_calls"] == [usable]
    assert turns[-1]["messages"][3]["tool_call_id"] == "m1"

    broken = {"id": "", "type": "function", "function": {"name": "lookup", "arguments": '{"query": '}}
    engine = StubEngine("b", tool_call=broken)
    _run([_client(engine)], _spec(tool_calls=(1, 1)), runs=1)
    (call,) = _runs(engine)[0][-1]["messages"][2]["tool_calls"]
    assert call["id"].startswith("call_") and json.loads(call["function"]["arguments"])["query"]


def test_without_a_front_each_run_stays_on_the_engine_its_id_hashes_to_and_no_run_end_is_sent() -> None:
    engines = [StubEngine("a"), StubEngine("b")]
    _run([_client(e) for e in engines], _spec(end_runs=False), runs=8)
    seen: dict[str, set[int]] = {}
    for i, engine in enumerate(engines):
        assert engine.deleted == []
        for h in engine.headers:
            seen.setdefault(h["x-luftpause-run-id"], set()).add(i)
    assert len(seen) >= 8
    assert all(where == {agents.pinned(run, 2)} for run, where in seen.items())
    assert {next(iter(w)) for w in seen.values()} == {0, 1}  # both engines get runs


def test_the_pin_is_stable_and_spreads_runs() -> None:
    # The same in another process with another hash seed, as the real bench's processes need.
    elsewhere = subprocess.run(
        [sys.executable, "-c", "from luftpause.loadgen import agents; print([agents.pinned(f'run-{i}', 3) for i in range(50)])"],
        env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert elsewhere.stdout.strip() == str([agents.pinned(f"run-{i}", 3) for i in range(50)])
    counts = [0, 0, 0]
    for i in range(3000):
        counts[agents.pinned(f"run-{i}", 3)] += 1
    assert all(900 < c < 1100 for c in counts)


def test_the_summary_has_the_99th_percentile() -> None:
    tally = agents.Tally(runs=100, run_times=[float(i) for i in range(1, 101)])
    summary = tally.summary(_spec())
    assert summary["run_time_p50_s"] == 50.5
    assert summary["run_time_p90_s"] == 90.1
    assert summary["run_time_p99_s"] == 99.01
