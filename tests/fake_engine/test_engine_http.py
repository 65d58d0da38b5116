"""The fake engine's HTTP layer, in process through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from luftpause.fake_engine.model import EngineTiming
from luftpause.fake_engine.server import create_app

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def body(question: str = "What is luftpause?", **extra) -> dict:
    return {"model": "fake-llama", "messages": [{"role": "user", "content": question}], **extra}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(name="fake-z", model="fake-llama", slots=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        yield c


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model_name") == "fake-llama"
    }


async def test_health_models_and_metric_names(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    listed = (await client.get("/v1/models")).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["fake-llama"]
    values = await metrics(client)
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
    ):
        assert values[name] == 0.0


async def test_a_plain_completion_has_fingerprint_usage_and_text(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=body())
    assert r.status_code == 200
    reply = r.json()
    assert reply["object"] == "chat.completion"
    assert reply["system_fingerprint"] == "fake-z" and reply["model"] == "fake-llama"
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    usage = reply["usage"]
    assert usage["completion_tokens"] == 32 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_router_fields_are_accepted_and_max_completion_tokens_limits_the_reply(
    client: httpx.AsyncClient,
) -> None:
    extra = {
        "max_completion_tokens": 3,
        "no_stop_trim": True,
        "ignore_eos": False,
        "skip_special_tokens": True,
    }
    r = await client.post("/v1/chat/completions", json=body(rid="abc", **extra))
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_a_stream_sends_role_then_content_then_finish_usage_and_done(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["system_fingerprint"] == "fake-z" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert len(content) == 32
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 32
    plain = (await client.post("/v1/chat/completions", json=body())).json()
    assert "".join(content) == plain["choices"][0]["message"]["content"]


async def test_a_stream_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    events = sse_events((await client.post("/v1/chat/completions", json=body(stream=True))).text)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1]) and all("usage" not in e for e in events[:-1])


async def test_a_streamed_tool_call_uses_openai_deltas(client: httpx.AsyncClient) -> None:
    streamed = sse_events(
        (await client.post("/v1/chat/completions", json=body(stream=True, tools=[LOOKUP]))).text
    )
    plain = (await client.post("/v1/chat/completions", json=body(tools=[LOOKUP]))).json()
    call = plain["choices"][0]["message"]["tool_calls"][0]
    assert plain["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [e["choices"][0]["delta"] for e in streamed[:-1]]
    first = deltas[1]["tool_calls"][0]
    assert (first["index"], first["id"], first["function"]["name"]) == (0, call["id"], "lookup")
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:] if "tool_calls" in d)
    assert (
        json.loads(arguments) == json.loads(call["function"]["arguments"]) == {"query": "What is luftpause?"}
    )
    assert streamed[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("payload", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "fake-llama"}).encode(), 400, "messages"),
        (
            json.dumps({"model": "fake-llama", "messages": [{"role": "robot"}]}).encode(),
            400,
            "messages.0.role",
        ),
        (json.dumps(body(max_tokens=0)).encode(), 400, "max_tokens"),
        (
            json.dumps(
                body(tools=[LOOKUP], tool_choice={"type": "function", "function": {"name": "nope"}})
            ).encode(),
            400,
            "nope",
        ),
        (json.dumps({**body(), "model": "gpt-9"}).encode(), 404, "gpt-9"),
    ],
)
async def test_bad_requests_get_an_error_body_saying_what_is_wrong(
    client: httpx.AsyncClient, payload: bytes, status: int, says: str
) -> None:
    r = await client.post(
        "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
    )
    assert r.status_code == status
    assert says in r.json()["error"]["message"]


async def test_with_one_slot_a_second_request_waits_in_the_engine_queue() -> None:
    slow = EngineTiming(decode_per_token_s=0.02)
    app = create_app(name="fake-q", model="fake-llama", slots=1, timing=slow)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        requests = [asyncio.create_task(c.post("/v1/chat/completions", json=body(f"q{i}"))) for i in range(2)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            values = await metrics(c)
            if (values["sglang:num_running_reqs"], values["sglang:num_queue_reqs"]) == (1, 1):
                break
            assert loop.time() < deadline, f"never saw one running and one waiting: {values}"
            await asyncio.sleep(0.01)
        assert values["sglang:token_usage"] > 0
        replies = await asyncio.gather(*requests)
        assert [r.status_code for r in replies] == [200, 200]
        values = await metrics(c)
        assert (values["sglang:num_running_reqs"], values["sglang:num_queue_reqs"]) == (0, 0)
        assert values["sglang:generation_tokens_total"] == 64
