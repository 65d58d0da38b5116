"""GET /metrics on the scheduler's status port, read as Prometheus reads it, while turns move.

A real scheduler process with one replica (an engine stand-in whose health and load the test
sets) is driven over gRPC the way a dataplane drives it: a turn placed, one held behind the
engine's queue, a reservation granted, a resync, a replica gone unhealthy. Each shows in the
families the exposition carries, and a scrape without the token is answered 401 when one is set.
The run gate's families: a replica with a configured KV pool holds one run and a second waits for
room until the first ends (a scheduler process), and the same read from states the core reached,
with how the gate counts on each replica and who said its engine keeps a host tier.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from immutables import Map
from scheduler_pool import Pool, spec
from support import Ports, Service, amend_config, running, sample, scrape, until, write_config
from test_scheduler_process import MODEL, EngineStandIn
from turns_stream import TurnsStream

from luftpause.proto import pb, rpc
from luftpause.scheduler.gate import KV_HEADROOM, REPLY_RESERVE_DEFAULT
from luftpause.scheduler.metrics import CALLERS_SHOWN, HostCounts, SchedulerCollector
from luftpause.scheduler.state import Kind, Replica, ServiceClass, State, Turn


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, EngineStandIn]]:
    tmp: Path = tmp_path_factory.mktemp("scheduler-metrics")
    engine = EngineStandIn()
    ports = Ports(engines=[engine.port])
    path = write_config(tmp, ports)
    amend_config(path, "[scheduler]\nprobe_period_s = 0.25")
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log").start()
    with running(service):
        service.wait_http(f"http://127.0.0.1:{ports.status}/status")
        yield f"http://127.0.0.1:{ports.status}", f"127.0.0.1:{ports.grpc}", engine
    engine.close()


async def test_the_families_move_as_turns_are_placed_held_reserved_and_resynced(scheduler):
    url, target, engine = scheduler
    before = scrape(url)
    assert sample(before, "luftpause_scheduler_held_turns", **{"class": "batch", "caller": "(other)"}) == 0
    # Someone else's request waits in the engine: with one turn of ours there, the next is held.
    engine.running, engine.waiting = 1, 1
    await until(
        lambda: httpx.get(f"{url}/status").json()["replicas"][0]["waiting"] == 1, what="the load read"
    )
    async with grpc.aio.insecure_channel(target) as channel, TurnsStream(channel) as turns:
        first = await turns.admit(
            pb.AdmitRequest(turn_id="m-t1", run_id="m-r1", model=MODEL, caller="team-a")
        )
        assert first.outcome == pb.AdmitReply.PLACED
        await turns.report(pb.TurnEvent(turn_id="m-t1", run_id="m-r1", started=pb.TurnStarted(streamed=True)))
        # m-t1 now waits in the engine's queue too, behind the other request: a probe from here
        # on reads both (reading only one would say that one was ours, and make room).
        engine.running, engine.waiting = 1, 2
        await until(
            lambda: httpx.get(f"{url}/status").json()["replicas"][0]["waiting"] == 2, what="both read"
        )
        second = await turns.admit_later(
            pb.AdmitRequest(
                turn_id="m-t2", run_id="m-r2", model=MODEL, caller="team-b", service_class=pb.BATCH
            )
        )
        await until(lambda: httpx.get(f"{url}/status").json()["held"]["count"] == 1, what="m-t2 held")
        held = scrape(url)
        assert sample(held, "luftpause_scheduler_held_turns", **{"class": "batch", "caller": "team-b"}) == 1
        assert sample(held, "luftpause_scheduler_held_oldest_wait_seconds", **{"class": "batch"}) > 0
        assert sample(held, "luftpause_scheduler_held_oldest_wait_seconds", **{"class": "interactive"}) == 0
        assert sample(held, "luftpause_scheduler_in_flight_turns", replica="fake-a") == 1
        assert sample(held, "luftpause_scheduler_admission_limit", replica="fake-a") == 1
        assert (
            sample(held, "luftpause_scheduler_runs", **{"class": "interactive", "phase": "generating"}) == 1
        )
        placed = sample(held, "luftpause_scheduler_decisions_total", action="place")
        assert placed == sample(before, "luftpause_scheduler_decisions_total", action="place") + 1

        # The engine's queue empties and our first turn's first token comes: the held turn goes.
        engine.running, engine.waiting = 1, 0
        await turns.report(pb.TurnEvent(turn_id="m-t1", run_id="m-r1", first_token=pb.FirstToken()))
        assert (await second).outcome == pb.AdmitReply.PLACED
        after = scrape(url)
        assert sample(after, "luftpause_scheduler_held_turns", **{"class": "batch", "caller": "(other)"}) == 0
        assert (
            "luftpause_scheduler_held_turns",
            frozenset({("class", "batch"), ("caller", "team-b")}),
        ) not in after
        assert sample(after, "luftpause_scheduler_decisions_total", action="place") == placed + 1
        assert sample(after, "luftpause_scheduler_in_flight_turns", replica="fake-a") == 2
        assert sample(after, "luftpause_scheduler_dataplane_streams") == 1
        for turn_id, run_id in (("m-t1", "m-r1"), ("m-t2", "m-r2")):
            await turns.report(
                pb.TurnEvent(turn_id=turn_id, run_id=run_id, completed=pb.TurnCompleted(finish_reason="stop"))
            )

    # A dataplane that wants reservations gets room set aside where its turns went.
    engine.running, engine.waiting = 0, 0
    async with grpc.aio.insecure_channel(target) as channel, TurnsStream(channel) as turns:
        await turns._write(pb.DataplaneItem(want_reservations=pb.WantReservations()))
        await turns.admit(pb.AdmitRequest(turn_id="m-t3", run_id="m-r3", model=MODEL))
        await until(
            lambda: sample(scrape(url), "luftpause_scheduler_reservations", replica="fake-a") >= 1,
            what="a reservation on fake-a in /metrics",
        )
        reply = await rpc.SchedulerStub(channel).Resync(iter([pb.ResyncRequest()]))
        assert reply.runs == 0
    assert (
        sample(scrape(url), "luftpause_scheduler_resyncs_total")
        == sample(before, "luftpause_scheduler_resyncs_total") + 1
    )

    # The replica stops answering its health check: each probe that finds it so is counted.
    failures = sample(scrape(url), "luftpause_scheduler_probe_failures_total", replica="fake-a")
    engine.healthy = False
    try:
        await until(
            lambda: (
                sample(scrape(url), "luftpause_scheduler_probe_failures_total", replica="fake-a")
                >= failures + 2
            ),
            what="probe failures counted",
        )
        down = scrape(url)
        assert sample(down, "luftpause_scheduler_replica_healthy", replica="fake-a") == 0
    finally:
        engine.healthy = True


def test_an_uncapped_replica_reports_an_infinite_limit_and_callers_beyond_the_cap_are_summed():
    replica = Replica("r", "http://r", Kind.GENERATIVE, frozenset({"m"}), lookahead=0)
    turns = {
        f"t{i}": Turn(
            f"t{i}", f"run{i}", ServiceClass.INTERACTIVE, f"caller-{i % 15}", "m", Kind.GENERATIVE, 0.0, i
        )
        for i in range(30)
    }
    state = State(replicas=Map({"r": replica}), order=("r",), turns=Map(turns))
    families = {
        m.name: m for m in SchedulerCollector(lambda: state, lambda: 5.0, HostCounts(), lambda: 0).collect()
    }
    limit = families["luftpause_scheduler_admission_limit"].samples[0]
    assert math.isinf(limit.value)
    held = {s.labels["caller"]: s.value for s in families["luftpause_scheduler_held_turns"].samples
            if s.labels["class"] == "interactive"}  # fmt: skip
    assert len(held) == CALLERS_SHOWN + 1, "the callers shown and one for the rest"
    assert sum(held.values()) == 30 and held["(other)"] == 30 - 2 * CALLERS_SHOWN
    assert families["luftpause_scheduler_held_oldest_wait_seconds"].samples[0].value == 5.0


def test_with_a_token_a_scrape_without_it_is_answered_401(tmp_path: Path):
    ports = Ports(engines=[])
    path = write_config(tmp_path, ports)
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    service.start(env={"LUFTPAUSE_TOKEN": "s3cret"})
    with running(service):
        url = f"http://127.0.0.1:{ports.status}"
        service.wait_http(f"{url}/")
        refused = httpx.get(f"{url}/metrics", timeout=5)
        assert refused.status_code == 401
        assert "LUFTPAUSE_TOKEN" in refused.json()["error"]["message"]
        assert (
            sample(
                scrape(url, headers={"authorization": "Bearer s3cret"}), "luftpause_scheduler_resyncs_total"
            )
            == 0
        )


def _families(state: State) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """Each family's samples by label set, as one scrape of `state` gives them."""
    collector = SchedulerCollector(lambda: state, lambda: 0.0, HostCounts(), lambda: 0)
    return {m.name: {frozenset(s.labels.items()): s.value for s in m.samples} for m in collector.collect()}


