"""A resync larger than gRPC's 4 MiB message limit goes through.

Every run the dataplane has seen in the last 30 minutes is in its resync, and every header-less
request is a run of its own, so a busy proxy's view passes the limit within the idle window.
A message over it was refused (RESOURCE_EXHAUSTED) at every reconnect, and the dataplane held
every turn for good. The real scheduler host behind real gRPC on loopback, and the dataplane's
own client with a run book of 50,000 runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc.aio
from support import Ports, until, write_config

from luftpause import config as lp_config
from luftpause.dataplane.runs import PlacedTurn, RunBook, split_resync
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb, rpc
from luftpause.scheduler.host import SchedulerHost, SchedulerService

GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024
RUNS = 50_000


def _busy_book() -> RunBook:
    book = RunBook()
    now = time.monotonic()  # what the client's resync prunes against
    for i in range(RUNS):
        turn = PlacedTurn(
            f"turn-{i:06d}", f"run-{i:06d}-{'x' * 60}", "fake-a", pb.BATCH, f"caller-{i % 97}", "m"
        )
        book.placed(turn, now=now)
        paused = pb.TurnCompleted(finish_reason="tool_calls", tool_call_ids=["call-1"])
        book.apply(pb.TurnEvent(turn_id=turn.turn_id, run_id=turn.run_id, completed=paused), now=now)
    # One turn still in flight and runs ended here, so every part of the view is exercised.
    book.placed(PlacedTurn("turn-open", "run-open", "fake-b", pb.INTERACTIVE, "caller-0", "m"), now=now)
    for i in range(RUNS // 10):
        book.apply(pb.TurnEvent(run_id=f"run-ended-{i:06d}", run_ended=pb.RunEnded()), now=now)
    return book


def test_a_view_is_split_into_small_messages_with_nothing_lost_or_reordered():
    whole = _busy_book().resync_request()
    chunks = split_resync(whole, max_bytes=256 * 1024)
    assert len(chunks) > 1
    assert all(c.ByteSize() <= 256 * 1024 for c in chunks)
    joined = pb.ResyncRequest()
    for c in chunks:
        joined.MergeFrom(c)
    assert joined == whole
    assert len(split_resync(pb.ResyncRequest())) == 1, "an empty view is still one message"


async def test_a_resync_over_grpcs_message_limit_reaches_the_scheduler(tmp_path: Path):
    book = _busy_book()
    assert book.resync_request().ByteSize() > GRPC_DEFAULT_LIMIT, "the view must pass the limit"
    host = SchedulerHost(lp_config.load(write_config(tmp_path, Ports())))
    server = grpc.aio.server()  # gRPC's default limits, as the scheduler runs
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}", runs=book)
    await client.start()
    try:
        await until(lambda: client.connected, timeout_s=30, what="the dataplane to resync and connect")
        assert len(host.state.runs) == RUNS + 1
        assert [t.turn_id for t in host.state.placed()] == ["turn-open"]
        run = host.state.runs[f"run-{RUNS - 1:06d}-{'x' * 60}"]
        assert (run.replica, run.phase.value) == ("fake-a", "paused")
    finally:
        await client.close()
        await server.stop(grace=None)
