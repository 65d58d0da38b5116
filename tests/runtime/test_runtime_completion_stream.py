"""The runtime's turns are streamed: the chunks put back together into the reply a turn not streamed
would get, an error event inside a stream, and a stream that breaks off, through `Dataplane.complete`
against scripted dataplanes and the fake engine in process; and more turns at once than an HTTP
client pools by default all reach the dataplane."""

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
from streamed_replies import calls_message, chunks, sse, sse_response
from support import LoopbackServer, QuietHandler

from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.server import create_app
from luftpause.runtime import llm
from luftpause.runtime.completion_stream import CompletionStream, StreamError
from luftpause.runtime.llm import Dataplane, TurnFailed

USAGE = {"prompt_tokens": 2600, "completion_tokens": 31, "total_tokens": 2631}
TWO_CALLS = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1764633600,
    "model": "fake-llama",
    "choices": [
        {
            "index": 0,
            "message": calls_message(
                ("call_a", "lookup", '{"query": "the Rhine, its mouth"}'),
                ("call_b", "deep_search", '{"topic": "rivers of Europe"}'),
            ),
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": USAGE,
}


def assembled(events: list, done: bool = True) -> CompletionStream:
    stream = CompletionStream()
    for line in sse(events, done).decode().splitlines():
        stream.feed_line(line)
    stream.close()
    return stream


def test_tool_calls_split_over_chunks_and_usage_in_the_last_chunk_come_back_whole():
    events = chunks(TWO_CALLS, pieces=4)
    # The fragments of a call carry only its index after the first; usage comes alone, last.
    assert sum(1 for e in events for c in e["choices"] for _ in c["delta"].get("tool_calls", ())) >= 8
    assert events[-1]["choices"] == [] and all("usage" not in e for e in events[:-1])
    stream = assembled(events)
    assert stream.finished and stream.completion() == TWO_CALLS


def test_calls_interleaved_by_index_are_kept_apart():
    def call(index: int, **part) -> dict:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, **part}]}}]}

    events = [
        call(0, id="call_a", type="function", function={"name": "lookup", "arguments": ""}),
        call(1, id="call_b", type="function", function={"name": "lookup", "arguments": '{"q'}),
        call(0, function={"arguments": '{"q": '}),
        call(1, function={"arguments": '": 2}'}),
        call(0, function={"arguments": "1}"}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    message = assembled(events, done=False).completion()["choices"][0]["message"]
    assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("call_a", '{"q": 1}'),
        ("call_b", '{"q": 2}'),
    ]


def test_text_is_joined_and_an_empty_reply_stays_empty():
    text = {
        **TWO_CALLS,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The Rhine flows into the North Sea."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
    }
    assert assembled(chunks(text, pieces=5)).completion() == text
    empty = {
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]
    }
    assert assembled([empty]).completion()["choices"][0]["message"] == {"role": "assistant", "content": ""}


def test_events_over_several_data_lines_comments_and_crlf_are_read():
    stream = CompletionStream()
    first = json.dumps({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}, indent=1)
    for line in [": keep-alive", "event: message", *[f"data: {part}" for part in first.splitlines()], ""]:
        stream.feed_line(line)
    stream.feed_line('data:{"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}')
    stream.feed_line("data: [DONE]")
    stream.close()
    assert stream.done and stream.completion()["choices"][0]["message"]["content"] == "Hello"


def test_an_error_event_raises_with_its_message():
    with pytest.raises(StreamError, match="prompt is longer than the KV pool"):
        assembled([*chunks(TWO_CALLS)[:2], {"error": {"message": "prompt is longer than the KV pool"}}])


def test_a_stream_that_breaks_off_is_not_finished():
    assert not assembled(chunks(TWO_CALLS)[:3], done=False).finished


# -- through Dataplane.complete --


