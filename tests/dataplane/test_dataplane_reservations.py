"""Reservations end to end: the real scheduler host behind real gRPC, the dataplane's own client.

What a user must see (proto/scheduler.proto, core.reserve):

- on a quiet stack, a run's next turn goes to the replica it last ran on without waiting for the
  scheduler to answer, while a run the dataplane has never seen still asks;
- a turn that other dataplanes' reservations leave no room for is placed as soon as they are
  given back, without those dataplanes sending anything of their own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import until
from test_dataplane_report_riding import _client, _config, _request, _serve, two_dataplanes

from luftpause.dataplane.runs import PlacedTurn
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb
from luftpause.scheduler import events as ev
from luftpause.scheduler.actions import Action
from luftpause.scheduler.host import SchedulerHost, SchedulerService


async def _whole_turn(
    client: SchedulerClient, turn_id: str, run_id: str, request: pb.AdmitRequest | None = None
) -> pb.AdmitReply:
    """Admitted (or sent on a reservation), booked, started, first token, completed: as the proxy reports it."""
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    request = request or _request(turn_id, run_id)
    reply = await asyncio.wait_for(client.admit(request, never), timeout=5)
    assert reply is not None and reply.outcome == pb.AdmitReply.PLACED
    client.placed(PlacedTurn(turn_id, run_id, reply.replica, pb.INTERACTIVE, "c", "fake-llama"))
    client.started(turn_id, run_id, streamed=True)
    client.first_token(turn_id, run_id)
    client.completed(turn_id, run_id, "stop", 10, 5, [])
    return reply


async def test_a_runs_next_turn_goes_without_waiting_for_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    host = SchedulerHost(_config(tmp_path))
    server, port = await _serve(SchedulerService(host))
    client = await _client(port)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        first = await _whole_turn(client, "t1", "r")
        await until(
            lambda: host.state.reservations and not host.state.placed(), what="a reservation, t1 done"
        )
        # From now on the scheduler answers no admission at all.
        unanswered: list[str] = []
        monkeypatch.setattr(
            host, "admit", lambda arrived, link, echoed=(): unanswered.append(arrived.turn_id)
        )
        used: list[ev.ReservationUsed] = []
        feed = host.feed

        def feed_and_note(event: ev.Event) -> tuple[Action, ...]:
            if isinstance(event, ev.ReservationUsed):
                used.append(event)
            return feed(event)

        monkeypatch.setattr(host, "feed", feed_and_note)

        second = await _whole_turn(client, "t2", "r")
        assert (second.replica, second.url) == (first.replica, first.url)
        # The scheduler learns where t2 went from the report of the reservation's use.
        await until(lambda: [e.turn.turn_id for e in used] == ["t2"], what="t2's reservation reported used")
        assert used[0].replica == first.replica and used[0].turn.run_id == "r"

        # A run the dataplane has never seen asks, and waits for the answer that does not come.
        other = asyncio.create_task(client.admit(_request("t3", "r-new"), never))
        await until(lambda: unanswered == ["t3"], what="t3's admission")
        assert not other.done()
        other.cancel()
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_a_turn_held_behind_reservations_is_placed_when_they_are_given_back(tmp_path: Path):
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    async with two_dataplanes(tmp_path, lookahead=1) as (host, first, second):
        await _whole_turn(first, "t1", "r-1")
        # dp-1 now holds the replica's one turn of room.
        await until(
            lambda: (
                [r.dataplane for r in host.state.reservations.values()] == ["dp-1"]
                and not host.state.placed()
            ),
            what="dp-1's reservation",
        )
        # dp-2's turn has no room: held, dp-1 is told to give its reservation back, and does.
        reply = await asyncio.wait_for(second.admit(_request("t2", "r-2"), never), timeout=5)
        assert reply is not None and reply.outcome == pb.AdmitReply.PLACED
        assert [t.turn_id for t in host.state.placed()] == ["t2"]
        assert host.state.waiting_ours(reply.replica) == 1


async def test_the_scheduler_learns_each_turns_size_whether_it_asked_or_went_on_a_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    host = SchedulerHost(_config(tmp_path))
    server, port = await _serve(SchedulerService(host))
    client = await _client(port)
    arrived: list[tuple[str, ev.TurnArrived]] = []
    feed = host.feed

    def feed_and_note(event: ev.Event) -> tuple[Action, ...]:
        if isinstance(event, ev.TurnArrived):
            arrived.append(("admitted", event))
        elif isinstance(event, ev.ReservationUsed):
            arrived.append(("reserved", event.turn))
        return feed(event)

    monkeypatch.setattr(host, "feed", feed_and_note)
    try:
        sized = _request("t1", "r")
        sized.request_bytes, sized.max_tokens = 2300, 256
        await _whole_turn(client, "t1", "r", sized)
        await until(
            lambda: host.state.reservations and not host.state.placed(), what="a reservation, t1 done"
        )
        # The run's next turn goes on the reservation: its use carries the admission's fields.
        unlimited = _request("t2", "r")
        unlimited.request_bytes = 4100
        await _whole_turn(client, "t2", "r", unlimited)
        await until(lambda: len(arrived) == 2, what="t2's reservation reported used")
    finally:
        await client.close()
        await server.stop(grace=None)
    assert [(how, a.turn_id, a.request_bytes, a.max_tokens) for how, a in arrived] == [
        ("admitted", "t1", 2300, 256),
        ("reserved", "t2", 4100, None),
    ]
