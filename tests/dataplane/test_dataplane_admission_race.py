"""A client leaving at the moment its held turn is placed: the slot must not leak.

The real scheduler host behind real gRPC on loopback, and the dataplane's own scheduler client.
The scheduler's answer to Admit is held back after the core has placed the turn (a gate in the
servicer), so the client's cancel lands while the reply is on its way: gRPC accepts the cancel,
the client never learns the placement, and the scheduler counts a turn on the replica that no
engine will ever run. What a user must see: the turn leaves the scheduler's books at once, not
after the 600 s turn timeout.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc.aio
from conftest import until
from support import Ports, write_config

from luftpause import config as lp_config
from luftpause.dataplane.runs import RunBook
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb, rpc
from luftpause.scheduler.events import TurnAbandoned
from luftpause.scheduler.host import SchedulerHost, SchedulerService


class _ReplyHeldBack(SchedulerService):
    """The real servicer, whose Admit reply waits at a gate once the turn is placed."""

    def __init__(self, host: SchedulerHost) -> None:
        super().__init__(host)
        self.placed = asyncio.Event()
        self.gate = asyncio.Event()

    async def Admit(self, request, context):  # noqa: N802 (gRPC's method name)
        reply = await super().Admit(request, context)
        self.placed.set()
        await self.gate.wait()
        return reply


def _placed_turns(host: SchedulerHost) -> int:
    return len(host.state.placed())


async def test_a_turn_placed_as_its_client_leaves_is_abandoned_at_the_scheduler(tmp_path: Path):
    config = lp_config.load(write_config(tmp_path, Ports()))
    host = SchedulerHost(config)
    service = _ReplyHeldBack(host)
    server = grpc.aio.server()
    rpc.add_SchedulerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}", RunBook())
    await client.start()
    try:
        await until(lambda: client.connected, what="the client to resync and connect")
        left: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        request = pb.AdmitRequest(turn_id="t-race", run_id="r-race", model="fake-llama", caller="c")
        admission = asyncio.create_task(client.admit(request, left))
        await asyncio.wait_for(service.placed.wait(), timeout=5)
        assert _placed_turns(host) == 1, "the scheduler placed the turn"

        left.set_result(None)  # the client goes, while the placement is on its way to it
        assert await asyncio.wait_for(admission, timeout=5) is None, "the dataplane saw no placement"
        service.gate.set()

        await until(lambda: _placed_turns(host) == 0, what="the placed turn to leave the scheduler")
        assert "t-race" not in host.state.turns
    finally:
        service.gate.set()
        await client.close()
        await server.stop(grace=None)


async def test_an_abandon_that_overtakes_its_admit_drops_the_admit(tmp_path: Path):
    """The report stream may deliver the abandon before the scheduler has read the cancelled
    Admit; the Admit is then dropped on arrival instead of being placed for nobody."""
    config = lp_config.load(write_config(tmp_path, Ports()))
    host = SchedulerHost(config)
    host.feed(TurnAbandoned("t-late", "r-late", host.clock()))
    server = grpc.aio.server()
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.SchedulerStub(channel)
            try:
                await stub.Admit(pb.AdmitRequest(turn_id="t-late", run_id="r-late", model="fake-llama"))
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED
            else:
                raise AssertionError("an Admit abandoned before it arrived was answered")
        assert _placed_turns(host) == 0 and "t-late" not in host.state.turns
    finally:
        await server.stop(grace=None)
