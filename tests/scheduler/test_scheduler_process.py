"""The scheduler as a real process, driven over gRPC the way the dataplane drives it, watched over /status.

One replica stands in front of the scheduler: a tiny engine stand-in in this test process whose
health and load the tests set (so that "the engine is queueing" is a fact, not a race), or the
project's fake engine where its own metrics are what is being checked.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from support import Ports, Service, amend_config, free_port, running, until, write_config
from turns_stream import TurnsStream

from luftpause.proto import pb, rpc

MODEL = "fake-llama"


@dataclass
class EngineStandIn:
    """Answers /health and /metrics (SGLang names) with whatever the test sets; while
    `answers_metrics` is False, /metrics answers 503, so no probe gives a reading and the
    scheduler goes by the last one."""

    port: int = field(default_factory=free_port)
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    answers_metrics: bool = True

    def __post_init__(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path == "/health":
                    status, body = (200, b"ok") if engine.healthy else (503, b"down")
                elif self.path == "/metrics" and not engine.answers_metrics:
                    status, body = 503, b"not now"
                elif self.path == "/metrics":
                    status = 200
                    body = (
                        f'sglang:num_running_reqs{{model_name="{MODEL}"}} {engine.running}\n'
                        f'sglang:num_queue_reqs{{model_name="{MODEL}"}} {engine.waiting}\n'
                    ).encode()
                else:
                    status, body = 404, b""
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Scheduler:
    service: Service
    ports: Ports
    engine: EngineStandIn | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.status}"


def _start(tmp: Path, ports: Ports, name: str = "scheduler") -> Service:
    path = write_config(tmp, ports)
    # Probing four times a second instead of every 2 s keeps the waits for a probe short.
    amend_config(path, "[scheduler]\nprobe_period_s = 0.25")
    service = Service(name, ["scheduler", "--config", str(path)], tmp / f"{name}.log").start()
    service.wait_http(f"http://127.0.0.1:{ports.status}/status")
    return service


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    engine = EngineStandIn()
    ports = Ports(engines=[engine.port])
    service = _start(tmp_path_factory.mktemp("scheduler"), ports)
    with running(service):
        yield Scheduler(service, ports, engine)
    engine.close()


async def _status(s: Scheduler) -> dict:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{s.status_url}/status", timeout=5)).json()


async def _engine_load(s: Scheduler, running: int, waiting: int) -> None:
    """Sets the stand-in's load and waits until the scheduler's probe has read it."""
    assert s.engine is not None
    s.engine.running, s.engine.waiting = running, waiting

    async def seen() -> bool:
        replica = (await _status(s))["replicas"][0]
        return replica["running"] == running and replica["waiting"] == waiting

    await until(seen, what=f"the scheduler to read running={running} waiting={waiting}", interval_s=0.05)


def _admit(turn_id: str, run_id: str, model: str = MODEL, **kw) -> pb.AdmitRequest:
    return pb.AdmitRequest(turn_id=turn_id, run_id=run_id, model=model, caller="tests", **kw)


def _completed(turn_id: str, run_id: str, tool_calls: bool = False) -> pb.TurnEvent:
    completed = pb.TurnCompleted(
        finish_reason="tool_calls" if tool_calls else "stop",
        prompt_tokens=10,
        completion_tokens=5,
        tool_call_ids=["call_1"] if tool_calls else [],
    )
    return pb.TurnEvent(turn_id=turn_id, run_id=run_id, completed=completed)


async def test_admit_places_a_turn_and_the_run_shows_in_status(scheduler: Scheduler):
    await _engine_load(scheduler, running=0, waiting=0)
    async with grpc.aio.insecure_channel(scheduler.target) as channel, TurnsStream(channel) as turns:
        reply = await turns.admit(_admit("p-t1", "p-r1"))
        assert reply.outcome == pb.AdmitReply.PLACED
        assert (reply.replica, reply.url) == ("fake-a", f"http://127.0.0.1:{scheduler.ports.engines[0]}")

        async with httpx.AsyncClient() as client:
            run = (await client.get(f"{scheduler.status_url}/status/runs/p-r1")).json()
            assert run["replica"] == "fake-a"
            assert run["phase"] == "generating"
            assert run["class"] == "interactive"
            assert run["caller"] == "tests"

            await turns.report(_completed("p-t1", "p-r1", tool_calls=True))

            async def paused() -> bool:
                return (await client.get(f"{scheduler.status_url}/status/runs/p-r1")).json()[
                    "phase"
                ] == "paused"

            await until(paused, what="run p-r1 to show as paused on its tool", interval_s=0.05)

            await turns.report(pb.TurnEvent(run_id="p-r1", run_ended=pb.RunEnded()))

            async def forgotten() -> bool:
                return (await client.get(f"{scheduler.status_url}/status/runs/p-r1")).status_code == 404

            await until(forgotten, what="run p-r1 to be forgotten after run_ended", interval_s=0.05)
            body = (await client.get(f"{scheduler.status_url}/status/runs/p-r1")).json()
            assert "p-r1" in body["error"]["message"]


async def test_unknown_model_is_refused_at_once(scheduler: Scheduler):
    async with grpc.aio.insecure_channel(scheduler.target) as channel, TurnsStream(channel) as turns:
        reply = await turns.admit(_admit("u-t1", "u-r1", model="gpt-nope"), within_s=5)
    assert reply.outcome == pb.AdmitReply.UNKNOWN_MODEL
    assert reply.message == "no Generative replica serves model 'gpt-nope'"


async def test_a_turn_is_held_while_the_engines_queue_is_full_and_placed_when_ours_starts(
    scheduler: Scheduler,
):
    # Someone else's request waits in the engine: with our first turn behind it, the engine's
    # queue holds the lookahead's worth (2), so the next turn waits here.
    await _engine_load(scheduler, running=1, waiting=1)
    # The stand-in's queue does not grow when our turn is sent, as a real engine's would: a probe
    # now would read one waiting, which may be our turn, and give its room back. So none reads
    # until our turn has started; the scheduler goes by the reading above.
    assert scheduler.engine is not None
    scheduler.engine.answers_metrics = False
    try:
        await _held_until_ours_starts(scheduler)
    finally:
        scheduler.engine.answers_metrics = True
    await _engine_load(scheduler, running=0, waiting=0)


async def _held_until_ours_starts(scheduler: Scheduler) -> None:
    async with grpc.aio.insecure_channel(scheduler.target) as channel, TurnsStream(channel) as turns:
        first = await turns.admit(_admit("h-t1", "h-r1"))
        assert first.outcome == pb.AdmitReply.PLACED
        await turns.report(pb.TurnEvent(turn_id="h-t1", run_id="h-r1", started=pb.TurnStarted(streamed=True)))

        second = await turns.admit_later(_admit("h-t2", "h-r2", service_class=pb.BATCH))

        async def held() -> dict:
            doc = await _status(scheduler)
            return doc if doc["held"]["count"] == 1 else {}

        doc = await until(held, what="the second turn to be held", interval_s=0.05)
        assert doc["held"]["by_class"]["batch"]["count"] == 1
        assert doc["held"]["by_caller"]["tests"]["count"] == 1
        replica = doc["replicas"][0]
        assert (replica["in_flight"], replica["waiting_ours"], replica["others_waiting"]) == (1, 1, 1)
        assert (replica["lookahead"], replica["limit"]) == (2, 1)
        assert not second.done()

        # Our turn's first token: the engine started it, and whatever queued ahead of it too.
        await turns.report(pb.TurnEvent(turn_id="h-t1", run_id="h-r1", first_token=pb.FirstToken()))
        reply = await asyncio.wait_for(second, 10)
        assert reply.outcome == pb.AdmitReply.PLACED
        assert reply.replica == "fake-a"
        assert reply.held_ms > 0

        await turns.report(_completed("h-t1", "h-r1"), _completed("h-t2", "h-r2"))


async def _held_count(scheduler: Scheduler, n: int, what: str) -> None:
    async def check() -> bool:
        return (await _status(scheduler))["held"]["count"] == n

    await until(check, what=what, interval_s=0.05)


async def test_an_abandoned_held_turn_leaves_the_held_queue(scheduler: Scheduler):
    # Two requests of others wait in the engine: the lookahead (2) is used up, so ours is held
    # however often the engine is probed meanwhile.
    await _engine_load(scheduler, running=1, waiting=2)
    async with grpc.aio.insecure_channel(scheduler.target) as channel, TurnsStream(channel) as turns:
        held = await turns.admit_later(_admit("c-t1", "c-r1"))
        await _held_count(scheduler, 1, "the turn to be held")
        await turns.abandon("c-t1", "c-r1")
        await _held_count(scheduler, 0, "the abandoned turn to leave the held queue")

        # Room comes back, and the abandoned turn does not take it: it never runs.
        await _engine_load(scheduler, running=0, waiting=0)
        assert (await _status(scheduler))["replicas"][0]["in_flight"] == 0
        assert not held.done(), "an abandoned turn gets no placement"


async def test_a_stream_that_ends_abandons_the_turns_it_held(scheduler: Scheduler):
    await _engine_load(scheduler, running=1, waiting=2)
    async with grpc.aio.insecure_channel(scheduler.target) as channel:
        async with TurnsStream(channel) as turns:
            await turns.admit_later(_admit("e-t1", "e-r1"))
            await _held_count(scheduler, 1, "the turn to be held")
        # The dataplane went away: nobody waits for the held turn any more.
        await _held_count(scheduler, 0, "the held turn of the ended stream to leave the queue")
    await _engine_load(scheduler, running=0, waiting=0)
    assert (await _status(scheduler))["replicas"][0]["in_flight"] == 0


async def test_resync_restores_the_dataplanes_runs_and_turns(scheduler: Scheduler):
    async with grpc.aio.insecure_channel(scheduler.target) as channel:
        stub = rpc.SchedulerStub(channel)
        reply = await stub.Resync(
            iter(
                [
                    pb.ResyncRequest(
                        runs=[
                            pb.RunState(
                                run_id="s-r1", replica="fake-a", phase=pb.PAUSED, caller="dp", idle_s=3.0
                            )
                        ]
                    ),
                    pb.ResyncRequest(
                        turns=[pb.InFlightTurn(turn_id="s-t9", run_id="s-r9", replica="fake-a", model=MODEL)]
                    ),
                ]
            ),
            timeout=5,
        )
        assert (reply.runs, reply.turns) == (1, 1)
        async with httpx.AsyncClient() as client:
            run = (await client.get(f"{scheduler.status_url}/status/runs/s-r1")).json()
        assert (run["replica"], run["phase"], run["caller"]) == ("fake-a", "paused", "dp")
        assert (await _status(scheduler))["replicas"][0]["in_flight"] == 1
        async with TurnsStream(channel) as turns:
            await turns.report(_completed("s-t9", "s-r9"))
        # An empty resync, as after a dataplane restart with nothing in flight, clears the slate.
        await stub.Resync(iter([pb.ResyncRequest()]), timeout=5)
        assert (await _status(scheduler))["runs"]["count"] == 0


async def test_prober_reads_the_fake_engine_and_sigterm_stops_the_scheduler(tmp_path: Path):
    ports = Ports(engines=[free_port()])
    engine = Service(
        "fake-engine",
        ["fake-engine", "--name", "fake-a", "--port", str(ports.engines[0])],
        tmp_path / "engine.log",
    ).start()
    with running(engine):
        engine.wait_http(f"http://127.0.0.1:{ports.engines[0]}/health")
        service = _start(tmp_path, ports)
        with running(service):
            s = Scheduler(service, ports)

            async def probed() -> dict:
                replica = (await _status(s))["replicas"][0]
                return replica if replica["probed"] and replica["running"] is not None else {}

            replica = await until(probed, what="the first probe of the fake engine", interval_s=0.05)
            assert replica["healthy"] is True
            assert (replica["waiting"], replica["waiting_ours"], replica["limit"]) == (0, 0, 2)
            async with grpc.aio.insecure_channel(s.target) as channel, TurnsStream(channel) as turns:
                reply = await turns.admit(_admit("f-t1", "f-r1"))
            assert reply.replica == "fake-a"

            service.kill(signal.SIGTERM)
            assert service.proc is not None and service.proc.returncode == 0
            out = service.output()
            assert f"gRPC on 127.0.0.1:{ports.grpc}, status on http://127.0.0.1:{ports.status}/" in out
            assert "Traceback" not in out
