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


@pytest.mark.parametrize("arm", sorted(peers.PEERS))
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


def test_the_preempting_peer_leaves_batch_unmarked_on_engines_that_preempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[EngineParams] = []
    sent: list[tuple[ServiceClass, int]] = []

    class Recording(SimReplica):
        def __init__(self, name: str, params: EngineParams, clock: VirtualClock) -> None:
            seen.append(params)
            super().__init__(name, params, clock)

        def submit(self, request, on_first_token, on_done) -> None:
            sent.append(
                (
                    ServiceClass.INTERACTIVE if "interactive" in request.request_id else ServiceClass.BATCH,
                    request.priority,
                )
            )
            super().submit(request, on_first_token, on_done)

    monkeypatch.setattr(sim_run, "SimReplica", Recording)
    result = simulate(SMALL_FLOOD, "router-plus-engine-priority-preempt", seed=2, params=SMALL_POOL)
    assert seen and all(
        p.priority_scheduling and p.priority_preemption and p.preemption_threshold == 10 for p in seen
    )
    assert set(sent) == {(ServiceClass.INTERACTIVE, 1), (ServiceClass.BATCH, peers.SGLANG_UNSET_PRIORITY)}
    # The flood fills the engines: interactive turns preempt running batch ones, which still finish.
    assert result.preemptions > 0
    assert result.interactive_runs_per_min > 0 and result.batch_runs_per_min > 0
    # The peer it varies does not preempt: a gap of 1 is under the threshold, and its engines do not.
    assert simulate(SMALL_FLOOD, "router-plus-engine-priority", seed=2, params=SMALL_POOL).preemptions == 0


def test_the_fixed_run_gate_caps_active_runs_per_replica_and_lets_interactive_in_first() -> None:
    clock = VirtualClock()
    replicas = [SimReplica(n, EngineParams(priority_scheduling=True), clock) for n in ("fake-a", "fake-b")]
    gate = peers.RunGateFixed(replicas, clock)
    gate.cap = 2
    done: list[str] = []
    first = [turn(f"b{i}", ServiceClass.BATCH, "flood", done) for i in range(4)]
    for t in first:
        gate.send(t)
    # New runs go to the replica with the fewest active runs, the first on a tie.
    assert [t.replica for t in first] == ["fake-a", "fake-b", "fake-a", "fake-b"]
    assert dict(gate.active) == {"fake-a": 2, "fake-b": 2}
    late_batch = turn("b4", ServiceClass.BATCH, "flood", done)
    late_interactive = turn("i0", ServiceClass.INTERACTIVE, "user", done)
    gate.send(late_batch)
    gate.send(late_interactive)
    assert gate.held == 2 and late_interactive.replica is None
    # A placed run's next turn goes straight to its replica, whatever the cap.
    again = turn("b1-t2", ServiceClass.BATCH, "flood", done)
    again.run_id = "b1"
    gate.send(again)
    assert again.replica == "fake-b" and again.request.priority == 0
    clock.run_until(30)
    assert gate.held == 2  # turns ending do not end runs
    gate.run_ended("b1")
    assert late_interactive.replica == "fake-b" and late_interactive.request.priority == 1
    assert late_batch.replica is None and gate.held == 1
    gate.run_ended("b0")
    assert late_batch.replica == "fake-a" and gate.held == 0
    assert max(gate.active.values()) <= 2


def test_the_fixed_run_gate_never_has_more_than_its_cap_active_in_a_flood(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worst: list[int] = []

    class Checked(peers.RunGateFixed):
        def _dispatch(self, turn: SimTurn, replica: str, on_first_token=None) -> None:
            super()._dispatch(turn, replica, on_first_token)
            worst.append(max(self.active.values()))

    monkeypatch.setitem(sim_arms.ARMS, "run-gate-fixed", Checked)
    # The whole flood: 52 agents on two replicas, so the cap binds.
    result = simulate(replace(SCENARIOS["flood"], warmup_s=20, window_s=60), "run-gate-fixed", seed=1)
    assert result.interactive_runs_per_min > 0 and result.batch_runs_per_min > 0
    assert max(worst) == peers.RUN_GATE_FIXED_CAP
