"""When a turn's events reach the scheduler: at once where a decision may wait on them, else with
the dataplane's next message (dataplane/outbox.py, `Urgency`).

The real scheduler host behind real gRPC on loopback, and the dataplane's own scheduler client;
a second client plays a second dataplane. What a user must see:

- on a quiet stack a turn costs one message each way: its events ride with the next admission;
- a turn that ends and is followed by nothing still leaves the scheduler's books within moments;
- a turn held by the scheduler is placed as soon as another dataplane's turn confirms its room,
  even though that dataplane has nothing else to send (its events must not ride then);
- a reply that pauses its run on a tool reaches the scheduler at once, so that the run's next
  turn finds the run paused there whichever dataplane it reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest
from support import Ports, until, write_config

from luftpause import config as lp_config
from luftpause.dataplane import outbox
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb, rpc
from luftpause.scheduler.host import SchedulerHost, SchedulerService
from luftpause.scheduler.state import Phase


class _CountingService(SchedulerService):
    """The real servicer, counting the messages the dataplanes send on their Turns streams."""

    def __init__(self, host: SchedulerHost) -> None:
        super().__init__(host)
        self.messages = 0

    async def _read(self, request_iterator, link):  # noqa: ANN001, ANN202 (the servicer's own signature)
        async def counted() -> AsyncIterator[pb.DataplaneBatch]:
            async for batch in request_iterator:
                self.messages += 1
                yield batch

        await super()._read(counted(), link)


async def _serve(service: SchedulerService) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    rpc.add_SchedulerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _config(tmp_path: Path, lookahead: int = 2) -> lp_config.Config:
    config = lp_config.load(write_config(tmp_path, Ports()))
    # One replica, so that which turns are held does not depend on where the others went.
    replica = config.replicas[0].model_copy(update={"lookahead": lookahead})
    return config.model_copy(update={"replicas": [replica]})


def _request(turn_id: str, run_id: str) -> pb.AdmitRequest:
    return pb.AdmitRequest(turn_id=turn_id, run_id=run_id, model="fake-llama", caller="c")


async def _client(port: int, name: str = "") -> SchedulerClient:
    client = SchedulerClient(f"127.0.0.1:{port}", name=name)
    await client.start()
    await until(lambda: client.connected, what=f"dataplane {name or '1'} to resync and connect")
    return client


@contextlib.asynccontextmanager
async def two_dataplanes(
    tmp_path: Path, lookahead: int
) -> AsyncIterator[tuple[SchedulerHost, SchedulerClient, SchedulerClient]]:
    """The real scheduler host on one replica of `lookahead`, and two dataplanes' clients on it."""
    host = SchedulerHost(_config(tmp_path, lookahead=lookahead))
    server, port = await _serve(SchedulerService(host))
    first = await _client(port, "dp-1")
    second = await _client(port, "dp-2")
    try:
        yield host, first, second
    finally:
        await first.close()
        await second.close()
        await server.stop(grace=None)


# Time between a turn's events as an engine's reply spreads them (not a wait for a condition: the
# writer may send whatever is due meanwhile, as it would while a real reply streams).
_STREAMING_S = 0.002


async def _turn(client: SchedulerClient, turn_id: str, run_id: str, finish: str = "stop") -> None:
    """One whole turn as the proxy reports it: admitted, placed, started, first token, completed."""
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reply = await asyncio.wait_for(client.admit(_request(turn_id, run_id), never), timeout=5)
    assert reply is not None and reply.outcome == pb.AdmitReply.PLACED
    client.started(turn_id, run_id, streamed=True)
    await asyncio.sleep(_STREAMING_S)
    client.first_token(turn_id, run_id)
    await asyncio.sleep(_STREAMING_S)
    tool_calls = [f"call-{turn_id}"] if finish == "tool_calls" else []
    client.completed(turn_id, run_id, finish, 10, 5, tool_calls)
    await asyncio.sleep(_STREAMING_S)


