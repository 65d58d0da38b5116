"""`luftpause dataplane --workers 2`: two dataplane processes behind one port, real processes.

A fake engine, the scheduler and a dataplane of two workers on loopback. Which worker takes a
new connection is the kernel's choice; the tests make it theirs by stopping one worker
(SIGSTOP) while a connection is opened, so that only the other one accepts. What a user sees:

- an agent that sends no run header keeps one run however its turns are spread over the workers;
- a worker that dies is started again, and its resync leaves the other worker's turns in flight
  alone: the scheduler still counts them, and they finish;
- a run ended (DELETE) through one worker is gone from every worker's book: a scheduler
  restarted afterwards does not get it back from the worker that ran its turns, whether the
  scheduler heard of the end before its restart or not at all;
- stopping the dataplane stops every worker.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support import Ports, Service, running, wait_until, write_config

from luftpause import config as lp_config
from luftpause.dataplane.scheduler_client import dataplane_name

MODEL = "fake-llama"
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@dataclass
class Stack:
    ports: Ports
    engine: Service
    scheduler: Service
    dataplane: Service
    config: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.dataplane}"

    def workers(self) -> list[int]:
        """The worker processes' pids, in the order they were started."""
        assert self.dataplane.proc is not None
        pid = self.dataplane.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children]

    def status(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.ports.status}/status", timeout=5).json()

    def in_flight(self) -> int:
        return sum(r["in_flight"] for r in self.status()["replicas"])

    def run_phase(self, run_id: str) -> str | None:
        reply = httpx.get(f"http://127.0.0.1:{self.ports.status}/status/runs/{run_id}", timeout=5)
        return reply.json()["phase"] if reply.status_code == 200 else None

    def resyncs(self) -> dict[str, tuple[int, int]]:
        """Each dataplane the scheduler knows, by name: (its resyncs, its Turns streams open)."""
        return {d["name"]: (d["resyncs"], d["streams"]) for d in self.status()["dataplanes"]}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    ports = Ports()
    ports.engines = ports.engines[:1]
    path = write_config(tmp_path, ports)
    engine = Service(
        "engine",
        ["fake-engine", "--name", "fake-a", "--port", str(ports.engines[0]), "--time-scale", "1"],
        tmp_path / "engine.log",
    )
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service(
        "dataplane", ["dataplane", "--config", str(path), "--workers", "2"], tmp_path / "dataplane.log"
    )
    with running(engine.start(), scheduler.start(), dataplane.start()):
        s = Stack(ports, engine, scheduler, dataplane, path)
        engine.wait_tcp(ports.engines[0])
        scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
        dataplane.wait_http(f"{s.url}/health")
        wait_until(lambda: len(s.workers()) == 2, what="two workers")
        # Both workers connected to the scheduler, each under its own name.
        names = [dataplane_name(lp_config.load(path).dataplane, k) for k in (0, 1)]
        wait_until(lambda: s.resyncs() == {n: (1, 1) for n in names}, what="both workers' resyncs")
        yield s


@dataclass
class OnlyWorker:
    """While in effect, every other worker is stopped: new connections go to `pid` alone."""

    stack: Stack
    pid: int

    def __enter__(self) -> None:
        self._others = [p for p in self.stack.workers() if p != self.pid]
        for pid in self._others:
            os.kill(pid, signal.SIGSTOP)

    def __exit__(self, *_: object) -> None:
        for pid in self._others:
            os.kill(pid, signal.SIGCONT)


def test_a_run_without_a_header_stays_one_run_across_the_workers(stack: Stack):
    first, second = stack.workers()
    messages: list[dict] = [{"role": "user", "content": "find three facts"}]
    run_ids = []
    for k in range(6):
        body = {
            "model": MODEL,
            "messages": messages,
            "tools": [LOOKUP],
            "tool_choice": "required",
            "max_tokens": 16,
        }
        with OnlyWorker(stack, (first, second)[k % 2]), httpx.Client(timeout=30) as client:
            reply = client.post(f"{stack.url}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        run_id = reply.headers["x-luftpause-run-id"]
        run_ids.append(run_id)
        # The worker reports the reply's tool calls a moment after the client has it; it is
        # about to be stopped, so the next turn waits until the scheduler has them (a next
        # turn on another worker within that moment starts a run of its own: README).
        wait_until(
            lambda run_id=run_id: stack.run_phase(run_id) == "paused",
            timeout_s=10,
            what="the reply's tool calls",
        )
        message = reply.json()["choices"][0]["message"]
        messages += [
            message,
            *({"role": "tool", "tool_call_id": c["id"], "content": "a fact"} for c in message["tool_calls"]),
        ]
    assert len(set(run_ids)) == 1, run_ids
    # A new conversation is a new run, whichever worker takes it.
    with httpx.Client(timeout=30) as client:
        other = client.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        )
    assert other.headers["x-luftpause-run-id"] != run_ids[0]


