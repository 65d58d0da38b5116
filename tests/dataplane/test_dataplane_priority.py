"""Engine priorities: what body a replica's engine gets for an interactive or a batch turn.

A replica that declares `engine_priority` gets the turn's class as a top-level `priority`, put in
right after the body's opening brace with the rest of the bytes as the client sent them; every
other replica, and every body that already has a top-level `priority`, gets the bytes unchanged.
The last tests run the fake engine with priority scheduling on behind the dataplane: a turn
queued inside the engine is answered in the order the priorities say.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from conftest import MODEL, Stack, answers_json, completion, open_stack
from support import until

from luftpause.dataplane.priority import with_priority
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.server import create_app as fake_engine_app

# Spacing and escapes of a client's own, which must reach the engine as they are.
RAW = b'{"model":  "fake-llama", "messages": [{"role":"user","content":"h\\u00e9"}], "x_extra": [1, 2.50]}'


@pytest.fixture
async def sglang() -> AsyncIterator[Stack]:
    async with open_stack(engine_priority="sglang") as stack:
        stack.engine.behaviour = answers_json(completion())
        yield stack


async def send(stack: Stack, body: bytes, service_class: str = "interactive", path: str = "chat/completions"):
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/{path}",
            content=body,
            headers={"content-type": "application/json", "x-luftpause-class": service_class},
        )
    assert r.status_code == 200, r.text
    ((_, sent),) = stack.engine.requests
    return sent


@pytest.mark.parametrize(
    ("convention", "service_class", "expected"),
    [("sglang", "interactive", 1), ("sglang", "batch", 0), ("vllm", "interactive", -1), ("vllm", "batch", 0)],
)
async def test_a_declaring_replica_gets_the_class_priority_first_and_the_rest_unchanged(
    convention: str, service_class: str, expected: int
):
    async with open_stack(engine_priority=convention) as stack:
        stack.engine.behaviour = answers_json(completion())
        sent = await send(stack, RAW, service_class)
    assert sent == b'{"priority":%d,' % expected + RAW[1:]
    assert json.loads(sent) == {**json.loads(RAW), "priority": expected}


@pytest.mark.parametrize("service_class", ["interactive", "batch"])
async def test_a_replica_declaring_nothing_gets_the_body_byte_for_byte(stack: Stack, service_class: str):
    stack.engine.behaviour = answers_json(completion())
    assert await send(stack, RAW, service_class) == RAW


@pytest.mark.parametrize("own", [b'"priority": 7', b'"priority":null', b'"priority" :-3'])
async def test_a_body_with_its_own_priority_keeps_it(sglang: Stack, own: bytes):
    body = b'{"model": "fake-llama", ' + own + b', "messages": [{"role": "user", "content": "hi"}]}'
    assert await send(sglang, body, "batch") == body


async def test_priority_below_the_top_level_is_not_the_clients_choice(sglang: Stack):
    body = (
        b' \n{"model": "fake-llama", "metadata": {"priority": 9},'
        b' "messages": [{"role": "user", "content": "\\"priority\\": 5"}]}'
    )
    sent = await send(sglang, body)
    assert sent == b' \n{"priority":1,' + body[3:]
    assert json.loads(sent)["priority"] == 1 and json.loads(sent)["metadata"] == {"priority": 9}


async def test_a_labelled_decision_goes_as_interactive(sglang: Stack):
    body = json.dumps({"model": MODEL, "input": "is it down?", "labels": ["yes", "no"]}).encode()
    sent = await send(sglang, body, "batch", path="decide")
    assert json.loads(sent)["priority"] == 1


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{}", b'{"priority":1}'),
        (b"\r\n\t { \n}", b'\r\n\t {"priority":1 \n}'),
        (b'{ "a": 1}', b'{"priority":1, "a": 1}'),
        # Not an object opening in UTF-8: a UTF-8 byte order mark, UTF-16, an array.
        (b'\xef\xbb\xbf{"a": 1}', b'\xef\xbb\xbf{"a": 1}'),
        ('{"a": 1}'.encode("utf-16-le"), '{"a": 1}'.encode("utf-16-le")),
        (b"[1]", b"[1]"),
    ],
)
def test_the_insertion_keeps_the_json_valid_or_leaves_the_body_alone(body: bytes, expected: bytes):
    assert with_priority(body, 1) == expected


# --- inside the engine: the fake engine, one slot, priority scheduling on ---


@pytest.mark.parametrize(
    ("convention", "answered_first"),
    [("sglang", "interactive"), ("none", "batch")],
)
async def test_the_engine_answers_a_queued_interactive_turn_before_an_earlier_batch_one(
    convention: str, answered_first: str
):
    # The holder's 2000-token reply would take about 20 s: far more than the others need to queue.
    params = EngineParams(slots=1, priority_scheduling=True, reply_tokens=2000)
    fake = fake_engine_app("fake-a", params=params)
    engine = fake.state.engine
    answered: list[str] = []
    async with open_stack(engine=fake, engine_priority=convention) as stack, httpx.AsyncClient() as client:
        url = f"{stack.url}/v1/chat/completions"

        async def turn(service_class: str, max_tokens: int) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
            r = await client.post(url, json=body, headers={"x-luftpause-class": service_class}, timeout=30)
            assert r.status_code == 200, r.text
            answered.append(service_class)

        # A long reply holds the engine's one slot while a batch and then an interactive turn
        # queue behind it; once both wait there, its client leaves and the slot comes free.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}], "stream": True}
        async with client.stream("POST", url, json=body) as holder:
            # Kept: a reply iterator left to the garbage collector closes the response.
            pieces = holder.aiter_raw()
            await anext(pieces)
            assert engine.load().running == 1
            batch = asyncio.ensure_future(turn("batch", 50))
            await until(lambda: engine.load().waiting == 1, what="the batch turn to queue in the engine")
            interactive = asyncio.ensure_future(turn("interactive", 1))
            await until(lambda: engine.load().waiting == 2, what="the interactive turn to queue behind it")
        await asyncio.gather(batch, interactive)
    assert answered[0] == answered_first


async def test_a_placement_that_names_a_slot_puts_it_first_in_the_body_and_a_clients_own_wins(stack: Stack):
    # On a slot engine (llama.cpp) the scheduler names the slot the run's KV stays in.
    stack.scheduler.slot = 2
    stack.engine.behaviour = answers_json(completion())
    sent = await send(stack, RAW)
    assert sent == b'{"id_slot":2,' + RAW[1:]
    stack.engine.requests.clear()
    own = b'{"id_slot": 0, ' + RAW[1:]
    assert json.loads(await send(stack, own))["id_slot"] == 0  # the client's, after ours: it wins
