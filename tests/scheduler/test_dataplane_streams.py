"""What the scheduler keeps of each dataplane's streams: each speaks only for its own turns, and a
dataplane gone a while is forgotten.

- Over real gRPC on loopback (the real host and servicer): a stream whose dataplane names itself
  `dp-b` reports on a turn admitted through `dp-a`'s stream; the reports are ignored (the turn
  stays in flight, its slot counted) and logged once, and `dp-a`'s own report ends the turn.
- The host on a clock of the test's: a dataplane whose last stream ended is listed until it has
  been gone `DATAPLANE_FORGET_S`, then no more (its name once stayed forever).
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc.aio
import pytest
from test_run_identity import host as clocked_host
from turns_stream import TurnsStream

from luftpause.proto import DATAPLANE_KEY, pb, rpc
from luftpause.scheduler.host import DATAPLANE_FORGET_S, Link, SchedulerHost, SchedulerService


async def _serve(host: SchedulerHost) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _completed(turn_id: str, run_id: str) -> pb.TurnEvent:
    done = pb.TurnCompleted(finish_reason="stop", prompt_tokens=10, completion_tokens=2)
    return pb.TurnEvent(turn_id=turn_id, run_id=run_id, completed=done)


async def test_a_stream_may_report_only_on_its_own_dataplanes_turns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    host, _ = clocked_host()
    server, port = await _serve(host)
    caplog.set_level(logging.WARNING, logger="luftpause.scheduler")
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            TurnsStream(channel, metadata=((DATAPLANE_KEY, "dp-a"),)) as a,
            TurnsStream(channel, metadata=((DATAPLANE_KEY, "dp-b"),)) as b,
        ):
            placed = await a.admit(pb.AdmitRequest(turn_id="t-a", run_id="r-a", model="m"))
            assert placed.outcome == pb.AdmitReply.PLACED
            await b.report(_completed("t-a", "r-a"), _completed("t-a", "r-a"))
            await b.abandon("t-a", "r-a")
            # Its own turn after them on the same stream: once placed, the reports were read.
            assert (await b.admit(pb.AdmitRequest(turn_id="t-b", run_id="r-b", model="m"))).outcome == (
                pb.AdmitReply.PLACED
            )
            assert {t.turn_id: t.dataplane for t in host.state.placed()} == {"t-a": "dp-a", "t-b": "dp-b"}
            foreign = [r.getMessage() for r in caplog.records if "reported on turn" in r.getMessage()]
            assert foreign == [
                "dataplane 'dp-b' reported on turn t-a of dataplane 'dp-a': ignored (logged once a stream)"
            ]
            await a.report(_completed("t-a", "r-a"))
            await a.admit(pb.AdmitRequest(turn_id="t-a2", run_id="r-a", model="m"))
            assert {t.turn_id for t in host.state.placed()} == {"t-a2", "t-b"}, "its own report ended it"
    finally:
        await server.stop(grace=None)


async def test_a_dataplane_gone_a_while_is_forgotten():
    host, clock = clocked_host()
    link = Link("dp-gone")
    host.connect(link)
    stays = Link("dp-stays")
    host.connect(stays)
    host.disconnect(link)
    assert [d["name"] for d in host.dataplane_documents()] == ["dp-gone", "dp-stays"]
    clock.now += DATAPLANE_FORGET_S - 1
    host.tick()
    assert [(d["name"], d["streams"]) for d in host.dataplane_documents()] == [
        ("dp-gone", 0),
        ("dp-stays", 1),
    ]
    clock.now += 1
    host.tick()
    assert [d["name"] for d in host.dataplane_documents()] == ["dp-stays"], (
        "gone DATAPLANE_FORGET_S: forgotten"
    )
    # Back after that, it is listed again from its first stream.
    host.connect(Link("dp-gone"))
    assert [(d["name"], d["streams"]) for d in host.dataplane_documents()] == [
        ("dp-gone", 1),
        ("dp-stays", 1),
    ]
