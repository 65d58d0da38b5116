"""The sub-agent loop against a scripted dataplane and scripted tools: what it sends, what it counts.

The dataplane is an httpx mock transport that answers from a script and records every request,
streaming each scripted completion when the turn asks for a stream (as the runtime's turns do);
the tool servers are a stand-in with the same three methods the loop uses.
"""

import asyncio
import json

import httpx
import pytest
from streamed_replies import calls_message, chunks, sse_response

from luftpause.runtime import llm
from luftpause.runtime.agent import Agent
from luftpause.runtime.journal import Journal, read_records
from luftpause.runtime.llm import Dataplane, retry_after_s
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.tool_servers import ToolResult, UpstreamTool

LOOKUP = UpstreamTool(
    server="fake",
    name="lookup",
    description="Looks a thing up.",
    input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
BROKEN = UpstreamTool(
    server="fake", name="broken", description="Always fails.", input_schema={"type": "object"}
)


class Tools:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.keys: list[str] = []

    def catalog(self):
        return {"lookup": LOOKUP, "broken": BROKEN}, []

    async def settled(self) -> None:
        return None

    async def call(self, tool: UpstreamTool, arguments: dict, idempotency_key: str = "") -> ToolResult:
        self.calls.append((tool.name, arguments))
        self.keys.append(idempotency_key)
        if tool.name == "broken":
            return ToolResult("it broke", is_error=True)
        return ToolResult(f"facts about {arguments['query']}", is_error=False)


def tool_call_reply(name: str, arguments: str, call_id: str = "call_1") -> httpx.Response:
    return completion(calls_message((call_id, name, arguments)))


def text_reply(text: str) -> httpx.Response:
    return completion({"role": "assistant", "content": text})


def completion(message: dict) -> httpx.Response:
    body = {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107},
    }
    return httpx.Response(200, json=body)


class Engine:
    """Answers chat completions from a script; records every request."""

    def __init__(self, *replies: httpx.Response | Exception) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "DELETE":
            return httpx.Response(204)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]  # the last repeats
        if isinstance(reply, Exception):
            raise reply
        if reply.status_code == 200 and json.loads(request.content).get("stream"):
            return sse_response(chunks(reply.json()))  # as the dataplane relays an engine's stream
        return reply

    @property
    def turns(self) -> list[dict]:
        return [json.loads(r.content) for r in self.requests if r.method == "POST"]

    @property
    def deleted(self) -> list[str]:
        return [r.url.path for r in self.requests if r.method == "DELETE"]


async def run_to_end(tmp_path, engine: Engine, tool_servers: Tools | None = None, **spec):
    dataplane = Dataplane("http://dataplane", transport=httpx.MockTransport(engine.handle))
    agent = Agent(dataplane, tool_servers or Tools(), default_model="fake-llama")
    runs = Runs(Journal(tmp_path), agent.drive, dataplane.end_run)
    run = runs.spawn(RunSpec(task="find rivers", model="fake-llama", **spec), "session-1")
    await asyncio.wait_for(run.task, 10)
    runs.journal.close()
    await dataplane.close()
    return run


async def test_a_run_calls_its_tool_then_answers(tmp_path):
    engine = Engine(tool_call_reply("lookup", '{"query": "rivers"}'), text_reply("The Rhine."))
    tools = Tools()
    run = await run_to_end(tmp_path, engine, tools, serviceClass="batch")

    assert (run.status, run.result, run.error) == ("finished", "The Rhine.", None)
    counts = {k: v for k, v in run.counters.items() if not k.endswith("Seconds")}
    assert counts == {
        "toolCalls": 1,
        "failedToolCalls": 0,
        "turns": 2,
        "promptTokens": 200,
        "completionTokens": 14,
    }
    assert run.counters["turnSeconds"] > 0 and run.counters["toolSeconds"] > 0
    assert tools.calls == [("lookup", {"query": "rivers"})]
    first, second = engine.turns
    assert first["model"] == "fake-llama" and first["max_tokens"] == 256
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["messages"] == [{"role": "user", "content": "find rivers"}]
    assert {t["function"]["name"] for t in first["tools"]} == {"lookup", "broken"}
    assert first["tools"][0]["function"]["parameters"] == LOOKUP.input_schema
    assert second["messages"][1]["tool_calls"][0]["id"] == "call_1"
    assert second["messages"][2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "facts about rivers",
    }
    headers = engine.requests[0].headers
    assert headers["x-luftpause-run-id"] == run.handle
    assert headers["x-luftpause-class"] == "batch"
    assert headers["x-luftpause-caller"] == "session-1"
    assert engine.deleted == [f"/v1/runs/{run.handle}"]
    kinds = [(r["type"], r["run"]) for r in read_records(tmp_path / "runs.jsonl")]
    assert [k for k, _ in kinds] == ["spawned", "turn", "sent", "call", "round", "finished"]
    assert {h for _, h in kinds} == {run.handle}


async def test_once_the_tool_budget_is_spent_no_tools_are_offered(tmp_path):
    engine = Engine(tool_call_reply("lookup", '{"query": "a"}'), text_reply("done"))
    run = await run_to_end(tmp_path, engine, maxToolCalls=1)
    first, second = engine.turns
    assert "tools" in first and "tools" not in second
    assert run.status == "finished" and run.counters["toolCalls"] == 1