def _by(
    families: dict[str, dict[frozenset[tuple[str, str]], float]], name: str, label: str
) -> dict[str, float]:
    """One family's values by its one label."""
    return {dict(labels)[label]: v for labels, v in families[name].items()}


def _by_replica_and(
    families: dict[str, dict[frozenset[tuple[str, str]], float]], name: str, label: str
) -> dict[str, tuple[str, float]]:
    """One family's (value of `label`, sample value) by replica."""
    return {dict(labels)["replica"]: (dict(labels)[label], v) for labels, v in families[name].items()}


def test_the_gate_families_show_each_pool_the_runs_it_holds_and_the_runs_waiting_for_room():
    # a's pool holds r1 and r2 (4000 tokens each with their reply reserves), not a third; b's is unknown.
    pool = Pool(spec("a", kv_tokens=10000, gate_min_runs=1), spec("b"))
    pool.probe("b", healthy=False)
    pool.arrive("t1", run_id="r1", request_bytes=0, max_tokens=4000)
    pool.arrive("t2", run_id="r2", request_bytes=0, max_tokens=4000)
    pool.first_token("t1", "t2")  # a's engine started both: only the gate holds the next back
    pool.arrive("t3", run_id="r3", request_bytes=0, max_tokens=4000)
    pool.arrive("t4", run_id="r4", cls="batch", request_bytes=0, max_tokens=4000)
    assert pool.held() == ["t3", "t4"]
    families = _families(pool.state)
    assert _by(families, "luftpause_scheduler_replica_kv_tokens", "replica") == {"a": 10000}, "b's is unknown"
    assert _by(families, "luftpause_scheduler_replica_held_kv_tokens", "replica") == {"a": 8000, "b": 0}
    assert _by(families, "luftpause_scheduler_replica_held_runs", "replica") == {"a": 2, "b": 0}
    waiting = _by(families, "luftpause_scheduler_runs_waiting_for_room", "class")
    assert waiting == {"interactive": 1, "batch": 1}
    # r1 ends: a holds r2 alone, and r3 (interactive, first) takes the room.
    pool.complete("t1")
    families = _families(pool.state)
    assert _by(families, "luftpause_scheduler_runs_waiting_for_room", "class") == {
        "interactive": 0,
        "batch": 1,
    }
    assert _by(families, "luftpause_scheduler_replica_held_runs", "replica") == {"a": 2, "b": 0}


