"""Admission on the Turns stream at its edges: a client leaving as its turn is placed, and the
stream breaking while turns are held.

The real scheduler host behind real gRPC on loopback, and the dataplane's own scheduler client.

- A placement held back on its way (a gate in front of the stream's writes) while the client
  leaves: the client never reads the placement, and the scheduler counts a turn on the replica
  that no engine will ever run. What a user must see: the turn leaves the scheduler's books at
  once, not after the 600 s turn timeout.
- The stream breaking (the scheduler restarting on the same port) while a turn is held: the
  turn is admitted again under the same turn id once the stream is back, and its client gets
  its placement.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc.aio
from support import Ports, until, write_config

from luftpause import config as lp_config
from luftpause.dataplane.runs import PlacedTurn
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb, rpc
from luftpause.scheduler.host import SchedulerHost, SchedulerService


class _GatedWrites:
    """A servicer context whose writes of placements set `placed` and wait at `gate` (the
    scheduler's other messages, saying whether it holds turns, go through)."""

    def __init__(self, context: Any, placed: asyncio.Event, gate: asyncio.Event) -> None:
        self._context, self._placed, self._gate = context, placed, gate

    async def write(self, message: Any) -> None:
        if message.placements:
            self._placed.set()
            await self._gate.wait()
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _PlacementsHeldBack(SchedulerService):
    """The real servicer, whose placements wait at a gate before they are written."""

    def __init__(self, host: SchedulerHost) -> None:
        super().__init__(host)
        self.placed = asyncio.Event()
        self.gate = asyncio.Event()

    async def Turns(self, request_iterator, context):  # noqa: N802, ANN001, ANN201 (gRPC's method)
        return await super().Turns(request_iterator, _GatedWrites(context, self.placed, self.gate))


async def _serve(
    host: SchedulerHost, service: SchedulerService | None = None, port: int = 0
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    rpc.add_SchedulerServicer_to_server(service or SchedulerService(host), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _request(turn_id: str, run_id: str) -> pb.AdmitRequest:
    return pb.AdmitRequest(
        turn_id=turn_id, run_id=run_id, model="fake-llama", caller="c", service_class=pb.BATCH
    )


async def test_a_turn_placed_as_its_client_leaves_is_abandoned_at_the_scheduler(tmp_path: Path):
    config = lp_config.load(write_config(tmp_path, Ports()))
    host = SchedulerHost(config)
    service = _PlacementsHeldBack(host)
    server, port = await _serve(host, service)
    client = SchedulerClient(f"127.0.0.1:{port}")
    await client.start()
    try:
        await until(lambda: client.connected, what="the client to resync and connect")
        left: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        admission = asyncio.create_task(client.admit(_request("t-race", "r-race"), left))
        await asyncio.wait_for(service.placed.wait(), timeout=5)
        assert len(host.state.placed()) == 1, "the scheduler placed the turn"

        left.set_result(None)  # the client goes, while the placement is on its way to it
        assert await asyncio.wait_for(admission, timeout=5) is None, "the dataplane saw no placement"
        service.gate.set()

        await until(lambda: not host.state.placed(), what="the placed turn to leave the scheduler")
        assert "t-race" not in host.state.turns
    finally:
        service.gate.set()
        await client.close()
        await server.stop(grace=None)


async def test_a_turn_held_when_the_stream_breaks_is_admitted_again_under_its_id(tmp_path: Path):
    config = lp_config.load(write_config(tmp_path, Ports()))
    host = SchedulerHost(config)
    server, port = await _serve(host)
    client = SchedulerClient(f"127.0.0.1:{port}")
    await client.start()
    never: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    admissions: dict[str, asyncio.Task[pb.AdmitReply | None]] = {}
    try:
        await until(lambda: client.connected, what="the client to resync and connect")
        # Admit turns until one is held: every replica has its lookahead of unconfirmed turns.
        for i in range(20):
            turn_id = f"t{i}"
            admissions[turn_id] = asyncio.create_task(client.admit(_request(turn_id, f"r{i}"), never))
            await until(lambda t=turn_id: t in host.state.turns, what=f"{turn_id} to reach the scheduler")
            if host.state.held():
                break
        held = [t.turn_id for t in host.state.held()]
        assert len(held) == 1, "one turn is held"
        placed = {}
        for turn_id, task in admissions.items():
            if turn_id not in held:
                reply = await asyncio.wait_for(task, timeout=5)
                assert reply is not None
                placed[turn_id] = reply
                client.placed(
                    PlacedTurn(turn_id, f"r{turn_id[1:]}", reply.replica, pb.BATCH, "c", "fake-llama")
                )

        # The scheduler restarts on the same port: a new host knows nothing until the resync.
        await server.stop(grace=None)
        await until(lambda: not client.connected, what="the client to see the stream break")
        restarted = SchedulerHost(config)
        server, _ = await _serve(restarted, port=port)
        await until(lambda: client.connected, timeout_s=10, what="the client to reconnect")

        await until(lambda: held[0] in restarted.state.turns, what="the held turn to be admitted again")
        assert [t.turn_id for t in restarted.state.held()] == held, "held again, under the same turn id"
        assert {t.turn_id for t in restarted.state.placed()} == set(placed), (
            "the resync brought the placed turns"
        )

        # Room comes back (one placed turn completes and its engine starts the next): the held
        # turn's client gets its placement.
        done = next(iter(placed))
        client.report(
            pb.TurnEvent(
                turn_id=done, run_id=f"r{done[1:]}", completed=pb.TurnCompleted(finish_reason="stop")
            )
        )
        for turn_id in placed:
            if turn_id != done:
                client.report(
                    pb.TurnEvent(turn_id=turn_id, run_id=f"r{turn_id[1:]}", first_token=pb.FirstToken())
                )
        reply = await asyncio.wait_for(admissions[held[0]], timeout=5)
        assert reply is not None and reply.outcome == pb.AdmitReply.PLACED
    finally:
        for task in admissions.values():
            task.cancel()
        await client.close()
        await server.stop(grace=None)