@pytest.fixture
def events_never_ride_out_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event left to ride waits a minute for company: a test that needs it sooner fails."""
    monkeypatch.setattr(outbox, "RIDE_AT_MOST_S", 60.0)


async def test_on_a_quiet_stack_a_turns_events_ride_with_the_next_admission(
    tmp_path: Path, events_never_ride_out_alone: None
):
    host = SchedulerHost(_config(tmp_path))
    service = _CountingService(host)
    server, port = await _serve(service)
    client = await _client(port)
    try:
        turns = 20
        for i in range(turns):
            await _turn(client, f"t{i}", "r")
            # The scheduler has every earlier turn's end by the time it places the next one.
            assert [t.turn_id for t in host.state.placed()] == [f"t{i}"]
        assert service.messages <= turns + 1, (
            f"{service.messages} messages for {turns} turns: events did not ride with the admissions"
        )
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_a_last_turns_end_reaches_the_scheduler_on_its_own_soon(tmp_path: Path):
    host = SchedulerHost(_config(tmp_path))
    server, port = await _serve(SchedulerService(host))
    client = await _client(port)
    try:
        await _turn(client, "t-last", "r")
        await until(
            # (A reservation the dataplane holds is no turn: `placed()` leaves them out.)
            lambda: not host.state.placed() and not host.state.held(),
            timeout_s=outbox.RIDE_AT_MOST_S + 2.0,
            what="the turn to leave the scheduler's books with nothing after it",
        )
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_a_turn_held_for_one_dataplane_is_placed_when_anothers_first_token_confirms_room(
    tmp_path: Path, events_never_ride_out_alone: None
):
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    async with two_dataplanes(tmp_path, lookahead=1) as (host, first, second):
        placed = await asyncio.wait_for(first.admit(_request("t-a", "r-a"), never), timeout=5)
        assert placed is not None
        first.started("t-a", "r-a", streamed=True)
        # The replica's one turn of lookahead is t-a, not yet seen running: t-b is held.
        waiting = asyncio.create_task(second.admit(_request("t-b", "r-b"), never))
        await until(lambda: [t.turn_id for t in host.state.held()] == ["t-b"], what="t-b to be held")

        first.first_token("t-a", "r-a")  # the engine started t-a: room for t-b
        reply = await asyncio.wait_for(waiting, timeout=5)
        assert reply is not None and reply.outcome == pb.AdmitReply.PLACED


async def test_a_reply_that_pauses_its_run_reaches_the_scheduler_at_once(
    tmp_path: Path, events_never_ride_out_alone: None
):
    host = SchedulerHost(_config(tmp_path))
    server, port = await _serve(SchedulerService(host))
    client = await _client(port)
    try:
        await _turn(client, "t-tool", "r-tool", finish="tool_calls")
        await until(
            lambda: "r-tool" in host.state.runs and host.state.runs["r-tool"].phase is Phase.PAUSED,
            what="the run to be paused on its tool at the scheduler",
        )
        assert host.identity.run_of(["call-t-tool"]) == "r-tool", "its tool calls name the run"
    finally:
        await client.close()
        await server.stop(grace=None)


def test_every_item_and_turn_event_has_its_urgency() -> None:
    """A new kind of item or event cannot go out without its urgency being said: every one the
    contract has gets one, and a turn's start and end get theirs from what they say."""
    urgency, Urgency = outbox.urgency, outbox.Urgency
    for field in pb.DataplaneItem.DESCRIPTOR.oneofs_by_name["item"].fields:
        if field.name != "event":
            value = "r-1" if field.type == field.TYPE_STRING else getattr(pb, field.message_type.name)()
            assert isinstance(urgency(pb.DataplaneItem(**{field.name: value})), Urgency), field.name
    for field in pb.TurnEvent.DESCRIPTOR.oneofs_by_name["event"].fields:
        event = pb.TurnEvent(turn_id="t", run_id="r", **{field.name: getattr(pb, field.message_type.name)()})
        assert isinstance(urgency(pb.DataplaneItem(event=event)), Urgency), field.name

    def of(**event: object) -> object:
        return urgency(pb.DataplaneItem(event=pb.TurnEvent(turn_id="t", run_id="r", **event)))

    assert of(started=pb.TurnStarted(streamed=True)) is Urgency.RIDES
    assert of(started=pb.TurnStarted(streamed=False)) is Urgency.WHILE_HELD
    assert of(completed=pb.TurnCompleted(finish_reason="tool_calls", tool_call_ids=["c"])) is Urgency.NOW
    assert of(completed=pb.TurnCompleted(finish_reason="stop")) is Urgency.WHILE_HELD
    assert of(failed=pb.TurnFailed(error="x")) is Urgency.NOW