def test_each_replica_shows_how_the_gate_counts_there_and_who_said_it_keeps_a_host_tier():
    pool = Pool(
        spec("tokens", kv_tokens=10000),
        spec("slots", kv_slots=4),
        spec("configured-tier", kv_tokens=10000, host_cache=True, host_cache_configured=True),
        spec("said-tier"),
        spec("unknown"),
    )
    pool.probe("said-tier", kv_tokens=10000, host_cache=True)  # the engine says it has a tier
    pool.probe("unknown", host_cache=False)  # says no tier, but nothing of its pool
    families = _families(pool.state)
    assert _by_replica_and(families, "luftpause_scheduler_replica_run_gate", "mode") == {
        "tokens": ("tokens", 1.0),
        "slots": ("slots", 1.0),
        "configured-tier": ("off: host cache", 1.0),
        "said-tier": ("off: host cache", 1.0),
        "unknown": ("off: pool unknown", 1.0),
    }
    assert _by_replica_and(families, "luftpause_scheduler_replica_host_cache", "source") == {
        "tokens": ("default", 0.0),
        "slots": ("default", 0.0),
        "configured-tier": ("config", 1.0),
        "said-tier": ("engine", 1.0),
        "unknown": ("engine", 0.0),
    }


def test_each_replicas_engine_prompt_cache_counters_show_where_its_page_has_them():
    pool = Pool(spec("a"), spec("b"))
    pool.probe("a", running=0, waiting=0, prompt_tokens=12000, cached_tokens=9000)
    pool.probe("b", running=0, waiting=0)  # an engine whose page has no such counters
    families = _families(pool.state)
    prompt = _by(families, "luftpause_scheduler_replica_prompt_tokens", "replica")
    cached = _by(families, "luftpause_scheduler_replica_cached_prompt_tokens", "replica")
    assert (prompt, cached) == ({"a": 12000}, {"a": 9000})
    assert cached["a"] / prompt["a"] == 0.75  # the share /status shows


