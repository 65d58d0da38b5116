"""The fake engine's HTTP layer, in process through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import until

from luftpause.fake_engine.params import EngineParams
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


# Short, quick replies: these tests check shapes, not timing.
QUICK = EngineParams(reply_tokens=32, decode_base_s=0.002, decode_per_seq_s=0.0)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(name="fake-z", model="fake-llama", slots=2, params=QUICK)
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
    slow = EngineParams(reply_tokens=32, decode_base_s=0.02, decode_per_seq_s=0.0)
    app = create_app(name="fake-q", model="fake-llama", slots=1, params=slow)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        requests = [asyncio.create_task(c.post("/v1/chat/completions", json=body(f"q{i}"))) for i in range(2)]

        async def one_running_one_waiting() -> dict[str, float] | None:
            values = await metrics(c)
            running_waiting = (values["sglang:num_running_reqs"], values["sglang:num_queue_reqs"])
            return values if running_waiting == (1, 1) else None

        values = await until(one_running_one_waiting, what="one request running and one waiting")
        assert values["sglang:token_usage"] > 0
        assert (await c.get("/get_load")).json()[0]["num_tokens"] > 0
        replies = await asyncio.gather(*requests)
        assert [r.status_code for r in replies] == [200, 200]
        values = await metrics(c)
        assert (values["sglang:num_running_reqs"], values["sglang:num_queue_reqs"]) == (0, 0)
        assert values["sglang:generation_tokens_total"] == 64


async def test_first_token_logprobs_offer_the_words_of_the_last_user_message(
    client: httpx.AsyncClient,
) -> None:
    question = "Sort this into urgent, lookup or chat: the server returned 500 three times"
    request = body(question, max_tokens=1, logprobs=True, top_logprobs=20)
    first = (await client.post("/v1/chat/completions", json=request)).json()
    again = (await client.post("/v1/chat/completions", json=request)).json()
    (token,) = first["choices"][0]["logprobs"]["content"]
    assert token["token"] == first["choices"][0]["message"]["content"]
    top = token["top_logprobs"]
    assert top[0]["token"] == token["token"]
    assert {"urgent", "lookup", "chat"} <= {t["token"] for t in top}
    assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-9
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    few = (await client.post("/v1/chat/completions", json={**request, "top_logprobs": 2})).json()
    assert len(few["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    plain = (await client.post("/v1/chat/completions", json=body(question))).json()
    assert plain["choices"][0]["logprobs"] is None


async def test_streamed_chunks_carry_the_logprobs_of_their_token(client: httpx.AsyncClient) -> None:
    events = sse_events(
        (
            await client.post(
                "/v1/chat/completions", json=body(stream=True, max_tokens=3, logprobs=True, top_logprobs=1)
            )
        ).text
    )
    tokens = [e["choices"][0] for e in events[:-1] if e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 3
    assert all(c["logprobs"]["content"][0]["token"] == c["delta"]["content"] for c in tokens)


async def test_classify_answers_in_vllm_shape_with_a_label_per_input(client: httpx.AsyncClient) -> None:
    texts = ["the on-call phone is ringing", "population of Oslo"]
    for path in ("/classify", "/v1/classify"):
        r = await client.post(path, json={"model": "fake-llama", "input": texts})
        assert r.status_code == 200
        answer = r.json()
        assert answer["object"] == "list" and answer["id"].startswith("classify-")
        assert [d["index"] for d in answer["data"]] == [0, 1]
        for d in answer["data"]:
            assert d["num_classes"] == 3 and sum(d["probs"]) == pytest.approx(1.0)
            assert d["label"] == ("urgent", "lookup", "chat")[d["probs"].index(max(d["probs"]))]
        assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] > 0
    single = (await client.post("/classify", json={"model": "fake-llama", "input": texts[0]})).json()
    assert single["data"][0]["probs"] == answer["data"][0]["probs"]
    assert (await client.post("/classify", json={"model": "fake-llama"})).status_code == 400
    assert (await client.post("/classify", json={"model": "other", "input": "x"})).status_code == 404


async def test_what_the_sglang_router_asks_of_a_worker(client: httpx.AsyncClient) -> None:
    for path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
        info = (await client.get(path)).json()
        assert info["served_model_name"] == info["model_path"] == "fake-llama"
        assert info["max_running_requests"] == 2
    assert (await client.get("/get_load")).json() == [{"dp_rank": 0, "num_tokens": 0}]
    assert (await client.get("/no/such/route")).json() == {"error": {"message": "Not Found"}}


async def test_metrics_report_the_prefix_cache_in_sglang_and_vllm_names() -> None:
    question = "Tell me about rivers. " * 40
    follow_up = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "Rivers flow."},
        {"role": "user", "content": "And lakes?"},
    ]
    seen = {}
    for flavour in ("sglang", "vllm"):
        app = create_app(name="fake-m", model="fake-llama", metrics_flavour=flavour, params=QUICK)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
            await c.post("/v1/chat/completions", json=body(question))
            await c.post("/v1/chat/completions", json={"model": "fake-llama", "messages": follow_up})
            seen[flavour] = await metrics(c)
    first_message = len(question) // 4 + 4  # cached by the first turn, hit by the second
    assert seen["sglang"]["sglang:cache_hit_rate"] > 0
    assert set(seen["sglang"]) >= {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"}
    vllm = seen["vllm"]
    assert (vllm["vllm:num_requests_running"], vllm["vllm:num_requests_waiting"]) == (0, 0)
    assert vllm["vllm:prefix_cache_hits_total"] == first_message
    assert vllm["vllm:prefix_cache_queries_total"] > vllm["vllm:prefix_cache_hits_total"]
    assert vllm["vllm:kv_cache_usage_perc"] == 0.0
    assert not any(name.startswith("sglang:") for name in vllm)


async def test_a_stream_sends_several_tokens_a_chunk_when_asked() -> None:
    app = create_app(name="fake-c", model="fake-llama", chunk_tokens=8, params=QUICK)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        r = await c.post("/v1/chat/completions", json=body(stream=True))
    events = sse_events(r.text)
    contents = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert len(contents) == 4  # 32 tokens, 8 a chunk
    assert all(len(text.split()) == 8 for text in contents)


async def test_the_time_scale_stretches_every_modelled_duration() -> None:
    # Ten tokens: the prefill pass gives the first, nine decode steps of 20 ms the rest, so 0.18 s
    # modelled and at least 0.9 s on the wall at five times slower.
    params = EngineParams(reply_tokens=10, decode_base_s=0.02, decode_per_seq_s=0.0, prefill_base_s=0.0)
    app = create_app(name="fake-t", model="fake-llama", params=params, time_scale=5.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        loop = asyncio.get_running_loop()
        began = loop.time()
        r = await c.post("/v1/chat/completions", json=body())
        took = loop.time() - began
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    assert took >= 5.0 * 0.18 * 0.95, f"a 0.18 s reply at time scale 5 took only {took:.2f} s"
