"""The peer arms: both complete runs of both classes, the gateway holds and orders turns as flow
control does, and the engine starts an interactive turn that the router marked before queued batch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from luftpause.bench.sim import arms as sim_arms
from luftpause.bench.sim import cli, peers
from luftpause.bench.sim import run as sim_run
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.run import simulate
from luftpause.bench.sim.scenarios import SCENARIOS
from luftpause.bench.sim.turns import SimTurn
from luftpause.fake_engine.engine import ModelRequest
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.prefix_cache import Block
from luftpause.fake_engine.replies import Reply
from luftpause.scheduler.state import ServiceClass

# The flood, scaled down: 14 agents on two replicas whose KV pools hold three turns each.
SMALL_FLOOD = replace(SCENARIOS["flood"], batch_agents=12, interactive_agents=2, warmup_s=20, window_s=60)
SMALL_POOL = EngineParams(kv_pool_tokens=8192)


def turn(name: str, cls: ServiceClass, caller: str, done: list[str], prompt: int = 1000) -> SimTurn:
    """A one-turn run whose prompt is its own (nothing cached) and whose reply is 8 tokens."""
    request = ModelRequest(name, (Block(name.encode(), prompt),), completion_tokens=8, max_tokens=256)
    return SimTurn(
        turn_id=name,
        run_id=name,
        service_class=cls,
        caller=caller,
        index=0,
        request=request,
        reply=Reply(pieces=("x",) * 8, finish_reason="stop"),
        on_done=lambda t: done.append(t.turn_id),
    )


@pytest.mark.parametrize("arm", ["router-plus-engine-priority", "flow-control"])
def test_each_peer_is_an_arm_and_completes_runs_of_both_classes(arm: str) -> None:
    assert arm in sim_arms.ARMS
    result = simulate(SMALL_FLOOD, arm, seed=2, params=SMALL_POOL)
    assert result.interactive_runs_per_min > 0 and result.batch_runs_per_min > 0


def test_the_cli_runs_the_peers_by_name_and_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["routing", "--arms", "flow-control,router-plus-engine-priority", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "| flow-control |" in out and "| router-plus-engine-priority |" in out
    # Without --arms every arm runs (here on a few seconds of two agents: only the names matter).
    ran: list[str] = []
    tiny = replace(SMALL_FLOOD, batch_agents=1, interactive_agents=1, warmup_s=1, window_s=5)

    def named(scenario, arm: str, seed: int, params=None) -> sim_run.ArmResult:
        ran.append(arm)
        return simulate(tiny, arm, seed, params)

    monkeypatch.setattr(cli, "simulate", named)
    assert cli.main(["routing", "--no-record"]) == 0
    assert ran == list(sim_arms.ARMS)
    assert {"flow-control", "router-plus-engine-priority"} <= set(ran)


def test_the_simulator_runs_every_replica_with_priority_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineParams] = []

    class Recording(SimReplica):
        def __init__(self, name: str, params: EngineParams, clock: VirtualClock) -> None:
            seen.append(params)
            super().__init__(name, params, clock)

    monkeypatch.setattr(sim_run, "SimReplica", Recording)
    quiet = replace(SMALL_FLOOD, batch_agents=1, interactive_agents=1, window_s=10)
    simulate(quiet, "router-round-robin", seed=1, params=SMALL_POOL)
    assert len(seen) == 2
    assert all(p.priority_scheduling and p.kv_pool_tokens == 8192 for p in seen)


@pytest.mark.parametrize(
    ("arm", "interactive_first"), [("router-plus-engine-priority", True), ("sglang-cache-aware", False)]
)
def test_a_marked_interactive_turn_queued_behind_batch_is_started_first(
    arm: str, interactive_first: bool
) -> None:
    # One replica whose pool holds three of these turns at once (each reserves 1000 + 256 of
    # 4096). batch0 starts at once; batch1-5 and then the interactive turn queue behind it.
    clock = VirtualClock()
    replica = SimReplica("fake-a", EngineParams(kv_pool_tokens=4096, priority_scheduling=True), clock)
    chosen = sim_arms.ARMS[arm]([replica], clock)
    done: list[str] = []
    turns = {f"batch{i}": turn(f"batch{i}", ServiceClass.BATCH, "flood", done) for i in range(6)}
    turns["interactive"] = turn("interactive", ServiceClass.INTERACTIVE, "user", done)
    for t in turns.values():
        chosen.send(t)
    assert replica.load().running == 1 and replica.load().waiting == 6
    clock.run_until(60)
    assert sorted(done) == sorted(turns)
    interactive = turns["interactive"].first_token_at
    queued_batch = [turns[f"batch{i}"].first_token_at for i in range(1, 6)]
    assert interactive is not None and None not in queued_batch
    if interactive_first:
        # It starts in the first pass that admits anything from the queue, ahead of all five.
        assert interactive <= min(queued_batch)
    else:
        assert interactive > max(queued_batch)


def test_the_gateway_sends_held_turns_by_priority_then_round_robin_across_callers() -> None:
    order: list[str] = []

    class Recorded(peers.FlowControl):
        def _dispatch(self, turn: SimTurn, replica: str, on_first_token=None) -> None:
            order.append(turn.turn_id)
            super()._dispatch(turn, replica, on_first_token)

    clock = VirtualClock()
    gateway = Recorded([SimReplica("fake-a", EngineParams(priority_scheduling=True), clock)], clock)
    done: list[str] = []
    # Before the first scrape the gateway has no reading, so every turn is held.
    for name, cls, caller in [
        ("a1", ServiceClass.BATCH, "team-a"),
        ("a2", ServiceClass.BATCH, "team-a"),
        ("a3", ServiceClass.BATCH, "team-a"),
        ("b1", ServiceClass.BATCH, "team-b"),
        ("i1", ServiceClass.INTERACTIVE, "user"),
        ("b2", ServiceClass.BATCH, "team-b"),
    ]:
        gateway.send(turn(name, cls, caller, done))
    assert order == [] and gateway.held == 6
    clock.run_until(0.0)  # the first scrape: an empty replica, room for all
    assert order == ["i1", "a1", "b1", "a2", "b2", "a3"]
    assert gateway.held == 0


def test_flow_control_sends_only_to_replicas_that_read_unsaturated_and_holds_nothing_while_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks = {"dispatched": 0, "scrapes_holding": 0, "worst_excess": 0}
    since_scrape: dict[str, int] = {}

    class Checked(peers.FlowControl):
        def _scrape(self) -> None:
            since_scrape.clear()
            super()._scrape()
            # Work conservation: after a scrape's dispatch, turns are held only if no replica has room.
            if self.held:
                checks["scrapes_holding"] += 1
                assert not any(self.has_room(name) for name in self.order)

        def _dispatch(self, turn: SimTurn, replica: str, on_first_token=None) -> None:
            # The replica's last reading said it had room...
            reading = self.scraped[replica]
            assert reading.waiting < peers.QUEUE_DEPTH_THRESHOLD
            assert reading.token_usage < peers.KV_CACHE_UTIL_THRESHOLD
            super()._dispatch(turn, replica, on_first_token)
            checks["dispatched"] += 1
            since_scrape[replica] = since_scrape.get(replica, 0) + 1
            # ...so its engine queue is at most under the threshold plus what went in since.
            waiting = self.replicas[replica].load().waiting
            assert waiting <= peers.QUEUE_DEPTH_THRESHOLD - 1 + since_scrape[replica]
            checks["worst_excess"] = max(checks["worst_excess"], waiting - peers.QUEUE_DEPTH_THRESHOLD + 1)

    monkeypatch.setitem(sim_arms.ARMS, "flow-control", Checked)
    result = simulate(SMALL_FLOOD, "flow-control", seed=1, params=SMALL_POOL)
    assert checks["dispatched"] > 0 and result.runs > 0
    # The flood saturates both replicas: the gateway does hold turns, and lets bursts in.
    assert checks["scrapes_holding"] > 0
    assert checks["worst_excess"] > 0