async def test_a_scrape_shows_the_pool_configured_the_run_it_holds_and_the_one_waiting_for_room(
    tmp_path: Path,
):
    engine = EngineStandIn()
    ports = Ports(engines=[engine.port])
    # Room for one run of a default reply reserve (4096 tokens) beside none other.
    kv_tokens = int(1.5 * REPLY_RESERVE_DEFAULT / (1 - KV_HEADROOM))
    path = write_config(tmp_path, ports, replica_extra=f"kv_tokens = {kv_tokens}\ngate_min_runs = 1")
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log").start()
    url = f"http://127.0.0.1:{ports.status}"
    try:
        with running(service):
            service.wait_http(f"{url}/status")
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel,
                TurnsStream(channel) as turns,
            ):
                first = await turns.admit(pb.AdmitRequest(turn_id="g-t1", run_id="g-r1", model=MODEL))
                assert first.outcome == pb.AdmitReply.PLACED
                second = await turns.admit_later(pb.AdmitRequest(turn_id="g-t2", run_id="g-r2", model=MODEL))
                await until(lambda: httpx.get(f"{url}/status").json()["held"]["count"] == 1, what="g-t2 held")
                held = scrape(url)
                assert sample(held, "luftpause_scheduler_replica_kv_tokens", replica="fake-a") == kv_tokens
                assert sample(held, "luftpause_scheduler_replica_held_kv_tokens", replica="fake-a") == (
                    REPLY_RESERVE_DEFAULT
                )
                assert sample(held, "luftpause_scheduler_replica_held_runs", replica="fake-a") == 1
                assert (
                    sample(held, "luftpause_scheduler_replica_run_gate", replica="fake-a", mode="tokens") == 1
                )
                assert (
                    sample(held, "luftpause_scheduler_runs_waiting_for_room", **{"class": "interactive"}) == 1
                )
                assert sample(held, "luftpause_scheduler_runs_waiting_for_room", **{"class": "batch"}) == 0
                # g-r1's turn ends with no tool call: a holds nothing, and g-r2 takes the room.
                await turns.report(
                    pb.TurnEvent(
                        turn_id="g-t1", run_id="g-r1", completed=pb.TurnCompleted(finish_reason="stop")
                    )
                )
                assert (await second).outcome == pb.AdmitReply.PLACED
                after = scrape(url)
                assert (
                    sample(after, "luftpause_scheduler_runs_waiting_for_room", **{"class": "interactive"})
                    == 0
                )
                assert sample(after, "luftpause_scheduler_replica_held_runs", replica="fake-a") == 1
    finally:
        engine.close()
