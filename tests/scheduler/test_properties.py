"""The scheduler core's promises, checked on random event sequences (hypothesis, stateful).

A small pool (two engines with different lookaheads, an uncapped hosted endpoint, a replica
whose engine reports no load, a router in front of the two engines, and a single-pass
classifier) is driven by random arrivals, completions, failures, abandons, progress reports
(requests sent, streamed or not; first tokens), probes (some asked for before earlier
placements), clock jumps, run ends, duplicate reports, retried admissions, scheduler restarts
with a resync, and queues clearing. After every event the checks below hold; at the end every
open turn is closed and the counts must return to zero, and replaying the log must reproduce
every action and the final state.

The checks compare the core with a model kept here by plain scans and its own bookkeeping:
which placed turns the engine is known to have started (first token; a load reading, of the
turns sent before it all but the `waiting` newest; a turn ending there, for the oldest one whose
reply does not stream), the other clients' requests a reading showed queued, how long batch keeps
room for each paused interactive run and what each caller's pauses average. From those the model
says which replica has room for which class (the rule of admission.py), and the core must place
exactly up to it.

Each run keeps one class and one caller, as a dataplane sees it (the class is a header of the
run's requests), which is what makes the per-placement checks below exact from the state after
each decision: within one decision the drain places interactive turns before batch ones.

A second test drives the core against the fake engine's model (`fake_engine.engine.Engine`, two
small engines in virtual time, as the simulator does) with streamed turns whose first tokens are
reported as the engine starts them: the engines' own queues never hold more of our turns of a
class than the lookahead, and every turn is served.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import attained_as_each_was_placed, machine_settings

from luftpause.fake_engine.engine import Engine, ModelRequest, Step
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.prefix_cache import Block
from luftpause.scheduler import admission, fairness
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
        ReplicaSpec("a", "http://a", Kind.GENERATIVE, ("m", "n"), lookahead=3),
        ReplicaSpec("b", "http://b", Kind.GENERATIVE, ("m",), lookahead=1),
        ReplicaSpec("hosted", "http://hosted", Kind.GENERATIVE, ("n",), reports_load=False, lookahead=0),
        ReplicaSpec("local", "http://local", Kind.GENERATIVE, ("n",), reports_load=False, lookahead=2),
        ReplicaSpec("router", "http://router", Kind.GENERATIVE, ("r",), load_from=("a", "b"), lookahead=2),
        ReplicaSpec("cls", "http://cls", Kind.SINGLE_PASS, ("m",), lookahead=2),
    )
)
PROBED = ("a", "b", "hosted", "local", "router", "cls")
NO_LOAD = frozenset(s.name for s in POOL.replicas if not s.reports_load)
ROUTERS = {s.name: s.load_from for s in POOL.replicas if s.load_from}
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
        or not replica.in_service
        or turn.model not in replica.models
        or replica.kind is not turn.kind
    ):
        return None
    return run.replica


def _tracks(turn: Turn) -> bool:
    return turn.kind is Kind.GENERATIVE and bool(turn.run_id)


def capped(state: State, name: str) -> bool:
    return state.replicas[name].lookahead > 0


def in_flight(state: State) -> Counter[str]:
    return Counter(t.replica for t in state.turns.values() if t.status is TurnStatus.PLACED)


def unconfirmed(state: State, name: str, service_class: ServiceClass | None = None) -> list[Turn]:
    """Our turns placed on a capped replica that its engine is not known to have started, in the
    order they were sent."""
    if not capped(state, name):
        return []
    return sorted(
        (
            t
            for t in state.placed()
            if t.replica == name
            and not t.confirmed
            and (service_class is None or t.service_class is service_class)
        ),
        key=sent_order,
    )


def sent_order(turn: Turn) -> tuple[float, int]:
    """The order our turns reached a replica: by when they were placed, and within one decision
    in the order the drain sent them (a placed turn's seq is its place in that order)."""
    assert turn.placed_at is not None
    return (turn.placed_at, turn.seq)


def paused_interactive(state: State) -> Counter[str]:
    """Interactive runs paused on a tool that batch still keeps room for, per replica."""
    return Counter(
        r.replica
        for r in state.runs.values()
        if r.phase is Phase.PAUSED
        and r.service_class is ServiceClass.INTERACTIVE
        and r.replica
        and r.kept_until is not None
    )


def room_for(state: State, name: str, service_class: ServiceClass) -> bool:
    """Whether `name` has room for a turn of `service_class`, by the rule of admission.py, from the
    facts: interactive turns count only among themselves; batch counts every turn of ours not yet
    started, and leaves one turn of lookahead to each paused interactive run, down to one. Others'
    requests a reading showed queued count against both."""
    replica = state.replicas[name]
    if not replica.in_service:
        return False
    lookahead = replica.lookahead
    if lookahead <= 0:
        return True
    others = replica.others_waiting
    if service_class is ServiceClass.INTERACTIVE:
        return len(unconfirmed(state, name, ServiceClass.INTERACTIVE)) + others < lookahead
    paused = min(paused_interactive(state)[name], lookahead - 1)
    return len(unconfirmed(state, name)) + others + paused < lookahead


def eligible(state: State, turn: Turn) -> list[str]:
    pin = pinned_to(state, turn)
    if pin is not None:
        return [pin]
    return [
        r.name
        for r in state.replicas_in_order()
        if r.in_service and r.kind is turn.kind and turn.model in r.models
    ]


def router_waiting(state: State, engines: tuple[str, ...]) -> int | None:
    readings = [state.replicas[e].waiting for e in engines if state.replicas[e].waiting is not None]
    return sum(readings) if readings else None


@dataclass
class Model:
    """What the core should know besides the facts it is told, kept here by the rules' own words,
    one event at a time: which placed turns the engine started, which were sent with a reply that
    does not stream, what each replica's last reading said of others' requests, until when batch
    keeps room for each paused interactive run, and each caller's average pause."""

    confirmed: set[str] = field(default_factory=set)
    not_streamed: set[str] = field(default_factory=set)
    # replica -> (others' requests its last reading showed queued ahead of ours, when it was asked for)
    others: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    kept: dict[str, float] = field(default_factory=dict)
    paused_at: dict[str, float] = field(default_factory=dict)
    estimate: dict[str, float] = field(default_factory=dict)

    def step(self, before: State, event: Event, after: State) -> None:
        placed = {t.turn_id: t for t in before.placed()}
        confirmed = self.confirmed & placed.keys()
        not_streamed = self.not_streamed & placed.keys()
        others = dict(self.others)
        gone: set[str] = set()

        def waiting(name: str) -> list[Turn]:
            if not capped(after, name):
                return []
            return sorted(
                (
                    t
                    for t in placed.values()
                    if t.replica == name and t.turn_id not in confirmed and t.turn_id not in gone
                ),
                key=sent_order,
            )

        def confirm(turn: Turn) -> None:
            confirmed.add(turn.turn_id)
            assert turn.replica is not None and turn.placed_at is not None
            theirs, read_at = others.get(turn.replica, (0, None))
            if capped(after, turn.replica) and theirs and (read_at is None or turn.placed_at > read_at):
                # A turn of ours sent after the reading started: the queue ahead of it is gone.
                others[turn.replica] = (0, read_at)

        def confirm_next(name: str) -> None:
            # The engine had room for the head of its queue: the oldest of ours there.
            queue = waiting(name)
            if queue and queue[0].turn_id in not_streamed:
                confirm(queue[0])

        def reading(name: str, sent_at: float, engine_waiting: int | None) -> None:
            sent = [t for t in waiting(name) if t.placed_at is not None and t.placed_at <= sent_at]
            if engine_waiting is None:
                keep, theirs = len(sent), 0
            else:
                keep, theirs = min(len(sent), engine_waiting), max(0, engine_waiting - len(sent))
            others[name] = (theirs, sent_at)
            for t in sent[: len(sent) - keep]:
                confirm(t)

        if isinstance(event, FirstToken):
            turn = placed.get(event.turn_id)
            if turn is not None and turn.turn_id not in confirmed:
                confirm(turn)
        elif isinstance(event, TurnStarted):
            if event.turn_id in placed and not event.streamed:
                not_streamed.add(event.turn_id)
        elif isinstance(event, TurnCompleted):
            turn = placed.get(event.turn_id)
            if turn is not None and turn.replica is not None:
                gone.add(turn.turn_id)
                confirm_next(turn.replica)
        elif isinstance(event, TurnFailed | TurnAbandoned):
            turn = placed.get(event.turn_id)
            if turn is not None and turn.replica is not None:
                gone.add(turn.turn_id)
                if turn.turn_id in confirmed:  # it ran, so its end made room in the engine
                    confirm_next(turn.replica)
        elif isinstance(event, Tick):
            for turn in sorted(placed.values(), key=lambda t: (t.placed_at, t.seq, t.turn_id)):
                assert turn.placed_at is not None and turn.replica is not None
                if event.at - turn.placed_at >= TURN_TIMEOUT_S:
                    gone.add(turn.turn_id)
                    if turn.turn_id in confirmed:
                        confirm_next(turn.replica)
        elif isinstance(event, ReplicaProbed) and event.name in after.replicas:
            sent_at = event.sent_at if event.sent_at is not None else event.at
            if event.name not in ROUTERS and event.waiting is not None:
                reading(event.name, sent_at, after.replicas[event.name].waiting)
            for router, engines in ROUTERS.items():
                if event.name in engines:
                    reading(router, sent_at, router_waiting(after, engines))
        elif isinstance(event, Resynced):
            confirmed, not_streamed = set(), set()

        still = {t.turn_id for t in after.placed()}
        self.confirmed = confirmed & still
        self.not_streamed = not_streamed & still
        self.others = others
        self._runs(before, event, after)

    def _runs(self, before: State, event: Event, after: State) -> None:
        if (
            isinstance(event, TurnArrived)
            and event.turn_id not in before.turns
            and event.turn_id in after.turns
        ):
            run = before.runs.get(event.run_id)
            turn = after.turns[event.turn_id]
            if _tracks(turn) and run is not None and run.phase is Phase.PAUSED:
                # Back from its tool: the pause is from the tool call (or the run's last turn to
                # arrive while it is still paused, its first one back being held) until now.
                pause = event.at - self.paused_at[event.run_id]
                self.estimate[event.caller] = admission.learn_pause(self.estimate.get(event.caller), pause)
                self.paused_at[event.run_id] = event.at
        if isinstance(event, TurnCompleted):
            turn = before.turns.get(event.turn_id)
            run = after.runs.get(event.run_id)
            if turn is not None and _tracks(turn) and turn.status is TurnStatus.PLACED and run is not None:
                if run.phase is Phase.PAUSED:
                    self.paused_at[run.run_id] = event.at
                    if run.service_class is ServiceClass.INTERACTIVE and run.replica:
                        keep = admission.keep_paused_for(self.estimate.get(run.caller))
                        self.kept[run.run_id] = event.at + keep
        if isinstance(event, Resynced):
            self.kept, self.paused_at = {}, {}
            for r in event.runs:
                if r.phase is Phase.PAUSED:
                    self.paused_at[r.run_id] = event.at - max(r.idle_s, 0.0)
                    if r.service_class is ServiceClass.INTERACTIVE and r.replica:
                        keep = admission.keep_paused_for(self.estimate.get(r.caller))
                        self.kept[r.run_id] = event.at + keep
        for run_id in list(self.paused_at):
            run = after.runs.get(run_id)
            if run is None or run.phase is not Phase.PAUSED:
                del self.paused_at[run_id]
                self.kept.pop(run_id, None)
        for run_id, until in list(self.kept.items()):
            if until <= after.now:
                del self.kept[run_id]  # its tool is taking longer than its caller's usually do

    def check(self, state: State) -> None:
        for t in state.placed():
            assert t.confirmed == (t.turn_id in self.confirmed), (
                f"{t.turn_id} on {t.replica}: confirmed {t.confirmed}, the model says {not t.confirmed}"
            )
            assert (t.streamed is False) == (t.turn_id in self.not_streamed), (
                f"{t.turn_id}: streamed {t.streamed}"
            )
        for r in state.replicas.values():
            if r.lookahead > 0:
                assert (r.others_waiting, r.read_at) == self.others.get(r.name, (0, None)), (
                    f"{r.name}: others waiting {r.others_waiting} read at {r.read_at}, "
                    f"the model says {self.others.get(r.name, (0, None))}"
                )
        for run in state.runs.values():
            # (A run paused with no replica to come back to, its id reused by a new run while the
            # old one's turn ran, keeps room nowhere, whatever its kept_until says.)
            if run.phase is Phase.PAUSED and run.service_class is ServiceClass.INTERACTIVE and run.replica:
                assert run.kept_until == self.kept.get(run.run_id), (
                    f"{run.run_id}: kept until {run.kept_until}, the model says {self.kept.get(run.run_id)}"
                )
        assert dict(state.pause_estimate) == self.estimate


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state = State()
        self.model = Model()
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
        self.model.step(before, event, self.state)
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
                st.sampled_from(("m", "m", "m", "m", "m", "n", "n", "r", "r", "unknown")),
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
    @rule(data=st.data(), replica_fault=st.sampled_from((True, True, False)))
    def fail(self, data: st.DataObject, replica_fault: bool) -> None:
        """A turn fails, mostly by its replica's fault (which may get the replica ejected)."""
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        self.feed(TurnFailed(turn.turn_id, turn.run_id, "engine broke", self.now, replica_fault))

    @precondition(lambda self: self._open(TurnStatus.PLACED))
    @rule(data=st.data(), streamed=st.booleans())
    def sent(self, data: st.DataObject, streamed: bool) -> None:
        """The dataplane sent a placed turn's request; its reply streams or not."""
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        actions = self.feed(TurnStarted(turn.turn_id, turn.run_id, self.now, streamed))
        assert actions == (), "a request going out makes no room"

    @precondition(lambda self: self._open(TurnStatus.PLACED))
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._open(TurnStatus.PLACED)))]
        self.feed(FirstToken(turn.turn_id, turn.run_id, self.now))

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
        # Mostly a queueing engine running a few: the pool where the rules matter.
        running=st.sampled_from((None, 0, 1, 1, 2, 2, 3)),
        waiting=st.sampled_from((None, 0, 0, 1, 1, 1, 2, 4)),
        # When the load was asked for: at the answer, or before some of our turns went out.
        asked=st.sampled_from((None, None, 0.0, 0.5, 2.0)),
    )
    def probe(
        self, name: str, healthy: bool, running: int | None, waiting: int | None, asked: float | None
    ) -> None:
        if name in NO_LOAD:
            running = waiting = None
        sent_at = None if asked is None else self.now - asked
        self.feed(ReplicaProbed(name, healthy, running, waiting, self.now, sent_at))

    @rule(
        name=st.sampled_from(("a", "b", "cls")), started=st.integers(1, 2), asked=st.sampled_from((0.0, 0.5))
    )
    def engine_started_some_of_ours(self, name: str, started: int, asked: float) -> None:
        """A reading of an engine that has started the oldest of our turns there and queues the rest."""
        waiting = max(0, len(unconfirmed(self.state, name)) - started)
        self.feed(ReplicaProbed(name, True, 3, waiting, self.now, self.now - asked))

    @rule(caps=st.tuples(st.integers(1, 3), st.integers(1, 3)))
    def both_engines_queue(self, caps: tuple[int, int]) -> None:
        """Both engines serving "m" report a queue at once: the pool is full and every rule bites."""
        for name, running in zip(("a", "b"), caps, strict=True):
            self.feed(ReplicaProbed(name, True, running, 1, self.now))

    @rule(seconds=st.sampled_from((0.0, 0.5, 1.0, 3.0, 30.0, TURN_TIMEOUT_S, RUN_IDLE_EXPIRY_S)))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        for action in self.feed(Tick(self.now)):
            if isinstance(action, TurnExpired):
                assert action.turn_id not in self.state.turns

    @rule()
    def queue_clears(self) -> None:
        """Every engine's queue empties and every turn placed so far starts: the pool is back to
        full use at once, each replica filled up to its lookahead and no further."""
        for name in PROBED:
            running, waiting = (None, None) if name in NO_LOAD else (len(self.state.placed()), 0)
            self.feed(ReplicaProbed(name, True, running, waiting, self.now))
        started = sorted(t.turn_id for t in self.state.placed())
        for turn_id in started:
            turn = self.state.turns.get(turn_id)
            if turn is not None and not turn.confirmed:
                self.feed(FirstToken(turn_id, turn.run_id, self.now))
        s = self.state
        for turn_id in started:
            assert turn_id not in s.turns or s.turns[turn_id].confirmed, f"{turn_id} not taken for started"
        for name in PROBED:
            if capped(s, name):
                assert s.replicas[name].others_waiting == 0
                assert all(t.turn_id not in started for t in unconfirmed(s, name))
        for turn in s.held():
            for name in eligible(s, turn):
                # Nothing but the turns placed just now waits there, and they fill it to the limit.
                lookahead = s.replicas[name].lookahead
                assert lookahead > 0, f"{turn.turn_id} held with room on uncapped {name}"
                if turn.service_class is ServiceClass.INTERACTIVE:
                    mine = len(unconfirmed(s, name, ServiceClass.INTERACTIVE))
                    assert mine == lookahead, f"{name} has {mine} of {lookahead} interactive after a clear"
                else:
                    limit = lookahead - min(paused_interactive(s)[name], lookahead - 1)
                    assert len(unconfirmed(s, name)) >= limit, f"{name} below batch's limit after a clear"

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
        self.state, self.log, self.actions, self.model = State(), [], [], Model()
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
        if self.last is None:
            return []
        before, event, actions = self.last
        named = {t.turn_id for t in event.turns} if isinstance(event, Resynced) else set()
        return [
            a
            for a in actions
            if isinstance(a, Place)
            and a.turn_id not in named
            and (a.turn_id not in before.turns or before.turns[a.turn_id].status is TurnStatus.HELD)
        ]

    @invariant()
    def the_core_knows_what_the_model_knows(self) -> None:
        self.model.check(self.state)

    @invariant()
    def each_placement_had_room_for_its_class(self) -> None:
        # Within a drain our turns not yet started only grow, one per placement, and the kept
        # room only shrinks as paused runs come back (interactive, placed before any batch): so the
        # counts each placement saw are the final ones less the placements after it.
        s = self.state
        places = self.new_places()
        paused = paused_interactive(s)
        for i, a in enumerate(places):
            replica = s.replicas[a.replica]
            if replica.lookahead <= 0:
                continue
            turn = s.turns[a.turn_id]
            later = [s.turns[b.turn_id] for b in places[i:] if b.replica == a.replica]
            if turn.service_class is ServiceClass.INTERACTIVE:
                seen = len(unconfirmed(s, a.replica, ServiceClass.INTERACTIVE)) - sum(
                    t.service_class is ServiceClass.INTERACTIVE for t in later
                )
                assert seen + replica.others_waiting < replica.lookahead, (
                    f"interactive {a.turn_id} placed on {a.replica} past its lookahead"
                )
            else:
                seen = len(unconfirmed(s, a.replica)) - len(later)
                kept = min(paused[a.replica], replica.lookahead - 1)
                assert seen + replica.others_waiting + kept < replica.lookahead, (
                    f"batch {a.turn_id} took room on {a.replica} kept for a paused interactive run"
                )

    @invariant()
    def no_decision_sends_more_than_a_lookahead_of_a_class_to_wait(self) -> None:
        # Of each class, our turns not yet started on a replica stay within its lookahead, unless
        # they were already over it (a resync brings back turns without knowing what they do):
        # placing never takes a class past it, and nothing else adds to them.
        if self.last is None:
            return
        before, event, _ = self.last
        for name in PROBED:
            lookahead = self.state.replicas[name].lookahead
            if lookahead <= 0:
                continue
            for cls in ServiceClass:
                now = len(unconfirmed(self.state, name, cls))
                if isinstance(event, Resynced):
                    placed_now = any(
                        a.replica == name and self.state.turns[a.turn_id].service_class is cls
                        for a in self.new_places()
                    )
                    assert not placed_now or now <= lookahead
                    continue
                was = len(unconfirmed(before, name, cls)) if before.replicas else 0
                assert now <= max(lookahead, was), f"{name}: {now} {cls} turns waiting, lookahead {lookahead}"

    @invariant()
    def a_turn_goes_only_to_a_healthy_replica_serving_its_model(self) -> None:
        for a in self.new_places():
            turn, replica = self.state.turns[a.turn_id], self.state.replicas[a.replica]
            assert replica.in_service, (
                f"{a.turn_id} placed on {a.replica}, not in service (unhealthy or ejected)"
            )
            assert replica.kind is turn.kind and turn.model in replica.models, (
                f"{a.replica} does not serve it"
            )
            assert a.url == replica.url

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
    def no_replica_with_room_is_left_idle_while_a_turn_it_may_take_is_held(self) -> None:
        for turn in self.state.held():
            for name in eligible(self.state, turn):
                assert not room_for(self.state, name, turn.service_class), (
                    f"{turn.turn_id} ({turn.service_class}) could go to {name}"
                )

    @invariant()
    def less_attained_then_fewer_in_flight_then_earlier_goes_first(self) -> None:
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
        assert self.last is not None
        before = self.last[0]

        def arrival(turn: Turn) -> int:
            # A placed turn is renumbered in the order turns went out; its arrival is the seq it
            # was held with, or, arrived in this decision, the next one then.
            held = before.turns.get(turn.turn_id)
            return held.seq if held is not None else before.next_seq

        # Each caller's attained service as each placement was decided: the least goes first.
        standings = attained_as_each_was_placed(
            before, self.state, [self.state.turns[p.turn_id] for p in places], _tracks
        )
        for i, p in enumerate(places):
            placed = self.state.turns[p.turn_id]
            later = Counter(self.state.turns[q.turn_id].caller for q in places[i:])

            def key(
                turn: Turn, later: Counter[str] = later, attained: dict[str, float] = standings[i]
            ) -> tuple[float, int, int]:
                return (
                    attained.get(turn.caller, fairness.NONE),
                    counts[turn.caller] - later[turn.caller],
                    arrival(turn),
                )

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
    def a_routers_load_is_the_sum_of_its_engines(self) -> None:
        for router, engines in ROUTERS.items():
            r = self.state.replicas[router]
            readings = [self.state.replicas[e].running for e in engines]
            running = [x for x in readings if x is not None]
            assert r.running == (sum(running) if running else None)
            assert r.waiting == router_waiting(self.state, engines)

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
        for name in PROBED:
            assert sorted(key[-1] for key in s.unconfirmed.get(name, ())) == sorted(
                t.turn_id for t in unconfirmed(s, name)
            )
            assert s.waiting_ours(name) == len(unconfirmed(s, name))
            assert s.waiting_interactive(name) == len(unconfirmed(s, name, ServiceClass.INTERACTIVE))
        assert list(s.kept_order) == sorted(
            (r.kept_until, r.run_id)
            for r in s.runs.values()
            if r.phase is Phase.PAUSED
            and r.service_class is ServiceClass.INTERACTIVE
            and r.replica
            and r.kept_until is not None
        )

    def teardown(self) -> None:
        if self.last is None:
            return
        # Replaying this segment's log reproduces every action and the state.
        state, actions = replay(self.log)
        assert actions == self.actions
        assert state == self.state
        # Close everything still open; every turn then ended exactly once and nothing is counted.
        for name in PROBED:
            self.feed(ReplicaProbed(name, True, 0, 0, self.now))
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
        assert not s.unconfirmed and not s.unconfirmed_interactive
        for turn_id in self.admitted:
            assert self.ends[turn_id] == 1, f"{turn_id} ended {self.ends[turn_id]} times"
        assert all(n == 1 for n in self.placed_once.values()), "a turn was placed twice"


