"""The race every step of a turn runs against its client leaving (`proxy.unless_client_leaves`).

It runs the step in the turn's own task and cancels that task when the client goes, so what must
hold is what a turn relies on: the step is stopped and the turn hears ClientLeft; a step that
finished first keeps its result and nothing cancels what the turn does next; a cancellation
from outside (the server stopping) stays a cancellation; a client already gone starts nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from luftpause.dataplane.answer import ClientLeft, unless_client_leaves


async def test_a_client_leaving_stops_the_step_and_the_turn_hears_it():
    loop = asyncio.get_running_loop()
    client_left: asyncio.Future[None] = loop.create_future()
    stopped = asyncio.Event()

    async def step() -> str:
        try:
            await asyncio.Event().wait()  # an engine that never answers
            return "answered"
        finally:
            stopped.set()

    loop.call_soon(client_left.set_result, None)
    with pytest.raises(ClientLeft):
        await unless_client_leaves(step(), client_left)
    assert stopped.is_set()
    assert asyncio.current_task().cancelling() == 0, "no cancellation left over for the turn"


async def test_a_step_that_finished_first_keeps_its_result_and_a_later_leaving_cancels_nothing():
    loop = asyncio.get_running_loop()
    client_left: asyncio.Future[None] = loop.create_future()

    async def step() -> str:
        await asyncio.sleep(0)
        return "answered"

    assert await unless_client_leaves(step(), client_left) == "answered"
    client_left.set_result(None)
    # What the turn does next (here: wait a moment) is not cancelled by the race that ended.
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0


async def test_the_server_stopping_is_a_cancellation_not_a_client_leaving():
    loop = asyncio.get_running_loop()
    client_left: asyncio.Future[None] = loop.create_future()
    started = asyncio.Event()

    async def turn() -> None:
        async def step() -> None:
            started.set()
            await asyncio.Event().wait()

        await unless_client_leaves(step(), client_left)

    task = asyncio.create_task(turn())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_client_already_gone_starts_nothing():
    loop = asyncio.get_running_loop()
    client_left: asyncio.Future[None] = loop.create_future()
    client_left.set_result(None)
    ran = False

    async def step() -> None:
        nonlocal ran
        ran = True

    with pytest.raises(ClientLeft):
        await unless_client_leaves(step(), client_left)
    assert not ran
