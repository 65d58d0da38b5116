"""A Turns message with more items than the scheduler takes in one is refused, and stalls nothing.

The scheduler applies a message's items one after another without yielding: 100,000 admits in
one message once froze it for 11 s, its status port included. A real scheduler process here
gets, from a raw gRPC client, one message of 50,000 admits: the call ends with
RESOURCE_EXHAUSTED naming the limit, none of it is applied, and `GET /status` answers all along,
each time well within the stall applying it would cause. A message of exactly the limit is taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from support import Ports, Service, free_port, running, wait_until, write_config

from luftpause.proto import MAX_BATCH_ITEMS, pb, rpc

OVERSIZED = 50_000
# The longest GET /status may take meanwhile: applied, OVERSIZED admits would stall the port for
# about 5 s (100,000 froze it for 11 s), and nothing applied (the held count, below) says why it
# did not; half that stall leaves a loaded machine its slack and still catches it.
STATUS_BOUND_S = 2.5


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Ports]:
    # Replicas nobody answers for: the admits of a message that is taken are held.
    ports = Ports(engines=[free_port()])
    service = Service(
        "scheduler", ["scheduler", "--config", str(write_config(tmp_path, ports))], tmp_path / "scheduler.log"
    ).start()
    with running(service):
        service.wait_http(f"http://127.0.0.1:{ports.status}/status")
        yield ports


def _admits(prefix: str, n: int) -> pb.DataplaneBatch:
    return pb.DataplaneBatch(
        items=[
            pb.DataplaneItem(
                admit=pb.AdmitRequest(turn_id=f"{prefix}{i}", run_id=f"{prefix}r{i}", model="fake-llama")
            )
            for i in range(n)
        ]
    )


def _send(port: int, batch: pb.DataplaneBatch, hold: threading.Event) -> grpc.RpcError | None:
    """Sends `batch` on a Turns stream that then stays open until `hold` is set (or the
    scheduler ends it); the stream's error, None if it ended without one."""

    def messages() -> Iterator[pb.DataplaneBatch]:
        yield batch
        hold.wait(30)

    with grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        try:
            for _ in rpc.SchedulerStub(channel).Turns(messages(), timeout=30):
                pass
        except grpc.RpcError as e:
            return e
    return None


def test_an_oversized_turns_message_is_refused_naming_the_limit_and_status_keeps_answering(scheduler):
    ports = scheduler
    status = f"http://127.0.0.1:{ports.status}/status"
    slowest: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=5.0) as client:
            while not done.is_set():
                started = time.monotonic()
                client.get(status).raise_for_status()
                slowest.append(time.monotonic() - started)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    hold = threading.Event()
    try:
        error = _send(ports.grpc, _admits("big-", OVERSIZED), hold)
    finally:
        hold.set()
        done.set()
        watcher.join(10)
    assert error is not None, "the stream was not ended"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert (
        f"carried {OVERSIZED} items; at most {MAX_BATCH_ITEMS} a message (MAX_BATCH_ITEMS" in error.details()
    )
    assert slowest and max(slowest) < STATUS_BOUND_S, f"GET /status took up to {max(slowest):.2f} s"
    doc = httpx.get(status).json()
    assert doc["held"]["count"] == 0, "nothing of the refused message was applied"


def test_a_message_of_exactly_the_limit_is_taken(scheduler):
    ports = scheduler
    status = f"http://127.0.0.1:{ports.status}/status"
    hold = threading.Event()
    result: list[grpc.RpcError | None] = []
    sender = threading.Thread(
        target=lambda: result.append(_send(ports.grpc, _admits("fit-", MAX_BATCH_ITEMS), hold))
    )
    sender.start()
    try:
        wait_until(
            lambda: httpx.get(status).json()["held"]["count"] == MAX_BATCH_ITEMS,
            timeout_s=20,
            what=f"all {MAX_BATCH_ITEMS} admits held",
        )
    finally:
        hold.set()
        sender.join(30)
    assert result and (result[0] is None or result[0].code() != grpc.StatusCode.RESOURCE_EXHAUSTED)
