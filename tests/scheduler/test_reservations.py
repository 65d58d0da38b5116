"""Reservations (core.reserve): room set aside for a dataplane while nothing is held.

What a user of the scheduler relies on, shown with explicit event sequences and then checked on
random ones (hypothesis, stateful) against the core's own books:

- a dataplane that takes reservations gets them on the replicas its turns went to, only while
  nothing is held, never beyond the replica's room;
- a turn sent on one is placed where it went, in its run, and the room it used is the
  reservation's, not more;
- the moment a turn is held, every reservation is revoked, and the held turn is placed once its
  room is given back; a replica that turns unhealthy or leaves the pool has its reservations
  revoked;
- a reservation its dataplane stopped using is revoked, never dropped by a timeout, and all of
  them end with its dataplane's stream or resync;
- a scheduler whose dataplanes take no reservations decides exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from luftpause.scheduler.actions import Action, Place, Reserved, Revoked
from luftpause.scheduler.core import RESERVE_WINDOW_S, TURN_TIMEOUT_S, decide, replay
from luftpause.scheduler.events import (
    DataplaneLeft,
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    ReservationReturned,
    ReservationsWanted,
    ReservationUsed,
    Resynced,
    Tick,
    TurnArrived,
    TurnCompleted,
)
from luftpause.scheduler.state import RESERVED_CALLER, Kind, Phase, ServiceClass, State

POOL = PoolConfigured(
    (
        ReplicaSpec("a", "http://a", Kind.GENERATIVE, ("m",), lookahead=2),
        ReplicaSpec("b", "http://b", Kind.GENERATIVE, ("m",), lookahead=1),
    )
)


class Log:
    """A state fed events one at a time, every event and action kept."""

    def __init__(self, *events: Event) -> None:
        self.state = State()
        self.events: list[Event] = []
        self.actions: list[Action] = []
        self.last: tuple[Action, ...] = ()
        self.now = 0.0
        self.feed(POOL, *events)

    def feed(self, *events: Event) -> tuple[Action, ...]:
        out: list[Action] = []
        for event in events:
            self.state, actions = decide(self.state, event)
            self.events.append(event)
            self.actions.extend(actions)
            out.extend(actions)
        self.last = tuple(out)
        return self.last

    def at(self) -> float:
        self.now += 0.01
        return self.now

    def arrive(
        self, turn_id: str, run_id: str, dataplane: str, cls: ServiceClass = ServiceClass.BATCH
    ) -> TurnArrived:
        return TurnArrived(turn_id, run_id, cls, "c", "m", Kind.GENERATIVE, self.at(), dataplane)

    def reserved(self, dataplane: str, replica: str | None = None) -> list[str]:
        return [
            r.reservation_id
            for r in self.state.reservations.values()
            if r.dataplane == dataplane and (replica is None or r.replica == replica) and not r.revoked
        ]


def _of(actions: Iterable[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_a_dataplane_gets_reservations_where_its_turns_went_while_nothing_is_held():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()))
    assert not log.state.reservations  # no turn of its yet: it gets none
    log.feed(log.arrive("t1", "r1", "dp"))
    (place,) = _of(log.last, Place)
    assert place.replica == "a"
    # Room on "a" for one more batch turn of its lookahead of 2: that one is reserved.
    (reserved,) = _of(log.last, Reserved)
    assert (reserved.dataplane, reserved.replica, reserved.url, reserved.models) == (
        "dp",
        "a",
        "http://a",
        ("m",),
    )
    assert log.state.waiting_ours("a") == 2
    # A dataplane that never asked gets none, wherever its turns go.
    log.feed(log.arrive("t2", "r2", "other"))
    assert _of(log.last, Place)[0].replica == "b"
    assert log.reserved("other") == []


def test_a_turn_sent_on_a_reservation_is_placed_where_it_went_in_its_run():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"))
    (reservation,) = log.reserved("dp", "a")
    log.feed(FirstToken("t1", "r1", log.at()), TurnCompleted("t1", "r1", "stop", 1, 1, (), log.at()))
    # t1 ended: room for both turns of the lookahead, so a second reservation came.
    assert len(log.reserved("dp", "a")) == 2
    used = log.feed(ReservationUsed(reservation, "a", log.arrive("t2", "r1", "dp"), log.at()))
    turn = log.state.turns["t2"]
    assert (turn.replica, turn.status, turn.confirmed) == ("a", "placed", False)
    assert log.state.runs["r1"].phase is Phase.GENERATING and log.state.runs["r1"].replica == "a"
    assert reservation not in log.state.reservations
    # The room it used was the reservation's: still two of ours may be waiting on "a", no more.
    assert log.state.waiting_ours("a") == 2 and _of(used, Place) == [] and _of(used, Reserved) == []
    assert [t.turn_id for t in log.state.placed()] == ["t2"]


def test_a_turn_sent_on_a_reservation_keeps_its_runs_slot_on_a_slot_engine():
    log = Log(
        PoolConfigured((ReplicaSpec("a", "http://a", Kind.GENERATIVE, ("m",), lookahead=2, kv_slots=4),))
    )
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"), log.arrive("t0", "r0", "dp"))
    assert (log.state.runs["r1"].slot, log.state.runs["r0"].slot) == (0, 1)
    log.feed(TurnCompleted("t1", "r1", "tool_calls", 1, 1, ("call",), log.at()))
    (reservation, *_) = log.reserved("dp", "a")
    log.feed(ReservationUsed(reservation, "a", log.arrive("t2", "r1", "dp"), log.at()))
    # Its next turn went without asking: r1 still has slot 0, and no other run may take it.
    assert log.state.runs["r1"].slot == 0 and log.state.held_slots["a"] == frozenset({0, 1})


def test_a_held_turn_revokes_every_reservation_and_is_placed_when_they_come_back():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"), log.arrive("t2", "r2", "dp"))
    log.feed(FirstToken("t1", "r1", log.at()), FirstToken("t2", "r2", log.at()))
    a_ids, b_ids = log.reserved("dp", "a"), log.reserved("dp", "b")
    assert len(a_ids) == 2 and len(b_ids) == 1  # every turn of room, on both replicas
    # Another dataplane's turn finds no room: it is held, and the reservations are revoked.
    log.feed(log.arrive("t3", "r3", "dp-2", ServiceClass.INTERACTIVE))
    assert [t.turn_id for t in log.state.held()] == ["t3"]
    (revoked,) = _of(log.last, Revoked)
    assert revoked.dataplane == "dp" and sorted(revoked.reservation_ids) == sorted(a_ids + b_ids)
    # Revoked ones still count until given back: nothing is placed on their room meanwhile.
    assert _of(log.feed(Tick(log.at())), Place) == []
    out = log.feed(ReservationReturned(a_ids[0], log.at()))
    assert [(p.turn_id, p.replica) for p in _of(out, Place)] == [("t3", "a")]
    # Nothing is held again: room left on "b" ("a" has t3 waiting and a revoked reservation).
    assert _of(out, Reserved) == [] and log.state.waiting_ours("a") == 2
    # Room given back is not granted again by the same decision (a turn of its dataplane's may
    # be about to ask for it); the next one grants it.
    out = log.feed(ReservationReturned(a_ids[1], log.at()), ReservationReturned(b_ids[0], log.at()))
    assert _of(out, Reserved) == []
    out = log.feed(Tick(log.at()))
    assert sorted(r.replica for r in _of(out, Reserved)) == ["a", "b"]


def test_a_dataplanes_own_reservations_never_keep_its_own_turn_waiting():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"))
    log.feed(TurnCompleted("t1", "r1", "stop", 1, 1, (), log.at()))
    log.feed(log.arrive("t2", "r2", "dp"), TurnCompleted("t2", "r2", "stop", 1, 1, (), log.at()))
    held = log.reserved("dp")
    assert sorted(log.state.reservations[r].replica for r in held) == ["a", "a", "b"]  # all the room there is
    # A turn of a run it cannot send on one: it gives them back in the message of its admission.
    out = log.feed(*(ReservationReturned(r, log.at()) for r in held), log.arrive("t3", "r3", "dp"))
    assert [(p.turn_id, p.reservation_id) for p in _of(out, Place)] == [("t3", "")] and not log.state.held()
    # A turn whose admission crossed a grant on the way takes the granted room: no revocation.
    log.feed(TurnCompleted("t3", "r3", "stop", 1, 1, (), log.at()))
    granted = log.reserved("dp")
    assert len(granted) == 3
    out = log.feed(log.arrive("t4", "r4", "dp"))
    (place,) = _of(out, Place)
    assert place.reservation_id in granted and _of(out, Revoked) == [] and not log.state.held()
    assert place.reservation_id not in log.state.reservations


def test_a_reservation_used_as_it_was_revoked_counts_its_turn_once():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"))
    (reservation,) = log.reserved("dp", "a")
    log.feed(log.arrive("t2", "r2", "dp-2"))  # placed on b
    log.feed(log.arrive("t3", "r3", "dp-2"))  # no room anywhere: held, reservation revoked
    assert log.state.reservations[reservation].revoked
    # The dataplane had sent t4 on it before the revocation reached it.
    log.feed(ReservationUsed(reservation, "a", log.arrive("t4", "r4", "dp"), log.at()))
    assert log.state.turns["t4"].replica == "a" and log.state.waiting_ours("a") == 2
    assert [t.turn_id for t in log.state.held()] == ["t3"]
    # Giving back a reservation already used changes nothing.
    assert log.feed(ReservationReturned(reservation, log.at())) == ()


def test_reservations_on_a_replica_that_fails_or_leaves_are_revoked():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"), log.arrive("t2", "r2", "dp"))
    log.feed(FirstToken("t2", "r2", log.at()))
    (on_b,) = log.reserved("dp", "b")
    log.feed(ReplicaProbed("b", False, None, None, log.at()))
    assert _of(log.last, Revoked) == [Revoked("dp", (on_b,))]
    (on_a,) = log.reserved("dp", "a")
    log.feed(PoolConfigured(POOL.replicas[1:], log.at()))
    assert _of(log.last, Revoked) == [Revoked("dp", (on_a,))]
    assert on_a not in log.state.reservations


def test_an_unused_reservation_is_revoked_never_dropped_and_ends_with_its_dataplanes_stream_or_resync():
    log = Log()
    log.feed(ReservationsWanted("dp", log.at()), log.arrive("t1", "r1", "dp"))
    log.feed(TurnCompleted("t1", "r1", "stop", 1, 1, (), log.at()))
    held = log.reserved("dp")
    assert len(held) == 2
    # Nothing sent there for the window: revoked, and counted until given back, however long.
    log.feed(Tick(log.now + 2 * RESERVE_WINDOW_S))
    assert _of(log.last, Revoked) == [Revoked("dp", tuple(sorted(held)))]
    log.feed(Tick(log.now + 10 * TURN_TIMEOUT_S))
    assert sorted(log.state.reservations) == sorted(held) and log.state.waiting_ours("a") == 2
    log.feed(Resynced((), (), log.now + 10 * TURN_TIMEOUT_S, "dp"))
    assert not log.state.reservations and log.state.waiting_ours("a") == 0
    # Granted again once it asks on its new stream; its stream ending ends them for good.
    log.feed(log.arrive("t2", "r2", "dp"), TurnCompleted("t2", "r2", "stop", 1, 1, (), log.now + 1e4))
    assert not log.state.reservations
    log.feed(ReservationsWanted("dp", log.now + 1e4), log.arrive("t2b", "r2", "dp"))
    log.feed(TurnCompleted("t2b", "r2", "stop", 1, 1, (), log.now + 1e4))
    assert len(log.reserved("dp")) == 2
    log.feed(DataplaneLeft("dp", log.now + 1e4))
    assert not log.state.reservations and log.state.waiting_ours("a") == 0
    log.feed(log.arrive("t3", "r3", "dp"))
    assert not log.state.reservations


# --- random sequences -------------------------------------------------------------------------

DATAPLANES = ("dp-1", "dp-2")


class Reservations(RuleBasedStateMachine):
    """Two dataplanes that take reservations and one that does not, turns admitted and sent on
    reservations, first tokens, completions, revocations answered late, health flips, streams
    ending. Each dataplane's own pool is modelled: what it was granted and has not used or given
    back, including revoked ones whose revocation it has not read yet."""

    @initialize()
    def start(self) -> None:
        self.log = Log(*(ReservationsWanted(d, 0.0) for d in DATAPLANES))
        self.pools: dict[str, list[str]] = {d: [] for d in DATAPLANES}
        self.to_give_back: dict[str, list[str]] = {d: [] for d in DATAPLANES}
        self.n = 0
        self.healthy = {"a": True, "b": True}

    def _feed(self, *events: Event) -> None:
        before_held = bool(self.log.state.held_groups)
        actions = self.log.feed(*events)
        for action in actions:
            if isinstance(action, Place) and action.reservation_id:
                # Its own reservation's room: the dataplane drops it from its pool on reading this.
                for pool in self.pools.values():
                    if action.reservation_id in pool:
                        pool.remove(action.reservation_id)
            if isinstance(action, Reserved):
                assert action.dataplane in DATAPLANES
                self.pools[action.dataplane].append(action.reservation_id)
            elif isinstance(action, Revoked):
                self.to_give_back[action.dataplane].extend(action.reservation_ids)
        if _of(actions, Reserved):
            # Granted only by a decision that leaves nothing held.
            assert not self.log.state.held_groups, (before_held, actions)

    def _next(self) -> str:
        self.n += 1
        return f"t{self.n}"

    @rule(dataplane=st.sampled_from((*DATAPLANES, "plain")), run=st.integers(0, 3), interactive=st.booleans())
    def admit(self, dataplane: str, run: int, interactive: bool) -> None:
        cls = ServiceClass.INTERACTIVE if interactive else ServiceClass.BATCH
        self._feed(self.log.arrive(self._next(), f"{dataplane}-run{run}", dataplane, cls))

    @precondition(lambda self: any(self.pools.values()))
    @rule(data=st.data())
    def send_on_a_reservation(self, data: st.DataObject) -> None:
        dataplane = data.draw(st.sampled_from([d for d in DATAPLANES if self.pools[d]]))
        reservation_id = self.pools[dataplane].pop(0)
        replica = self.log.state.reservations[reservation_id].replica
        run = data.draw(st.integers(0, 3))
        self._feed(
            ReservationUsed(
                reservation_id,
                replica,
                self.log.arrive(self._next(), f"{dataplane}-run{run}", dataplane),
                self.log.at(),
            )
        )

    @precondition(lambda self: any(self.to_give_back.values()))
    @rule()
    def give_back(self) -> None:
        for dataplane in DATAPLANES:
            for reservation_id in self.to_give_back[dataplane]:
                if reservation_id in self.pools[dataplane]:
                    self.pools[dataplane].remove(reservation_id)
                    self._feed(ReservationReturned(reservation_id, self.log.at()))
            self.to_give_back[dataplane] = []

    @precondition(lambda self: bool(self.log.state.placed()))
    @rule(data=st.data(), tool=st.booleans())
    def progress(self, data: st.DataObject, tool: bool) -> None:
        turn = data.draw(st.sampled_from(sorted(self.log.state.placed(), key=lambda t: t.seq)))
        if not turn.confirmed:
            self._feed(FirstToken(turn.turn_id, turn.run_id, self.log.at()))
        else:
            ids = (f"call-{turn.turn_id}",) if tool else ()
            self._feed(
                TurnCompleted(
                    turn.turn_id, turn.run_id, "tool_calls" if tool else "stop", 1, 1, ids, self.log.at()
                )
            )

    @rule(replica=st.sampled_from(("a", "b")))
    def flip_health(self, replica: str) -> None:
        self.healthy[replica] = not self.healthy[replica]
        self._feed(ReplicaProbed(replica, self.healthy[replica], None, None, self.log.at()))

    @rule(dataplane=st.sampled_from(DATAPLANES))
    def stream_ends_and_comes_back(self, dataplane: str) -> None:
        self.pools[dataplane] = []
        self.to_give_back[dataplane] = []
        self._feed(DataplaneLeft(dataplane, self.log.at()), ReservationsWanted(dataplane, self.log.at()))

    @invariant()
    def reservations_are_counted_exactly_once_and_never_beyond_room(self) -> None:
        state = self.log.state
        for reservation_id, reservation in state.reservations.items():
            placeholder = state.turns[reservation_id]
            assert placeholder.caller == RESERVED_CALLER and placeholder.replica == reservation.replica
            assert placeholder.status == "placed" and not placeholder.confirmed
        assert {t.turn_id for t in state.turns.values() if t.caller == RESERVED_CALLER} == set(
            state.reservations
        )
        # What each dataplane holds is what the core counts for it (revoked but not yet given back included).
        for dataplane in DATAPLANES:
            counted = {r for r, v in state.reservations.items() if v.dataplane == dataplane}
            assert set(self.pools[dataplane]) == counted
        # Admission's bound (admission.py), reservations included: at most a lookahead of
        # interactive turns waiting in each engine, and of batch turns with the reservations
        # (each could become either).
        for spec in POOL.replicas:
            waiting = [t for t in state.turns.values() if t.replica == spec.name and not t.confirmed]
            interactive = [t for t in waiting if t.service_class is ServiceClass.INTERACTIVE]
            batch_or_reserved = [
                t for t in waiting if t.service_class is ServiceClass.BATCH or t.caller == RESERVED_CALLER
            ]
            assert len(interactive) <= spec.lookahead and len(batch_or_reserved) <= spec.lookahead, (
                spec.name,
                waiting,
            )
        if state.held_groups:
            assert all(r.revoked for r in state.reservations.values())
        for reservation in state.reservations.values():
            if not state.replicas[reservation.replica].healthy:
                assert reservation.revoked

    def teardown(self) -> None:
        if not hasattr(self, "log"):
            return
        for dataplane in DATAPLANES:
            self._feed(DataplaneLeft(dataplane, self.log.at()))
        for name in ("a", "b"):
            self._feed(ReplicaProbed(name, True, None, None, self.log.at()))
        for _ in range(200):
            open_turns = sorted(self.log.state.turns.values(), key=lambda t: t.seq)
            if not open_turns:
                break
            for turn in open_turns:
                if turn.status == "placed":
                    self._feed(TurnCompleted(turn.turn_id, turn.run_id, "stop", 1, 1, (), self.log.at()))
        state = self.log.state
        assert not state.turns and not state.reservations and not state.in_flight_by_replica
        assert not state.unconfirmed and not state.in_flight_by_caller
        # Replaying the log reproduces every action and the final state.
        replayed, actions = replay(self.log.events)
        assert actions == self.log.actions and replayed == state


TestReservations = Reservations.TestCase
TestReservations.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
