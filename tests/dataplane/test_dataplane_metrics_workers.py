"""`GET /metrics` of `luftpause dataplane --workers 2` reports the dataplane as a whole.

Real processes on loopback: a fake engine, the scheduler and a dataplane of two workers (the
stack of test_dataplane_workers.py). Which worker takes a connection is made the test's by
stopping the other one while the connection is opened (`OnlyWorker`), so each turn is sent
through a worker of the test's choosing and each scrape is answered by a worker of its choosing.
What an operator sees:

- every scrape counts every turn sent through any worker, and the counts are the same whichever
  worker answers;
- turns in flight are the sum over the workers while turns run through both, and 0 once they end;
- the scheduler link reads 1 with both workers' links up;
- a worker that dies leaves the counts of the turns it carried, and its in-flight turns leave the
  gauge;
- the workers' metrics directory is gone once the dataplane stops.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import test_dataplane_workers
from prometheus_client.parser import text_string_to_metric_families
from support import wait_until
from test_dataplane_workers import MODEL, OnlyWorker, Stack

TURNS = "luftpause_dataplane_turns"
IN_FLIGHT = "luftpause_dataplane_turns_in_flight"
CONNECTED = "luftpause_dataplane_scheduler_connected"
TURN_SECONDS = "luftpause_dataplane_turn_seconds"
# That module's stack of two workers (not conftest's, a single dataplane in the test process).
stack = test_dataplane_workers.stack
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def scrape(stack: Stack, pid: int) -> dict[str, dict[tuple[str, ...], float]]:
    """`/metrics` as answered by worker `pid`: each family's samples by sample name and label values."""
    with OnlyWorker(stack, pid), httpx.Client(timeout=10) as client:
        reply = client.get(f"{stack.url}/metrics")
    assert reply.status_code == 200, reply.text
    families: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(reply.text):
        families[family.name] = {
            (s.name, *(v for _, v in sorted(s.labels.items()))): s.value for s in family.samples
        }
    return families


def turns_counted(families: dict[str, dict[tuple[str, ...], float]]) -> dict[tuple[str, ...], float]:
    """The turns counter's non-zero `_total` values, keyed by (class, outcome, route)."""
    return {k[1:]: v for k, v in families[TURNS].items() if k[0] == f"{TURNS}_total" and v}


def gauge(families: dict[str, dict[tuple[str, ...], float]], name: str) -> float:
    ((value),) = families[name].values()
    return value


def send_turns(stack: Stack, pid: int, completed: int, refused: int) -> None:
    """`completed` turns and `refused` ones (a class nobody has) through worker `pid` alone, each on
    a connection of its own."""
    with OnlyWorker(stack, pid):
        for _ in range(completed):
            with httpx.Client(timeout=30) as client:
                reply = client.post(f"{stack.url}/v1/chat/completions", json=BODY)
            assert reply.status_code == 200, reply.text
        for _ in range(refused):
            with httpx.Client(timeout=30) as client:
                reply = client.post(
                    f"{stack.url}/v1/chat/completions", json=BODY, headers={"x-luftpause-class": "urgent"}
                )
            assert reply.status_code == 400, reply.text


def test_every_scrape_counts_the_turns_of_both_workers_whichever_answers(stack: Stack):
    first, second = stack.workers()
    # Different numbers through each, so that neither worker's own counts add up to the whole.
    send_turns(stack, first, completed=3, refused=1)
    send_turns(stack, second, completed=5, refused=2)
    whole = {("interactive", "completed", "chat"): 8.0, ("unknown", "refused", "chat"): 3.0}
    # A turn is counted as its reply ends, a moment after the client has it.
    wait_until(
        lambda: turns_counted(scrape(stack, first)) == whole, timeout_s=10, what="all 11 turns counted"
    )
    for pid in (first, second, first, second):
        families = scrape(stack, pid)
        assert turns_counted(families) == whole, pid
        assert sum(turns_counted(families).values()) == 11
        # Each completed turn timed once at the engine, summed over both workers.
        assert families[TURN_SECONDS][f"{TURN_SECONDS}_count", "interactive", "fake-a"] == 8
        assert gauge(families, IN_FLIGHT) == 0
        assert gauge(families, CONNECTED) == 1
    # Every scrape is the same, whichever worker answers it.
    assert scrape(stack, first)[TURNS] == scrape(stack, second)[TURNS]


