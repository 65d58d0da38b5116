"""A dataplane's Turns stream driven by hand, for tests that speak the scheduler's gRPC contract.

`TurnsStream(channel)` opens the stream; `admit` sends an admission and waits for its placement,
`admit_later` returns the placement's future at once, `report` and `abandon` send turn events.
Each call writes its own message, so the scheduler sees them in the order the test makes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc.aio

from luftpause.proto import pb, rpc


class TurnsStream:
    def __init__(self, channel: grpc.aio.Channel, metadata: Any = None) -> None:
        self._channel, self._metadata = channel, metadata
        self._placements: dict[str, asyncio.Future[pb.AdmitReply]] = {}
        self.call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TurnsStream:
        self.call = rpc.SchedulerStub(self._channel).Turns(metadata=self._metadata)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the stream from this side, as a dataplane that goes away."""
        if self.call is not None:
            self.call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        assert self.call is not None
        while (batch := await self.call.read()) is not grpc.aio.EOF:
            for placement in batch.placements:
                future = self._future(placement.turn_id)
                if not future.done():
                    future.set_result(placement.reply)

    def _future(self, turn_id: str) -> asyncio.Future[pb.AdmitReply]:
        if turn_id not in self._placements:
            self._placements[turn_id] = asyncio.get_running_loop().create_future()
        return self._placements[turn_id]

    async def _write(self, *items: pb.DataplaneItem) -> None:
        assert self.call is not None, "use `async with TurnsStream(channel)`"
        await self.call.write(pb.DataplaneBatch(items=items))

    async def admit_later(self, request: pb.AdmitRequest) -> asyncio.Future[pb.AdmitReply]:
        future = self._future(request.turn_id)
        await self._write(pb.DataplaneItem(admit=request))
        return future

    async def admit(self, request: pb.AdmitRequest, within_s: float = 10.0) -> pb.AdmitReply:
        future = await self.admit_later(request)
        reading = self._reader
        assert reading is not None
        done, _ = await asyncio.wait({future, reading}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
        if future in done:
            return future.result()
        if reading in done:
            reading.result()  # the stream's own error, if it ended with one
            raise AssertionError(f"the stream ended before turn {request.turn_id} was placed")
        raise AssertionError(f"turn {request.turn_id} not placed within {within_s} s")

    async def report(self, *events: pb.TurnEvent) -> None:
        await self._write(*(pb.DataplaneItem(event=e) for e in events))

    async def abandon(self, turn_id: str, run_id: str) -> None:
        await self.report(pb.TurnEvent(turn_id=turn_id, run_id=run_id, abandoned=pb.TurnAbandoned()))