def test_a_worker_dying_leaves_the_other_workers_turns_counted_and_they_finish(stack: Stack):
    first, second = stack.workers()
    streamed: dict[str, object] = {}

    def long_turn() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "write at length"}], "max_tokens": 200,
                "stream": True, "ignore_eos": True}  # fmt: skip
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as reply,
        ):
            streamed["status"] = reply.status_code
            streamed["body"] = "".join(reply.iter_text())

    with OnlyWorker(stack, first):
        turn = threading.Thread(target=long_turn)
        turn.start()
        wait_until(
            lambda: stack.in_flight() == 1, timeout_s=10, what="the turn placed through the first worker"
        )
    # The engine stands still until the restart is over, so the turn is still running through it.
    stack.engine.send_signal(signal.SIGSTOP)
    second_name = dataplane_name(lp_config.load(stack.config).dataplane, 1)
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: second not in stack.workers() and len(stack.workers()) == 2, timeout_s=15,
               what="the second worker started again")  # fmt: skip
    wait_until(lambda: stack.resyncs()[second_name] == (2, 1), timeout_s=15, what="the new worker's resync")
    # Its resync said nothing of the first worker's turn: still counted on its replica.
    assert stack.in_flight() == 1
    stack.engine.send_signal(signal.SIGCONT)
    turn.join(timeout=60)
    assert streamed["status"] == 200
    assert str(streamed["body"]).rstrip().endswith("data: [DONE]")
    wait_until(lambda: stack.in_flight() == 0, timeout_s=10, what="the finished turn's slot freed")


def _paused_runs_through(stack: Stack, pid: int, run_ids: list[str]) -> None:
    """One turn of each run through worker `pid` alone, ending in a tool call: each run is paused."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "look it up"}], "tools": [LOOKUP],
            "tool_choice": "required", "max_tokens": 8}  # fmt: skip
    with OnlyWorker(stack, pid), httpx.Client(timeout=30) as client:
        for run_id in run_ids:
            reply = client.post(
                f"{stack.url}/v1/chat/completions", json=body, headers={"x-luftpause-run-id": run_id}
            )
            assert reply.status_code == 200, reply.text
    for run_id in run_ids:
        wait_until(
            lambda run_id=run_id: stack.run_phase(run_id) == "paused", timeout_s=10, what=f"{run_id} paused"
        )


def _end_runs_through(stack: Stack, pid: int, run_ids: list[str]) -> None:
    with OnlyWorker(stack, pid), httpx.Client(timeout=30) as client:
        for run_id in run_ids:
            assert client.delete(f"{stack.url}/v1/runs/{run_id}").status_code == 204


def _restart_scheduler(stack: Stack, between: Callable[[], None] = lambda: None) -> None:
    """Stops the scheduler, does `between`, starts it again and waits for both workers' resyncs."""
    stack.scheduler.stop()
    between()
    stack.scheduler.start()
    stack.scheduler.wait_http(f"http://127.0.0.1:{stack.ports.status}/status")
    names = [dataplane_name(lp_config.load(stack.config).dataplane, k) for k in (0, 1)]
    wait_until(
        lambda: stack.resyncs() == {n: (1, 1) for n in names}, timeout_s=20, what="both workers resynced"
    )


def test_a_run_ended_through_another_worker_does_not_come_back_after_a_scheduler_restart(stack: Stack):
    first, second = stack.workers()
    run_ids = [f"ended-{k}" for k in range(10)]
    _paused_runs_through(stack, first, run_ids)
    _end_runs_through(stack, second, run_ids)
    wait_until(
        lambda: all(stack.run_phase(r) is None for r in run_ids), timeout_s=10, what="the runs forgotten"
    )
    _restart_scheduler(stack)
    assert {r: stack.run_phase(r) for r in run_ids} == dict.fromkeys(run_ids)
    # An ended run's id may be used again: its new turn makes a run like any other.
    _paused_runs_through(stack, second, run_ids[:1])
    assert stack.run_phase(run_ids[0]) == "paused"


def test_a_run_ended_while_the_scheduler_was_down_does_not_come_back(stack: Stack):
    first, second = stack.workers()
    run_ids = [f"ended-offline-{k}" for k in range(10)]
    _paused_runs_through(stack, first, run_ids)
    # The DELETE lands on the other worker while the scheduler is down: no stream to tell it on.
    _restart_scheduler(stack, between=lambda: _end_runs_through(stack, second, run_ids))
    assert {r: stack.run_phase(r) for r in run_ids} == dict.fromkeys(run_ids)
    # The first worker's book let them go too: a second restart brings none of them back.
    _restart_scheduler(stack)
    assert {r: stack.run_phase(r) for r in run_ids} == dict.fromkeys(run_ids)


def test_stopping_the_dataplane_stops_every_worker(stack: Stack):
    workers = stack.workers()
    stack.dataplane.stop()
    assert stack.dataplane.proc is not None and stack.dataplane.proc.returncode == 0
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.parametrize(
    ("value", "says"),
    [("0", "greater than or equal to 1"), ("65", "less than or equal to 64"), ("two", "a valid integer")],
)
def test_a_bad_worker_count_is_refused_before_anything_starts(value: str, says: str, capsys):
    from luftpause.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["dataplane", "--workers", value])
    assert exited.value.code == 2
    assert f"argument --workers: input should be {says}" in capsys.readouterr().err