def long_turn_through(stack: Stack, pid: int, ended: dict[int, int]) -> threading.Thread:
    """A streamed turn through worker `pid`, started and placed; `ended[pid]` its status once it ends."""

    def turn() -> None:
        body = {**BODY, "stream": True, "max_tokens": 200, "ignore_eos": True}
        try:
            with httpx.Client(timeout=60) as client:
                reply = client.post(f"{stack.url}/v1/chat/completions", json=body)
            ended[pid] = reply.status_code
        except httpx.HTTPError:
            ended[pid] = -1

    placed = stack.in_flight()
    with OnlyWorker(stack, pid):
        thread = threading.Thread(target=turn)
        thread.start()
        wait_until(lambda: stack.in_flight() == placed + 1, timeout_s=10, what=f"a turn placed through {pid}")
    return thread


def test_turns_in_flight_are_summed_over_the_workers_and_fall_back_to_zero(stack: Stack):
    first, second = stack.workers()
    ended: dict[int, int] = {}
    threads = [long_turn_through(stack, pid, ended) for pid in (first, second)]
    # The engine stands still: the turns stay in flight until it goes on.
    stack.engine.send_signal(signal.SIGSTOP)
    try:
        # A worker counts its turn once the scheduler's placement reaches it.
        wait_until(lambda: gauge(scrape(stack, first), IN_FLIGHT) == 2, timeout_s=10, what="two in flight")
        assert gauge(scrape(stack, second), IN_FLIGHT) == 2
    finally:
        stack.engine.send_signal(signal.SIGCONT)
    for thread in threads:
        thread.join(timeout=60)
    assert ended == {first: 200, second: 200}
    wait_until(lambda: gauge(scrape(stack, first), IN_FLIGHT) == 0, timeout_s=10, what="no turn in flight")
    assert gauge(scrape(stack, second), IN_FLIGHT) == 0
    assert turns_counted(scrape(stack, second)) == {("interactive", "completed", "chat"): 2.0}


def test_a_dead_workers_turns_stay_counted_and_its_in_flight_ones_leave_the_gauge(stack: Stack):
    first, second = stack.workers()
    send_turns(stack, second, completed=2, refused=0)
    ended: dict[int, int] = {}
    threads = [long_turn_through(stack, pid, ended) for pid in (first, second)]
    stack.engine.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: gauge(scrape(stack, first), IN_FLIGHT) == 2, timeout_s=10, what="two in flight")
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: second not in stack.workers() and len(stack.workers()) == 2, timeout_s=15,
                   what="the second worker started again")  # fmt: skip
        # The dead worker's turn left the gauge; the two turns it had finished stay counted.
        families = scrape(stack, first)
        assert gauge(families, IN_FLIGHT) == 1
        assert turns_counted(families) == {("interactive", "completed", "chat"): 2.0}
    finally:
        stack.engine.send_signal(signal.SIGCONT)
    for thread in threads:
        thread.join(timeout=60)
    assert ended[first] == 200
    third = next(p for p in stack.workers() if p != first)
    wait_until(lambda: gauge(scrape(stack, third), IN_FLIGHT) == 0, timeout_s=10, what="no turn in flight")
    # The dead worker's turn was cut off with it (counted nowhere); the first worker's completed.
    assert turns_counted(scrape(stack, third)) == {("interactive", "completed", "chat"): 3.0}


def test_the_metrics_directory_is_private_and_gone_once_the_dataplane_stops(stack: Stack):
    first, _ = stack.workers()
    shared = Path(dict(_environ(first))["PROMETHEUS_MULTIPROC_DIR"])
    assert shared.is_dir() and (shared.stat().st_mode & 0o777) == 0o700
    assert any(shared.glob("counter_*.db"))
    stack.dataplane.stop()
    assert not shared.exists()


def _environ(pid: int) -> list[tuple[str, str]]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return [tuple(e.decode().split("=", 1)) for e in entries if b"=" in e]  # type: ignore[misc]
