"""The scheduler core's promises, checked on random event sequences (hypothesis, stateful).

A small pool (two engines, an uncapped hosted endpoint, a router in front of the two engines,
and a single-pass classifier) is driven by random arrivals, completions, failures, abandons,
progress reports, probes, clock jumps, run ends, duplicate reports, retried admissions and
scheduler restarts with a resync. After every event the checks below hold; at the end every
open turn is closed and the counts must return to zero, and replaying the log must reproduce
every action and the final state.

Each run keeps one class and one caller, as a dataplane sees it (the class is a header of the
run's requests), which is what makes the per-placement checks below exact from the state after
each decision: within one decision the drain places interactive turns before batch ones.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from luftpause.scheduler.actions import Action, Place, Refuse, TurnExpired
from luftpause.scheduler.core import RUN_IDLE_EXPIRY_S, TURN_TIMEOUT_S, decide, replay
from luftpause.scheduler.events import (
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    Resynced,
    ResyncedRun,
    ResyncedTurn,
    RunEnded,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, Phase, ServiceClass, State, Turn, TurnStatus

POOL = PoolConfigured(
    (
        ReplicaSpec("a", "http://a", Kind.GENERATIVE, ("m", "n")),
        ReplicaSpec("b", "http://b", Kind.GENERATIVE, ("m",)),
        ReplicaSpec("hosted", "http://hosted", Kind.GENERATIVE, ("n",), reports_load=False),
        ReplicaSpec("router", "http://router", Kind.GENERATIVE, ("r",), load_from=("a", "b")),
        ReplicaSpec("cls", "http://cls", Kind.SINGLE_PASS, ("m",)),
    )
)
PROBED = ("a", "b", "hosted", "router", "cls")
RUNS = tuple(f"run{i}" for i in range(6))
CALLERS = ("alice", "bob", "")


def run_class(run_id: str) -> ServiceClass:
    return ServiceClass.BATCH if run_id in ("run1", "run4") else ServiceClass.INTERACTIVE


def run_caller(run_id: str) -> str:
    return CALLERS[int(run_id[3:]) % len(CALLERS)] if run_id else "anonymous"


# --- what the properties are checked against: plain scans of the state's facts ---------------


def pinned_to(state: State, turn: Turn) -> str | None:
    """The replica a held turn must go to, per the rules, or None when any eligible one will do."""
    if turn.kind is not Kind.GENERATIVE or not turn.run_id:
        return None
    run = state.runs.get(turn.run_id)
    if run is None or run.phase is Phase.IDLE or run.replica is None:
        return None
    replica = state.replicas.get(run.replica)
    if (
        replica is None
        or not replica.healthy
        or turn.model not in replica.models
        or replica.kind is not turn.kind
    ):
        return None
    return run.replica


def _tracks(turn: Turn) -> bool:
    return turn.kind is Kind.GENERATIVE and bool(turn.run_id)


def in_flight(state: State) -> Counter[str]:
    return Counter(t.replica for t in state.turns.values() if t.status is TurnStatus.PLACED)


def paused_interactive(state: State) -> Counter[str]:
    return Counter(
        r.replica
        for r in state.runs.values()
        if r.phase is Phase.PAUSED and r.service_class is ServiceClass.INTERACTIVE and r.replica
    )


def has_room(state: State, name: str, service_class: ServiceClass) -> bool:
    replica = state.replicas[name]
    cap = replica.capacity()
    if cap is None:
        return True
    used = in_flight(state)[name]
    if service_class is ServiceClass.BATCH:
        used += paused_interactive(state)[name]
    return used < cap


def eligible(state: State, turn: Turn) -> list[str]:
    pin = pinned_to(state, turn)
    if pin is not None:
        return [pin]
    return [
        r.name
        for r in state.replicas_in_order()
        if r.healthy and r.kind is turn.kind and turn.model in r.models
    ]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state = State()
        self.log: list[Event] = []  # since the last restart
        self.actions: list[Action] = []
        self.next_turn = 0
        self.admitted: set[str] = set()  # turns the core took (not refused)
        self.ends: Counter[str] = Counter()  # how many times each turn really ended
        self.placed_once: Counter[str] = Counter()
        self.ended_runs: set[str] = set()
        self.last: tuple[State, Event, tuple[Action, ...]] | None = None

    def feed(self, event: Event) -> tuple[Action, ...]:
        before = self.state
        self.state, actions = decide(before, event)
        self.log.append(event)
        self.actions.extend(actions)
        self.last = (before, event, actions)
        gone = set(before.turns) - set(self.state.turns)
        if not isinstance(event, Resynced | PoolConfigured):
            for turn_id in gone:
                self.ends[turn_id] += 1
        for action in actions:
            if (
                isinstance(action, Place)
                and before.turns.get(action.turn_id, None) is None
                or (isinstance(action, Place) and before.turns[action.turn_id].status is TurnStatus.HELD)
            ):
                self.placed_once[action.turn_id] += 1
            if isinstance(action, Refuse):
                self.admitted.discard(action.turn_id)
        return actions

    @initialize()
    def configure(self) -> None:
        self.feed(POOL)

    # -- turns --

    @rule(
        turns=st.lists(
            st.tuples(
                st.sampled_from((*RUNS, "")),
                st.sampled_from(("m", "m", "m", "m", "m", "m", "n", "r", "unknown")),
                st.integers(0, 9),
            ),
            min_size=1,
            max_size=5,
        )
    )
    def arrive(self, turns: list[tuple[str, str, int]]) -> None:
        for run, model, roll in turns:
            turn_id = f"t{self.next_turn}"
            self.next_turn += 1
            self.admitted.add(turn_id)
            kind = Kind.SINGLE_PASS if roll == 0 and model == "m" else Kind.GENERATIVE
            self.feed(TurnArrived(turn_id, run, run_class(run), run_caller(run), model, kind, self.now))

    def _open(self, status: TurnStatus) -> list[str]:
        return sorted(t.turn_id for t in self.state.turns.values() if t.status is status)

    @precondition(lambda self: self._open(TurnStatus.PLACED))
    @rule(data=st.data(), tool_calls=st.sampled_from((True, True, False)))
    def complete(self, data: st.DataObject, tool_calls: bool) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        reason, ids = ("tool_calls", ("call_1",)) if tool_calls else ("stop", ())
        self.feed(TurnCompleted(turn.turn_id, turn.run_id, reason, 10, 5, ids, self.now))

    @precondition(lambda self: self._open(TurnStatus.PLACED))
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        self.feed(TurnFailed(turn.turn_id, turn.run_id, "engine broke", self.now))

    @precondition(lambda self: self._open(TurnStatus.PLACED))
    @rule(data=st.data(), first=st.booleans())
    def progress(self, data: st.DataObject, first: bool) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        event = FirstToken if first else TurnStarted
        self.feed(event(turn.turn_id, turn.run_id, self.now))

    @precondition(lambda self: self._open(TurnStatus.HELD))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.HELD)))]
        self.feed(TurnAbandoned(turn.turn_id, turn.run_id, self.now))

    @precondition(lambda self: self.ends)
    @rule(data=st.data())
    def report_again(self, data: st.DataObject) -> None:
        """A report for a turn already ended (a duplicate, or one the clock expired) changes nothing."""
        turn_id = data.draw(st.sampled_from(sorted(self.ends)))
        before = self.state
        actions = self.feed(TurnCompleted(turn_id, "run0", "stop", 1, 1, (), self.now))
        assert actions == () and self.state.turns == before.turns

    @precondition(lambda self: self.state.turns)
    @rule(data=st.data())
    def retry_admission(self, data: st.DataObject) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(sorted(self.state.turns)))]
        actions = self.feed(
            TurnArrived(
                turn.turn_id, turn.run_id, turn.service_class, turn.caller, turn.model, turn.kind, self.now
            )
        )
        if turn.status is TurnStatus.PLACED:
            assert [(a.turn_id, a.replica) for a in actions] == [(turn.turn_id, turn.replica)]
        else:
            assert actions == ()

    @rule(run=st.sampled_from(RUNS), roll=st.integers(0, 3))
    def end_run(self, run: str, roll: int) -> None:
        if roll == 0:  # rarer than the rest: a run ends once, after many turns
            self.feed(RunEnded(run, self.now))
            self.ended_runs.add(run)

    # -- the world --

    @rule(
        name=st.sampled_from(PROBED),
        healthy=st.sampled_from((True, True, True, False)),
        # Mostly a queueing engine running a few: the capped pool where the rules matter.
        running=st.sampled_from((None, 0, 1, 1, 2, 2, 3)),
        waiting=st.sampled_from((None, 0, 1, 1, 1, 2)),
    )
    def probe(self, name: str, healthy: bool, running: int | None, waiting: int | None) -> None:
        self.feed(ReplicaProbed(name, healthy, running, waiting, self.now))

    @rule(caps=st.tuples(st.integers(1, 3), st.integers(1, 3)))
    def both_engines_queue(self, caps: tuple[int, int]) -> None:
        """Both engines serving "m" report a queue at once: the pool is full and every rule bites."""
        for name, running in zip(("a", "b"), caps, strict=True):
            self.feed(ReplicaProbed(name, True, running, 1, self.now))

    @rule(seconds=st.sampled_from((0.0, 0.5, 1.0, 30.0, TURN_TIMEOUT_S, RUN_IDLE_EXPIRY_S)))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        for action in self.feed(Tick(self.now)):
            if isinstance(action, TurnExpired):
                assert action.turn_id not in self.state.turns

    @rule(roll=st.integers(0, 5))
    def restart(self, roll: int) -> None:
        """The scheduler dies and comes back empty; the dataplane resyncs and retries its held turns."""
        if roll != 0:  # rarer than the rest
            return
        old = self.state
        view = Resynced(
            runs=tuple(
                ResyncedRun(
                    r.run_id, r.replica, r.phase, r.service_class, r.caller, self.now - r.last_activity
                )
                for r in sorted(old.runs.values())
            ),
            turns=tuple(
                ResyncedTurn(t.turn_id, t.run_id, t.replica, t.service_class, t.caller, t.model, t.kind)
                for t in sorted(old.placed())
                if t.replica is not None
            ),
            at=self.now,
        )
        self.state, self.log, self.actions = State(), [], []
        self.feed(PoolConfigured(POOL.replicas, self.now))
        for name in PROBED:
            r = old.replicas[name]
            self.feed(ReplicaProbed(name, r.healthy, r.running, r.waiting, self.now))
        self.feed(view)
        assert in_flight(self.state) == in_flight(old), "the resync brought back every turn in flight"
        assert {r: (v.replica, v.phase, v.service_class, v.caller) for r, v in self.state.runs.items()} == {
            r: (v.replica, v.phase, v.service_class, v.caller) for r, v in old.runs.items()
        }, "runs keep their replica, phase, class and caller"
        for t in sorted(old.held(), key=lambda t: t.seq):
            self.feed(TurnArrived(t.turn_id, t.run_id, t.service_class, t.caller, t.model, t.kind, self.now))

    # -- the promises, after every event --

    def new_places(self) -> list[Place]:
        """The last decision's placements of held turns (not a retried admission answered again,
        not a resync taking the dataplane's word), in the order decided."""
        if self.last is None or isinstance(self.last[1], Resynced):
            return []
        before, _, actions = self.last
        return [
            a
            for a in actions
            if isinstance(a, Place)
            and (a.turn_id not in before.turns or before.turns[a.turn_id].status is TurnStatus.HELD)
        ]

    @invariant()
    def no_queueing_engine_gets_more_than_it_runs(self) -> None:
        # The engine may start queueing after our turns went out: what is checked is that no
        # placement ever takes a replica past its cap.
        for name in {a.replica for a in self.new_places()}:
            cap = self.state.replicas[name].capacity()
            assert cap is None or in_flight(self.state)[name] <= cap, f"{name} over its running count"

    @invariant()
    def a_turn_goes_only_to_a_healthy_replica_serving_its_model(self) -> None:
        for a in self.new_places():
            turn, replica = self.state.turns[a.turn_id], self.state.replicas[a.replica]
            assert replica.healthy, f"{a.turn_id} placed on unhealthy {a.replica}"
            assert replica.kind is turn.kind and turn.model in replica.models, (
                f"{a.replica} does not serve it"
            )
            assert a.url == replica.url

    @invariant()
    def batch_never_takes_a_slot_kept_for_a_paused_interactive_run(self) -> None:
        for a in self.new_places():
            if self.state.turns[a.turn_id].service_class is not ServiceClass.BATCH:
                continue
            cap = self.state.replicas[a.replica].capacity()
            if cap is not None:
                used = in_flight(self.state)[a.replica] + paused_interactive(self.state)[a.replica]
                assert used <= cap, f"batch turn {a.turn_id} took a kept slot on {a.replica}"

    @invariant()
    def a_run_generating_or_paused_goes_back_to_its_replica(self) -> None:
        if self.last is None:
            return
        before, event, actions = self.last
        # The event itself may have changed a run's phase (its turn ended, or the clock expired
        # it) or its replica's health; those runs are free to move.
        moved = {a.run_id for a in actions if isinstance(a, TurnExpired)}
        if isinstance(event, TurnCompleted | TurnFailed | TurnAbandoned | RunEnded):
            moved.add(event.run_id)
        for a in self.new_places():
            turn = self.state.turns[a.turn_id]
            if turn.run_id in moved or isinstance(event, ReplicaProbed | PoolConfigured):
                continue
            # A turn of the run placed earlier in the same drain re-pins it (perhaps to a replica
            # that does not serve this turn's model, which frees it); the pin then is that one.
            moved.add(turn.run_id)
            pin = pinned_to(before, turn)
            assert pin is None or a.replica == pin, f"{turn.run_id} left {pin} for {a.replica}"

    @invariant()
    def a_held_turn_has_nowhere_to_go(self) -> None:
        for turn in self.state.held():
            for name in eligible(self.state, turn):
                assert not has_room(self.state, name, turn.service_class), (
                    f"{turn.turn_id} could go to {name}"
                )

    @invariant()
    def fewer_in_flight_and_then_earlier_goes_first(self) -> None:
        places = self.new_places()
        counts = Counter(t.caller for t in self.state.turns.values() if t.status is TurnStatus.PLACED)
        # Turns free to go anywhere during the whole drain: not pinned now, and their run had no
        # turn placed in it (placing one is the only way a drain changes a run's pin).
        placed_runs = {a.run_id for a in places}
        still_held = [
            t
            for t in self.state.held()
            if pinned_to(self.state, t) is None and not (_tracks(t) and t.run_id in placed_runs)
        ]
        for i, p in enumerate(places):
            placed = self.state.turns[p.turn_id]
            later = Counter(self.state.turns[q.turn_id].caller for q in places[i:])

            def key(turn: Turn, later: Counter[str] = later) -> tuple[int, int]:
                return (counts[turn.caller] - later[turn.caller], turn.seq)

            for h in still_held:
                # h could have gone where p went, at that moment: same kind and model, not pinned,
                # and p's replica had room for h's class whenever it had room for p's.
                if h.kind is not placed.kind or h.model != placed.model:
                    continue
                if h.service_class is ServiceClass.BATCH and placed.service_class is ServiceClass.INTERACTIVE:
                    continue
                assert h.service_class is placed.service_class, f"interactive {h.turn_id} left behind batch"
                assert key(placed) < key(h), f"{h.turn_id} should have gone before {placed.turn_id}"

    @invariant()
    def a_run_with_a_turn_in_flight_is_generating(self) -> None:
        for turn in self.state.placed():
            run = self.state.runs.get(turn.run_id)
            # A run ended while its turn ran and then reused the id starts over as a new run.
            if turn.kind is Kind.GENERATIVE and run is not None and run.run_id not in self.ended_runs:
                assert run.phase is Phase.GENERATING, (
                    f"{run.run_id} is {run.phase} with {turn.turn_id} in flight"
                )

    @invariant()
    def indexes_agree_with_the_facts(self) -> None:
        s = self.state
        assert dict(s.in_flight_by_replica) == dict(in_flight(s))
        assert dict(s.in_flight_by_caller) == dict(
            Counter(t.caller for t in s.turns.values() if t.status is TurnStatus.PLACED)
        )
        assert dict(s.paused_by_replica) == dict(paused_interactive(s))
        assert list(s.placed_order) == sorted((t.placed_at, t.seq, t.turn_id) for t in s.placed())
        open_runs = {t.run_id for t in s.turns.values()}
        assert list(s.quiet_order) == sorted(
            (r.last_activity, r.run_id) for r in s.runs.values() if r.run_id not in open_runs
        )
        lanes = sorted(turn_id for queue in s.lanes.values() for _, turn_id in queue)
        assert lanes == sorted(t.turn_id for t in s.held())
        assert sum(len(c) for c in s.held_groups.values()) == sum(1 for _ in s.held_queues)

    def teardown(self) -> None:
        if self.last is None:
            return
        # Replaying this segment's log reproduces every action and the state.
        state, actions = replay(self.log)
        assert actions == self.actions
        assert state == self.state
        # Close everything still open; every turn then ended exactly once and nothing is counted.
        self.feed(ReplicaProbed("a", True, 0, 0, self.now))
        for turn_id in sorted(self.state.turns):
            turn = self.state.turns[turn_id]
            if turn.status is TurnStatus.HELD:
                self.feed(TurnAbandoned(turn_id, turn.run_id, self.now))
            else:
                self.feed(TurnCompleted(turn_id, turn.run_id, "stop", 1, 1, (), self.now))
        s = self.state
        assert len(s.turns) == 0
        assert not s.in_flight_by_replica and not s.in_flight_by_caller
        assert not s.held_groups and not s.held_queues and not s.lanes and not s.caller_groups
        assert not s.placed_order and not s.run_open and not s.run_placed and not s.run_lanes
        for turn_id in self.admitted:
            assert self.ends[turn_id] == 1, f"{turn_id} ended {self.ends[turn_id]} times"
        assert all(n == 1 for n in self.placed_once.values()), "a turn was placed twice"


# The suite runs a fixed set of 300 sequences (derandomized), so a run of it is never flaky;
# LUFTPAUSE_PROPERTY_EXAMPLES=5000 explores fresh random sequences instead, as many as asked.
_EXPLORE = os.environ.get("LUFTPAUSE_PROPERTY_EXAMPLES")
SchedulerMachine.TestCase.settings = settings(
    max_examples=int(_EXPLORE or 300),
    stateful_step_count=60,
    deadline=None,
    derandomize=not _EXPLORE,
    database=None if not _EXPLORE else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
