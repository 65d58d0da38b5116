"""A streamed turn's usage: asked of the engine for the scheduler, hidden from a client that did not ask.

The engine gets `stream_options.include_usage` for every streamed turn (dataplane/usage.py), so
the scheduler hears each turn's real prompt and completion tokens; a client that did not ask gets
the stream without the usage-only chunk, one that did gets it once, and a replica with
`stream_usage = false` gets the client's body byte for byte. The first tests use the scripted
engine, whose bytes are known exactly; the last run the fake engine behind the dataplane and the
`openai` client in front of it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from conftest import MODEL, Stack, answers_json, chunk, completion, open_stack, streams
from openai import AsyncOpenAI
from support import until

from luftpause.dataplane.usage import asking_for_usage, client_asked
from luftpause.fake_engine.server import create_app as fake_engine_app

# Spacing and escapes of a client's own, which must reach the engine as they are.
RAW = b'{"model":  "fake-llama", "stream": true, "messages": [{"role":"user","content":"h\\u00e9"}]}'
USAGE = {"prompt_tokens": 17, "completion_tokens": 2, "total_tokens": 19}
USAGE_EVENT = b"data: " + json.dumps({"id": "c1", "choices": [], "usage": USAGE}).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"
CONTENT = [chunk({"role": "assistant", "content": "He"}), chunk({"content": "llo"}), chunk({}, "stop")]


async def relay(stack: Stack, body: bytes) -> bytes:
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert r.status_code == 200, r.text
    return r.content


async def completed(stack: Stack) -> tuple[int, int]:
    """The prompt and completion tokens of the one turn reported completed."""
    await until(lambda: any(e.WhichOneof("event") == "completed" for e in stack.scheduler.events))
    (done,) = [e.completed for e in stack.scheduler.events if e.WhichOneof("event") == "completed"]
    return done.prompt_tokens, done.completion_tokens


# --- the body the engine gets ---


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        (None, None),
        ({}, {"include_usage": True}),
        ({"include_usage": False}, {"include_usage": True}),
        ({"continuous_usage_stats": False}, {"continuous_usage_stats": False, "include_usage": True}),
    ],
)
def test_the_body_asks_for_usage_keeping_the_clients_other_stream_options(options, sent):
    payload = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "é"}]}
    if options is not None:
        payload["stream_options"] = options
    body = json.dumps(payload).encode()
    assert not client_asked(payload)
    asked = asking_for_usage(body, payload)
    if options is None:
        # Without stream_options of its own the client's bytes follow the member unchanged.
        assert asked == b'{"stream_options":{"include_usage":true},' + body[1:]
    else:
        assert json.loads(asked) == {**payload, "stream_options": sent}


def test_a_client_asks_only_with_include_usage_true():
    assert client_asked({"stream_options": {"include_usage": True}})
    for options in (None, {}, {"include_usage": False}, {"include_usage": "yes"}, "include_usage"):
        assert not client_asked({"stream_options": options})


def test_stream_options_that_are_not_an_object_are_left_for_the_engine_to_refuse():
    body = b'{"model": "m", "stream": true, "stream_options": "all"}'
    assert asking_for_usage(body, json.loads(body)) == body
    null = b'{"model":"m","stream":true,"stream_options":null}'
    assert json.loads(asking_for_usage(null, json.loads(null)))["stream_options"] == {"include_usage": True}


# --- through the dataplane, with the scripted engine ---


async def test_an_unasking_client_gets_the_stream_without_usage_and_the_scheduler_its_tokens(stack: Stack):
    # The usage event split across two writes, as it may be across reads.
    cut = USAGE_EVENT.index(b"prompt")
    stack.engine.behaviour = streams([*CONTENT, USAGE_EVENT[:cut], USAGE_EVENT[cut:], DONE])
    assert await relay(stack, RAW) == b"".join([*CONTENT, DONE])
    ((_, sent),) = stack.engine.requests
    assert sent == b'{"stream_options":{"include_usage":true},' + RAW[1:]
    assert await completed(stack) == (17, 2)


async def test_usage_on_the_last_content_chunk_is_taken_off_it(stack: Stack):
    last = json.loads(CONTENT[-1][len(b"data: ") :])
    with_usage = b"data: " + json.dumps({**last, "usage": USAGE}).encode() + b"\n\n"
    stack.engine.behaviour = streams([*CONTENT[:-1], with_usage, DONE])
    passed = await relay(stack, RAW)
    assert passed.startswith(b"".join(CONTENT[:-1])) and passed.endswith(b"\n\n" + DONE)
    events = [json.loads(line[6:]) for line in passed.split(b"\n\n") if line.startswith(b"data: {")]
    assert events[-1] == last and all("usage" not in e for e in events)
    assert await completed(stack) == (17, 2)


async def test_an_asking_client_gets_the_usage_chunk_once_and_its_body_unchanged(stack: Stack):
    body = RAW[:-1] + b', "stream_options": {"include_usage": true}}'
    stream = b"".join([*CONTENT, USAGE_EVENT, DONE])
    stack.engine.behaviour = streams([stream])
    assert await relay(stack, body) == stream
    ((_, sent),) = stack.engine.requests
    assert sent == body
    assert await completed(stack) == (17, 2)


async def test_a_replica_that_opts_out_gets_the_body_byte_for_byte_and_the_stream_passes_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("FAKE_A_KEY", "engine-secret")
    async with open_stack(stream_usage=False) as stack:
        # An engine that sends usage unasked (as some do) is passed on as it is.
        stream = b"".join([*CONTENT, USAGE_EVENT, DONE])
        stack.engine.behaviour = streams([stream])
        assert await relay(stack, RAW) == stream
        ((_, sent),) = stack.engine.requests
        assert sent == RAW


async def test_a_whole_reply_is_not_asked_for_stream_usage(stack: Stack):
    stack.engine.behaviour = answers_json(completion())
    body = RAW.replace(b'"stream": true', b'"stream": false')
    await relay(stack, body)
    ((_, sent),) = stack.engine.requests
    assert sent == body


# --- the fake engine behind the dataplane, the openai client in front ---


@pytest.fixture
async def fake() -> AsyncIterator[Stack]:
    async with open_stack(engine=fake_engine_app("fake-a")) as stack:
        yield stack


MESSAGES = [{"role": "user", "content": "count the streams of usage"}]


async def engine_usage(stack: Stack) -> tuple[int, int]:
    """The prompt and completion tokens the engine itself reports for MESSAGES, asked directly."""
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.engine_port}/v1", api_key="x") as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        (usage,) = [c.usage async for c in stream if c.usage is not None]
    return usage.prompt_tokens, usage.completion_tokens


async def test_the_openai_client_not_asking_sees_no_usage_and_the_scheduler_gets_the_engines(fake: Stack):
    async with AsyncOpenAI(base_url=f"{fake.url}/v1", api_key="x") as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, stream=True
        )
        chunks = [c async for c in stream]
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    prompt, completion = await completed(fake)
    assert prompt > 0 and completion > 0
    assert (prompt, completion) == await engine_usage(fake)


def _events(stream: bytes) -> list[dict]:
    """A stream's events without what differs from one reply to the next (id, created)."""
    events = []
    for line in stream.split(b"\n\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            del event["id"], event["created"]
            events.append(event)
    return events


async def test_the_stream_is_the_engines_unasked_one_but_for_null_usage(fake: Stack):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": True}
    async with httpx.AsyncClient() as client:
        unasked = (
            await client.post(f"http://127.0.0.1:{fake.engine_port}/v1/chat/completions", json=body)
        ).content
        passed = await relay(fake, json.dumps(body).encode())
    assert passed.endswith(b"\n\ndata: [DONE]\n\n") and b"prompt_tokens" not in passed
    # Asked for usage, the engine (as the OpenAI API) writes `"usage": null` on every other
    # chunk; that, the same to a client as no usage, passes on (dataplane/sse.py).
    events = _events(passed)
    assert all(e.pop("usage") is None for e in events)
    assert events == _events(unasked)
    assert (await completed(fake))[0] > 0


async def test_the_openai_client_asking_gets_one_usage_chunk_last(fake: Stack):
    async with AsyncOpenAI(base_url=f"{fake.url}/v1", api_key="x") as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    assert await completed(fake) == (usage.prompt_tokens, usage.completion_tokens) == await engine_usage(fake)
