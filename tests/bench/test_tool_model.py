"""The stand-in that makes a random-weights engine's replies call tools as the run's plan says."""

from __future__ import annotations

import json

import httpx
import pytest

from luftpause.bench import tool_model
from luftpause.loadgen.agents import planned_tool_calls
from luftpause.loadgen.conversation import first_messages, tool_result_message

ENGINE_REPLY = {
    "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "qzx"}}],
    "usage": {"prompt_tokens": 1400, "completion_tokens": 32},
}


def _conversation(calls: int) -> list[dict]:
    messages = first_messages("seed/run", 2000)
    for k in range(calls):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}, tool_result_message(call)]
    return messages


def test_a_run_calls_tools_until_its_plan_is_done_then_stops_with_the_engines_usage():
    planned = planned_tool_calls(_conversation(0)[1]["content"], (1, 3))
    reasons = []
    for made in range(planned + 1):
        reply = tool_model.as_agents_model({"messages": _conversation(made)}, ENGINE_REPLY, (1, 3))
        choice = reply["choices"][0]
        reasons.append(choice["finish_reason"])
        assert reply["usage"] == ENGINE_REPLY["usage"]  # the engine's work, as it counted it
        if choice["finish_reason"] == "tool_calls":
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "lookup" and choice["message"]["content"] is None
    assert reasons == ["tool_calls"] * planned + ["stop"]


@pytest.mark.asyncio
async def test_the_proxy_rewrites_chat_replies_only_and_passes_every_other_route_through():
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json=ENGINE_REPLY)
        return httpx.Response(200, text=f"{request.method} {request.url.path}")

    app = tool_model.build_app("http://engine", (2, 2))
    # The app's own client goes to the engine: route it to the handler above.
    tool_model_client = httpx.AsyncClient(transport=httpx.MockTransport(engine), base_url="http://engine")
    app.state.engine_client = tool_model_client
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        assert (await client.get("/metrics")).text == "GET /metrics"
        assert (await client.get("/slots")).text == "GET /slots"
        reply = (await client.post("/v1/chat/completions", json={"messages": _conversation(0)})).json()
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
        streamed = await client.post(
            "/v1/chat/completions", json={"messages": _conversation(0), "stream": True}
        )
        assert streamed.json()["choices"][0]["finish_reason"] == "length"  # streams pass untouched


def test_a_streamed_reply_opens_the_call_with_the_engines_first_token_and_finishes_it_last():
    made, planned = 0, 2
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "qz"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 1400, "completion_tokens": 3}},
    ]
    opened = False
    out = []
    for chunk in chunks:
        rewritten, opened = tool_model.stream_chunk(chunk, made, planned, opened)
        out.append(rewritten)
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in out]
    assert deltas[0] == {"role": "assistant"}
    (opening,) = deltas[1]["tool_calls"]
    assert opening["function"] == {"name": "lookup", "arguments": ""} and opening["id"] == "call_0"
    assert deltas[2] == {}
    (rest,) = deltas[3]["tool_calls"]
    assert json.loads(rest["function"]["arguments"]) == {"query": "fact 1"}
    assert [c["choices"][0]["finish_reason"] if c["choices"] else None for c in out] == [
        None, None, None, "tool_calls", None,
    ]  # fmt: skip
    assert out[4] == chunks[4]
    # The run's last turn: the text passes, and it stops.
    last, _ = tool_model.stream_chunk(chunks[3], planned, planned, False)
    assert last["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_the_sglang_routers_worker_info_names_the_engines_model():
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": "flood-model", "object": "model"}]}
            )
        return httpx.Response(404, text="llama-server has no such route")

    app = tool_model.build_app("http://engine", (1, 3))
    app.state.engine_client = httpx.AsyncClient(
        transport=httpx.MockTransport(engine), base_url="http://engine"
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        for route in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            info = (await client.get(route)).json()
            assert info["model_path"] == info["served_model_name"] == "flood-model", route
        assert (await client.get("/props")).status_code == 404  # the rest still passed through
