"""A connection to the scheduler that goes half-open is found by keepalive within seconds, and the
pings that find it are not taken for abuse while it is alive.

The real scheduler host behind its real gRPC server (`grpc_auth.grpc_server`, its options as it
runs), the dataplane's own client, and between them a TCP relay on loopback that can stop
carrying bytes both ways while keeping both sockets open: what a host that vanished or a cut
network leaves behind. The keepalive is shortened to 1 s for the test (config.SCHEDULER_KEEPALIVE_S).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from support import Ports, until, write_config

from luftpause import config as lp_config
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import rpc
from luftpause.scheduler.grpc_auth import grpc_server
from luftpause.scheduler.host import SchedulerHost, SchedulerService


class FreezingRelay:
    """Relays TCP connections to `upstream`; `freeze` stops every byte both ways, sockets left open."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.connections = 0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        self.flowing.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._tasks.add(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                await self.flowing.wait()
                sink.write(data)
                await sink.drain()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        self.server.close()


async def test_a_half_open_connection_to_the_scheduler_is_found_and_live_pings_are_welcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lp_config, "SCHEDULER_KEEPALIVE_S", 1.0)
    monkeypatch.setattr(lp_config, "SCHEDULER_KEEPALIVE_TIMEOUT_S", 1.0)
    host = SchedulerHost(lp_config.load(write_config(tmp_path, Ports())))
    server = grpc_server(None, max_connections=16, handshake_timeout_s=5.0)
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    relay = FreezingRelay(port)
    client = SchedulerClient(f"127.0.0.1:{await relay.start()}")
    await client.start()
    try:
        await until(lambda: client.connected, timeout_s=15, what="the dataplane to connect")
        # Idle long enough for several pings each way (the scenario, not a wait for a condition):
        # had the scheduler refused them as too many, the connection would have been dropped.
        await asyncio.sleep(4.5)
        assert client.connected and relay.connections == 1, "live pings must not cost the connection"
        assert host.streams_open() == 1
        relay.freeze()
        await until(lambda: not client.connected, timeout_s=10, what="the dataplane to find it half-open")
        await until(lambda: host.streams_open() == 0, timeout_s=10, what="the scheduler to find it half-open")
    finally:
        await client.close()
        await relay.close()
        await server.stop(grace=None)