class Script:
    """A dataplane that answers from a script (the last answer repeats) and records each request."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def complete(script: Script) -> dict:
    dataplane = Dataplane("http://dataplane", transport=httpx.MockTransport(script.handle))
    try:
        return await dataplane.complete({"model": "fake-llama", "messages": []}, {})
    finally:
        await dataplane.close()


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(llm, "BACKOFF_S", (0.01, 0.02, 0.05))
    monkeypatch.setattr(llm, "TRANSIENT_RETRY_S", 1.0)


async def test_a_turn_asks_for_a_stream_with_usage_and_gets_the_whole_completion():
    script = Script(sse_response(chunks(TWO_CALLS)))
    assert await complete(script) == TWO_CALLS
    (sent,) = script.requests
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


async def test_an_endpoint_that_answers_whole_is_read_whole():
    script = Script(httpx.Response(200, json=TWO_CALLS))
    assert await complete(script) == TWO_CALLS


async def test_an_error_event_in_the_stream_fails_the_turn_without_a_retry(quick_backoff):
    error = {"error": {"message": "engine fake-a: prompt is longer than the KV pool", "code": 400}}
    script = Script(sse_response([*chunks(TWO_CALLS)[:2], error], done=False))
    with pytest.raises(TurnFailed, match="stream carried an error: engine fake-a: prompt is longer"):
        await complete(script)
    assert len(script.requests) == 1


class _BreaksOff(httpx.AsyncByteStream):
    """A stream that sends `head` and then loses its connection."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_a_stream_lost_mid_reply_is_retried_as_transient(quick_backoff):
    head = sse(chunks(TWO_CALLS)[:3], done=False)
    lost = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_BreaksOff(head))
    ended = sse_response(chunks(TWO_CALLS)[:3], done=False)  # closed cleanly, but before the reply ended
    script = Script(lost, ended, sse_response(chunks(TWO_CALLS)))
    assert await complete(script) == TWO_CALLS
    assert len(script.requests) == 3 and script.requests[0] == script.requests[2]


async def test_a_stream_that_keeps_breaking_off_fails_the_turn_after_the_window(quick_backoff):
    script = Script(sse_response(chunks(TWO_CALLS)[:3], done=False))
    with pytest.raises(TurnFailed, match="stream ended before the reply finished .still so after retrying"):
        await complete(script)


@pytest.mark.parametrize("tools", [False, True])
async def test_the_fake_engine_streamed_adds_up_to_its_reply_not_streamed(tools):
    app = create_app(
        name="fake-z",
        model="fake-llama",
        params=EngineParams(reply_tokens=40, decode_base_s=0.001, decode_per_seq_s=0.0),
    )
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    body = {
        "model": "fake-llama",
        "messages": [{"role": "user", "content": "Research the Danube."}],
        **({"tools": [lookup]} if tools else {}),
    }
    transport = httpx.ASGITransport(app=app)
    dataplane = Dataplane("http://engine", transport=transport)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as plain:
        whole = (await plain.post("/v1/chat/completions", json=body)).json()
    streamed = await dataplane.complete(body, {})
    await dataplane.close()
    assert streamed["choices"][0]["finish_reason"] == ("tool_calls" if tools else "stop")
    different = {"id", "created"}  # each request's own
    assert {k: v for k, v in streamed.items() if k not in different} == {
        k: v for k, v in whole.items() if k not in different
    }


def test_more_turns_at_once_than_httpx_pools_by_default_all_reach_the_dataplane() -> None:
    # 120 turns held at the dataplane at once (as the scheduler holds them for admission): each
    # must reach it, or the ones beyond the client's pool would wait unseen by the scheduler.
    at_once = 120
    all_here = threading.Event()
    count = [0]
    lock = threading.Lock()

    class HoldsUntilAllArrive(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers["content-length"]))
            with lock:
                count[0] += 1
                if count[0] == at_once:
                    all_here.set()
            all_here.wait(30)
            reply = {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ]
            }
            self.answer(200, json.dumps(reply).encode(), {"content-type": "application/json"})

    server = LoopbackServer(HoldsUntilAllArrive)

    async def turns() -> list[dict]:
        dataplane = Dataplane(server.url)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(dataplane.complete(body, {}) for _ in range(at_once))), 20
            )
        finally:
            await dataplane.close()

    try:
        replies = asyncio.run(turns())
    finally:
        all_here.set()
        server.close()
    assert count[0] == at_once and len(replies) == at_once
