"""The dataplane never sends the scheduler more than `MAX_BATCH_ITEMS` items in one Turns message.

The scheduler ends a stream whose message carries more (scheduler/host.py, `BatchTooLarge`), so
a busy dataplane that had more ready at once than the limit would lose its stream and resync.
The real scheduler host behind real gRPC on loopback and the dataplane's own scheduler client:
three times the limit of events queued in one turn of the event loop, then an admission; the
admission is placed on the same stream (one resync, one stream), and every message the
scheduler read was within the limit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from support import until
from test_dataplane_report_riding import _client, _config, _CountingService, _request, _serve

from luftpause.proto import MAX_BATCH_ITEMS, pb
from luftpause.scheduler.host import SchedulerHost


class _SizingService(_CountingService):
    """Counts the messages, and keeps the size of the largest one read."""

    largest = 0

    async def _read(self, request_iterator, link):  # noqa: ANN001, ANN202 (the servicer's own signature)
        async def sized():  # noqa: ANN202
            async for batch in request_iterator:
                self.largest = max(self.largest, len(batch.items))
                yield batch

        await super()._read(sized(), link)


async def test_more_events_ready_at_once_than_the_limit_go_over_several_messages(tmp_path: Path):
    host = SchedulerHost(_config(tmp_path))
    service = _SizingService(host)
    server, port = await _serve(service)
    client = await _client(port, "dp-busy")
    try:
        events = 3 * MAX_BATCH_ITEMS
        for i in range(events):
            client.first_token(f"busy-{i}", f"busy-r{i}")
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reply = await asyncio.wait_for(client.admit(_request("after", "after-r"), never), timeout=10)
        assert reply is not None and reply.outcome == pb.AdmitReply.PLACED
        await until(lambda: service.messages >= 3, what="the events read by the scheduler")
        assert service.largest <= MAX_BATCH_ITEMS, f"a message of {service.largest} items"
        seen = host.dataplanes["dp-busy"]
        assert (seen.resyncs, seen.streams) == (1, 1), "the stream was ended and opened again"
    finally:
        await client.close()
        await server.stop(grace=None)
