"""The scheduler's `admit` spans, from a real scheduler process exporting to the test's own OTLP
receiver (tests/otlp_receiver.py), driven over its Turns stream as a dataplane drives it.

A turn the dataplane sends on a reservation never asks for admission: its admit span is made
when the ReservationUsed arrives, under the turn's traceparent (carried in the AdmitRequest
inside it, as for every admission on the one shared stream), held 0 ms and marked as gone on a
reservation. A turn that asks gets one from its arrival to its placement, on the replica it got.
"""

from __future__ import annotations

import grpc
from otlp_receiver import OtlpReceiver
from support import Ports, Service, running, until, write_config
from turns_stream import TurnsStream

from luftpause.proto import pb

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def traceparent(span_id: str) -> str:
    return f"00-{TRACE_ID}-{span_id}-01"


async def test_a_turn_on_a_reservation_and_one_that_asked_each_get_an_admit_span(tmp_path):
    ports = Ports()
    config = write_config(tmp_path, ports)
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        scheduler = Service("scheduler", ["scheduler", "--config", str(config)], tmp_path / "s.log")
        with running(scheduler.start(env)):
            scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel,
                TurnsStream(channel) as turns,
            ):
                used = pb.ReservationUsed(
                    reservation_id="r-1",
                    replica="fake-b",
                    admit=pb.AdmitRequest(
                        turn_id="t-reserved",
                        run_id="run-1",
                        model="fake-llama",
                        traceparent=traceparent("00f067aa0ba902b7"),
                    ),
                )
                await turns._write(pb.DataplaneItem(reservation_used=used))
                # No probe has answered (no engine listens): an admitted turn would be held, so
                # the one that asks is abandoned while held, which ends its admit span too.
                await turns.admit_later(
                    pb.AdmitRequest(
                        turn_id="t-asked",
                        run_id="run-2",
                        model="fake-llama",
                        traceparent=traceparent("b7ad6b7169203331"),
                    )
                )
                await turns.abandon("t-asked", "run-2")

                def admits() -> dict[str, dict]:
                    return {
                        s.parent_id: s.attributes
                        for s in receiver.received()
                        if s.name == "admit" and s.trace_id == TRACE_ID
                    }

                await until(lambda: len(admits()) == 2, timeout_s=20, what="both admit spans at the receiver")

    spans = admits()
    reserved = spans["00f067aa0ba902b7"]
    assert reserved["luftpause.turn_id"] == "t-reserved"
    assert (
        reserved["luftpause.replica"],
        reserved["luftpause.held_ms"],
        reserved["luftpause.reservation"],
    ) == ("fake-b", 0.0, True)
    asked = spans["b7ad6b7169203331"]
    assert (asked["luftpause.turn_id"], asked["luftpause.outcome"]) == ("t-asked", "abandoned")