SchedulerMachine.TestCase.settings = machine_settings(300)
TestScheduler = SchedulerMachine.TestCase
# LUFTPAUSE_PROPERTY_EXAMPLES explores fresh random sequences in the test below too.
_EXPLORE = os.environ.get("LUFTPAUSE_PROPERTY_EXAMPLES")


# --- against the engine model ---------------------------------------------------------------


@dataclass
class SimTurn:
    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    request: ModelRequest
    last: bool  # the run's last turn: it ends in text; the others end in a tool call


@dataclass
class SimRun:
    run_id: str
    service_class: ServiceClass
    caller: str
    start: float
    prompts: tuple[int, ...]  # each turn's new prompt tokens (the earlier ones are its cached prefix)
    replies: tuple[int, ...]
    pauses: tuple[float, ...]  # the tool's time after each turn but the last


class EngineWorld:
    """The core in front of two fake engines in virtual time, wired as the dataplane, the prober and
    the clock wire it: a placed turn's request goes out at once and is reported sent; a streamed
    reply's first token is reported when the engine's step that started it ends (a reply that does
    not stream reports nothing until it ends); its end is reported when the engine finishes it.
    Each engine's load is read every 2 s (the two a second apart) and the clock ticks every second.
    With `priorities`, the engines put interactive requests first, as the dataplane asks an engine
    that honours priorities to.

    What waits in each engine is checked after every request sent (streamed), or, for replies
    that do not stream, whenever the engine starts a step: the turn our last one's end made room
    for is started at the engine's next step, not the instant the end is reported."""

    ENGINES = ("a", "b")

    def __init__(
        self, params: EngineParams, lookahead: int, streamed: bool = True, priorities: bool = False
    ) -> None:
        self.now = 0.0
        self.lookahead = lookahead
        self.streamed = streamed
        self.priorities = priorities
        self.engines = {
            name: Engine(replace(params, priority_scheduling=priorities)) for name in self.ENGINES
        }
        self.stepping = dict.fromkeys(self.ENGINES, False)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.state = State()
        self.log: list[Event] = []
        self.turns: dict[str, SimTurn] = {}
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.most_waiting = 0
        self.runs: dict[str, SimRun] = {}
        specs = tuple(
            ReplicaSpec(name, f"sim://{name}", Kind.GENERATIVE, ("m",), lookahead=lookahead)
            for name in self.ENGINES
        )
        self.feed(PoolConfigured(specs, 0.0))

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, self._seq, callback))
        self._seq += 1

    def feed(self, event: Event) -> None:
        self.log.append(event)
        self.state, actions = decide(self.state, event)
        for action in actions:
            assert isinstance(action, Place), f"unexpected {action}"
            self._send(action)

    def _send(self, place: Place) -> None:
        turn = self.turns[place.turn_id]
        if self.priorities and turn.service_class is ServiceClass.INTERACTIVE:
            turn.request = replace(turn.request, priority=1)
        self.feed(TurnStarted(turn.turn_id, turn.run_id, self.now, streamed=self.streamed))
        self.engines[place.replica].submit(turn.request)
        if self.streamed:
            self._check(place.replica)
        self._kick(place.replica)

    def _check(self, name: str) -> None:
        queued = Counter(
            self.turns[request_id].service_class for request_id in self.engines[name].waiting.ids()
        )
        self.most_waiting = max(self.most_waiting, *queued.values(), 0)
        for cls, n in queued.items():
            assert n <= self.lookahead, (
                f"{name}'s queue holds {n} of our {cls} turns at {self.now:.3f}, lookahead {self.lookahead}"
            )

    def _kick(self, name: str) -> None:
        engine = self.engines[name]
        if self.stepping[name] or not engine.busy:
            return
        engine.idle_until(self.now)
        step = engine.step()
        if step is None:
            return
        if not self.streamed:
            self._check(name)
        self.stepping[name] = True
        self.at(step.ended, lambda: self._deliver(name, step))

    def _deliver(self, name: str, step: Step) -> None:
        for request_id in step.tokens:
            if request_id not in self.started:
                self.started.add(request_id)
                if self.streamed:
                    self.feed(FirstToken(request_id, self.turns[request_id].run_id, self.now))
        for request_id in step.finished:
            self._finished(self.turns[request_id])
        for request_id in step.rejected:  # a prompt larger than the engine's memory
            self.failed.add(request_id)
            self.feed(TurnFailed(request_id, self.turns[request_id].run_id, "too long", self.now))
        self.stepping[name] = False
        self._kick(name)

    def _finished(self, turn: SimTurn) -> None:
        self.finished.add(turn.turn_id)
        calls = () if turn.last else (f"call-{turn.turn_id}",)
        reason = "stop" if turn.last else "tool_calls"
        self.feed(
            TurnCompleted(turn.turn_id, turn.run_id, reason, turn.request.prompt_tokens, 1, calls, self.now)
        )
        if not turn.last:
            run = self.runs[turn.run_id]
            index = int(turn.turn_id.rsplit("-", 1)[1]) + 1
            self.at(self.now + run.pauses[index - 1], lambda: self._arrive(run, index))

    def _arrive(self, run: SimRun, index: int) -> None:
        blocks = tuple(Block(f"{run.run_id}/{k}".encode(), run.prompts[k]) for k in range(index + 1))
        request = ModelRequest(f"{run.run_id}-{index}", blocks, run.replies[index], max_tokens=64)
        turn = SimTurn(
            request.request_id,
            run.run_id,
            run.service_class,
            run.caller,
            request,
            index == len(run.prompts) - 1,
        )
        self.turns[turn.turn_id] = turn
        self.feed(
            TurnArrived(
                turn.turn_id, run.run_id, run.service_class, run.caller, "m", Kind.GENERATIVE, self.now
            )
        )

    def _probe(self, name: str) -> None:
        load = self.engines[name].load()
        self.feed(ReplicaProbed(name, True, load.running, load.waiting, self.now))
        if not self._all_done():
            self.at(self.now + 2.0, lambda: self._probe(name))

    def _tick(self) -> None:
        self.feed(Tick(self.now))
        if not self._all_done():
            self.at(self.now + 1.0, self._tick)

    def _all_done(self) -> bool:
        expected = sum(len(r.prompts) for r in self.runs.values())
        return len(self.finished) + len(self.failed) >= expected or self.now > 900.0

    def run(self, runs: list[SimRun]) -> None:
        self.runs = {r.run_id: r for r in runs}
        for r in runs:
            self.at(r.start, lambda r=r: self._arrive(r, 0))
        for i, name in enumerate(self.ENGINES):
            self.at(float(i), lambda name=name: self._probe(name))
        self.at(1.0, self._tick)
        while self._events:
            when, _, callback = heapq.heappop(self._events)
            self.now = max(self.now, when)
            callback()