async def test_zero_budget_and_zero_max_tokens_leave_tools_and_length_out(tmp_path):
    engine = Engine(text_reply("straight answer"))
    run = await run_to_end(tmp_path, engine, maxToolCalls=0, maxTokens=0)
    (only,) = engine.turns
    assert "tools" not in only and "max_tokens" not in only
    assert run.result == "straight answer" and run.counters["turns"] == 1


async def test_only_the_tools_the_run_may_use_are_offered(tmp_path):
    engine = Engine(text_reply("ok"))
    await run_to_end(tmp_path, engine, tools=["lookup"])
    assert [t["function"]["name"] for t in engine.turns[0]["tools"]] == ["lookup"]


@pytest.mark.parametrize(
    ("name", "arguments", "told"),
    [
        ("lookup", '{"query": "unterminated', "not valid JSON"),
        ("lookup", '{"q": "wrong key"}', "'query' is a required property"),
        ("nonexistent", "{}", "there is no tool named 'nonexistent'"),
        ("broken", "{}", "it broke"),
    ],
)
async def test_a_failed_call_is_counted_and_the_model_is_told_why(tmp_path, name, arguments, told):
    engine = Engine(tool_call_reply(name, arguments), text_reply("sorry"))
    tools = Tools()
    run = await run_to_end(tmp_path, engine, tools)
    assert run.status == "finished"
    assert run.counters["toolCalls"] == 1 and run.counters["failedToolCalls"] == 1
    tool_message = engine.turns[1]["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith("Error: ")
    assert told in tool_message["content"]
    assert tools.calls == ([("broken", {})] if name == "broken" else [])


async def test_a_call_written_as_text_is_run_as_a_call(tmp_path):
    engine = Engine(text_reply('{"name": "lookup", "parameters": {"query": "rivers"}}'), text_reply("found"))
    tools = Tools()
    run = await run_to_end(tmp_path, engine, tools)
    assert tools.calls == [("lookup", {"query": "rivers"})]
    assert run.result == "found" and run.counters["toolCalls"] == 1
    assistant = engine.turns[1]["messages"][1]
    assert assistant["content"] is None and assistant["tool_calls"][0]["function"]["name"] == "lookup"


async def test_a_429_is_retried_after_its_retry_after(tmp_path):
    limited = httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "slow down"}})
    engine = Engine(limited, text_reply("eventually"))
    run = await run_to_end(tmp_path, engine)
    assert run.result == "eventually" and len(engine.turns) == 2 and run.counters["turns"] == 1


def test_retry_after_is_read_in_seconds_and_defaults_to_one_second():
    assert retry_after_s("2.5") == 2.5
    assert retry_after_s(None) == 1.0
    assert retry_after_s("not a date") == 1.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: at once


async def test_an_engine_error_fails_the_run_with_its_status_and_message(tmp_path):
    engine = Engine(httpx.Response(500, json={"error": {"message": "engine fake-a: out of memory"}}))
    run = await run_to_end(tmp_path, engine)
    assert run.status == "failed" and run.result is None
    assert "500" in run.error and "engine fake-a: out of memory" in run.error
    assert engine.deleted == [f"/v1/runs/{run.handle}"]
    assert len(engine.turns) == 1, "an error that is not transient is not retried"


@pytest.fixture
def quick_backoff(monkeypatch):
    """Retries that fit in a test: the same rule, with waits of milliseconds and a 1 s window."""
    monkeypatch.setattr(llm, "BACKOFF_S", (0.01, 0.02, 0.05))
    monkeypatch.setattr(llm, "TRANSIENT_RETRY_S", 1.0)


async def test_transient_failures_are_retried_until_the_dataplane_answers(tmp_path, quick_backoff):
    gone = httpx.ConnectError("connection refused")
    lost = httpx.RemoteProtocolError("server disconnected without sending a response")
    engine = Engine(
        gone,
        lost,
        httpx.Response(502, json={"error": {"message": "engine fake-a: connect failed"}}),
        httpx.Response(503, json={"error": {"message": "the dataplane is stopping"}}),
        httpx.Response(504, json={"error": {"message": "engine fake-a: engine sent nothing"}}),
        text_reply("made it"),
    )
    run = await run_to_end(tmp_path, engine)
    assert (run.status, run.result) == ("finished", "made it")
    assert len(engine.turns) == 6 and run.counters["turns"] == 1
    assert all(t == engine.turns[0] for t in engine.turns), "each try is the same request"


async def test_a_transient_failure_that_outlasts_its_window_fails_the_turn(tmp_path, quick_backoff):
    engine = Engine(httpx.Response(503, json={"error": {"message": "no scheduler"}}))
    run = await run_to_end(tmp_path, engine)
    assert run.status == "failed"
    assert "503: no scheduler (still so after retrying for 1 s)" in run.error
    assert len(engine.turns) > 3


async def test_each_tool_call_carries_an_idempotency_key_of_run_round_and_place(tmp_path):
    two_calls = completion(
        calls_message(("c1", "lookup", '{"query": "a"}'), ("c2", "lookup", '{"query": "b"}'))
    )
    tools = Tools()
    engine = Engine(two_calls, tool_call_reply("lookup", '{"query": "c"}', "c3"), text_reply("done"))
    run = await run_to_end(tmp_path, engine, tools)
    assert run.status == "finished"
    assert tools.keys == [f"{run.handle}/0/0", f"{run.handle}/0/1", f"{run.handle}/1/0"]