def sim_runs() -> st.SearchStrategy[list[SimRun]]:
    @st.composite
    def one(draw: st.DrawFn, i: int) -> SimRun:
        turns = draw(st.integers(1, 4))
        return SimRun(
            f"run{i}",
            draw(st.sampled_from((ServiceClass.INTERACTIVE, ServiceClass.BATCH))),
            draw(st.sampled_from(("alice", "bob"))),
            draw(st.sampled_from((0.0, 0.0, 0.05, 0.3, 1.0, 4.0))),
            tuple(draw(st.lists(st.integers(20, 250), min_size=turns, max_size=turns))),
            tuple(draw(st.lists(st.integers(1, 60), min_size=turns, max_size=turns))),
            tuple(
                draw(
                    st.lists(st.sampled_from((0.0, 0.1, 0.5, 2.0, 6.0, 15.0)), min_size=turns, max_size=turns)
                )
            ),
        )

    return st.integers(1, 14).flatmap(lambda n: st.tuples(*(one(i) for i in range(n))).map(list))


@given(
    runs=sim_runs(),
    slots=st.sampled_from((0, 1, 2, 4)),
    # Room for a run's whole prompt and reply; a few of them at once, or one at a time.
    kv_pool_tokens=st.sampled_from((1200, 2500, 6000)),
    lookahead=st.integers(1, 3),
    priorities=st.booleans(),
)
@settings(
    max_examples=int(_EXPLORE or 60),
    deadline=None,
    derandomize=not _EXPLORE,
    database=None if not _EXPLORE else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_an_engines_queue_never_holds_more_of_our_turns_of_a_class_than_the_lookahead(
    runs: list[SimRun], slots: int, kv_pool_tokens: int, lookahead: int, priorities: bool
):
    world = EngineWorld(EngineParams(slots=slots, kv_pool_tokens=kv_pool_tokens), lookahead, True, priorities)
    world.run(runs)
    # Every turn was served (or refused by an engine that could never hold it), none is left held.
    assert len(world.finished) + len(world.failed) == sum(len(r.prompts) for r in runs)
    assert not world.state.turns
    # And replaying what the core was told decides the same again.
    assert replay(world.log)[0] == world.state
