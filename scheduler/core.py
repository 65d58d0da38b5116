"""The scheduler's decisions: `decide(state, event) -> (state, actions)`, and nothing else.

Theory of operation
-------------------

The scheduler answers one question, "where does this turn go, and when?", for a pool of
replicas it does not own and runs it only hears about. It does no I/O, reads no clock and draws
no random numbers: everything it knows arrives as an event (`events.py`), stamped with the time
it happened, and everything it wants done leaves as an action (`actions.py`). The gRPC host, the
prober and the clock (`host.py`, `wire.py`, `prober.py`, `main.py`) translate between the world
and these two vocabularies; the simulator feeds the same function in virtual time. Feeding the
same events to the same state gives the same actions, always: replaying a recorded log
reproduces every decision.

There are three kinds of thing, each with a small state machine:

  Replica   healthy or not (as last probed; unprobed counts as healthy, so a fresh stack serves at
            once and the first failed probe takes it out), ejected or not (its turns kept failing:
            outliers.py, counted from the turns' reports), with the engine's load as last read:
            `running` and `waiting`. How many of our turns it may take is admission's rule
            (`admission.py`): no more than its lookahead of them may be waiting inside the engine
            at once, counted as the placed turns the engine is not yet known to have started
            (a first token, a load reading or, for replies that do not stream, a turn finishing
            there is what confirms one). A router (`load_from`) is a replica whose load is the
            sum of the last readings of the engines behind it.

  Run       IDLE -> GENERATING when one of its turns is placed;
            GENERATING -> PAUSED when that turn completes in tool calls (the run will be back,
            and its prefix is cached on that replica); -> IDLE when it completes otherwise,
            fails, or is abandoned (a failed turn never leaves its run paused, so a retry is
            admitted like any next turn). Where the run gate holds it (`gate.py`), a paused run
            lets go of its replica when its keep time runs out (still PAUSED, no replica). A
            run is forgotten when it ends or has been quiet for RUN_IDLE_EXPIRY_S.

  Turn      arrives -> refused at once when no replica of its kind serves its model at all;
            otherwise HELD -> PLACED (its admission answered) -> gone when reported completed, failed
            or abandoned, or dropped after TURN_TIMEOUT_S without a report. A held turn can also
            be abandoned (its client left).

Placement. A held turn may go to a replica in service (healthy, and not ejected for turns that
keep failing: outliers.py) of its kind that serves its model. A run that is GENERATING or PAUSED
may go only to its last replica, while that replica is in service and serves the model, even
when others have room: that is where its KV cache is. Whether a replica has room
is `admission.room`: fewer of our turns waiting in its engine than its lookahead, and for a batch
turn one fewer for each interactive run paused on a tool there with room kept for it (never the
last one); a paused run keeps that room only for about as long as its caller's tools take. Of the
replicas with room, the one with the fewest of our turns in flight wins; ties go to config order.
A run that no replica holds (a new one, or one that let go) goes only where `gate.fits` finds
its working set room beside the runs held there: the run gate, whose rules and reasons are
gate.py's; a pinned run's turn is never held for that room.

Draining. After every event that may let a held turn go somewhere (a replica gained room, or a
held turn entered a group it was not in: it arrived, or its run's pin moved), held turns are
tried in order: interactive before batch, then the caller with the least attained service (the
engine tokens its turns asked for lately: fairness.py; so one caller's flood cannot starve
another), then the fewest turns in flight, then arrival. A turn that cannot be placed (its pinned
replica is full) does not block the ones behind it. The order is re-evaluated after each
placement, since placing a turn changes its caller's standing. So after every decision no held turn
has a replica it could go to.

Reservations. While nothing is held, a placement is foregone, so a dataplane that asks is
granted room ahead of need on the replicas its turns went to, counted like a turn placed there
and not yet started; it sends a known run's next turn on one without asking and reports it
used. The first held turn revokes them all (`_reserve` has the rules). A scheduler whose
dataplanes never ask decides exactly as without them: the simulator's never do.

Cost. Nothing here scans every turn or run. Held turns are indexed by group: (kind, model, the
replica their run is pinned to, class). All turns of a group can go to the same replicas, so the
drain asks "is there room?" once per group, and each group keeps its callers in a sorted set keyed
((attained service, turns in flight), first arrival), so the group's first key is the turn it would place next. Under a
caller, a run's turns of one group form a lane that enters the group by its first turn only, so a
run whose pin moves moves one entry per lane. Placed turns and quiet runs sit in sorted sets by
time, so expiry looks only at what is due. Each index is a persistent map or B-tree: a decision
costs O(log n) in the turns and runs held, plus one look at each replica and group per placement.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable
from typing import Any

from immutables import Map

from luftpause import lifecycle
from luftpause.errors import no_replica_serves
from luftpause.scheduler import admission, fairness, gate, outliers
from luftpause.scheduler.actions import Action, Place, Refuse, Reserved, Revoked, RunForgotten, TurnExpired
from luftpause.scheduler.events import (
    DataplaneLeft,
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReservationReturned,
    ReservationsWanted,
    ReservationUsed,
    Resynced,
    RunEnded,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from luftpause.scheduler.ordered import EMPTY, SortedSet
from luftpause.scheduler.state import (
    RESERVED_CALLER,
    CallerKey,
    Group,
    Kind,
    Lane,
    LaneKey,
    Phase,
    Replica,
    Reservation,
    Run,
    RunKey,
    SentKey,
    ServiceClass,
    State,
    Turn,
    TurnKey,
    TurnStatus,
    pinned_to,
)

# A placed turn whose end is never reported (the dataplane crashed mid-turn) is dropped after this.
TURN_TIMEOUT_S = 600.0
# A dataplane that sent no turn to a replica for this long holds no reservation there (`_reserve`).
RESERVE_WINDOW_S = 1.0
# A run with no turn for this long is forgotten (a rule shared with the dataplane).
RUN_IDLE_EXPIRY_S = lifecycle.RUN_IDLE_EXPIRY_S

Decision = tuple[State, tuple[Action, ...]]

_HELD = TurnStatus.HELD
_PLACED = TurnStatus.PLACED
_IDLE = Phase.IDLE
_PAUSED = Phase.PAUSED
_GENERATING = Phase.GENERATING
_INTERACTIVE = ServiceClass.INTERACTIVE
_BATCH = ServiceClass.BATCH
_GENERATIVE = Kind.GENERATIVE


def decide(state: State, event: Event) -> Decision:
    """The one entry point: the state after `event`, and what the host must do about it."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"decide: not a scheduler event: {event!r}")
    tx = _open_tx(state)
    # Events from different sources (prober, clock, the Turns stream) may be stamped slightly out of order;
    # the state's clock only moves forward.
    if event.at > tx.now:
        tx.now = event.at
    actions: list[Action] = []
    handler(tx, event, actions)
    if tx.kept_order and tx.kept_order.first()[0] <= tx.now:
        _end_kept(tx)
    if tx.hold_order and tx.hold_order.first()[0] <= tx.now:
        _end_holds(tx)
    # After every decision no held turn has anywhere to go (the drain saw to it). So the drain
    # need look only when that may have changed: a replica gained room (a turn confirmed, a paused
    # run's kept room given up, a probe, a new pool) or a held turn has somewhere new to try (it
    # arrived, or its run's pin moved). Any other event leaves nothing to place.
    if tx.held_groups and (tx.may_place or tx.entered):
        rooms = _rooms(tx)
        if tx.may_place or _entered_may_place(tx, *rooms):
            _drain(tx, actions, *rooms)
    if tx.reserving or tx.reservations:
        # A reservation given back is room its dataplane wants for a turn it is about to admit
        # (or a held turn wants): it is not granted again before that turn is decided.
        _reserve(tx, actions, grant=type(event) is not ReservationReturned)
    return tx.freeze(), tuple(actions)


def refusal_message(kind: Kind, model: str) -> str:
    """What a client sees when no replica of `kind` serves `model` (404 at the dataplane)."""
    return no_replica_serves(kind.value, model)


def replay(events: Iterable[Event], state: State | None = None) -> tuple[State, list[Action]]:
    """Feeds `events` in order from `state` (default: empty); returns the final state and every action."""
    state = state if state is not None else State()
    actions: list[Action] = []
    for event in events:
        state, out = decide(state, event)
        actions.extend(out)
    return state, actions


class _Tx:
    """One decision's working copy of the state: the same fields, rebound as they change.

    Every field holds an immutable value, so the state handed in is never touched; `freeze`
    makes the new one. Only the helpers below change the facts (turns, runs), and each keeps
    the indexes that depend on what it changed current.
    """

    # The state's fields, declared for the type checker only (no values: the slots hold them);
    # tests/scheduler/test_core_fields.py keeps them the state's, name for name and type for type.
    replicas: Map[str, Replica]
    order: tuple[str, ...]
    runs: Map[str, Run]
    turns: Map[str, Turn]
    next_seq: int
    now: float
    serving: Map[tuple[Kind, str], tuple[str, ...]]
    routers_of: Map[str, tuple[str, ...]]
    in_flight_by_replica: Map[str, int]
    in_flight_by_caller: Map[str, int]
    paused_by_replica: Map[str, int]
    held_queues: Map[tuple[Group, str], SortedSet[LaneKey]]
    held_groups: Map[Group, SortedSet[CallerKey]]
    caller_groups: Map[str, frozenset[Group]]
    lanes: Map[Lane, SortedSet[TurnKey]]
    run_lanes: Map[str, tuple[Lane, ...]]
    run_open: Map[str, int]
    run_placed: Map[str, int]
    placed_order: SortedSet[SentKey]
    quiet_order: SortedSet[RunKey]
    unconfirmed: Map[str, SortedSet[SentKey]]
    kept_order: SortedSet[RunKey]
    pause_estimate: Map[str, float]
    unconfirmed_interactive: Map[str, int]
    reserving: Map[str, Map[str, float]]
    reservations: Map[str, Reservation]
    held_kv: Map[str, int]
    held_runs: Map[str, int]
    hold_order: SortedSet[RunKey]
    pause_samples: Map[str, tuple[float, ...]]
    tokens_per_byte: Map[str, float]
    attained: Map[str, float]
    held_slots: Map[str, frozenset[int]]

    __slots__ = (*State._fields, "may_place", "entered")
    # Set by whatever may let a held turn be placed; see `decide`.
    may_place: bool
    # Groups a lane entered in this decision: they may have somewhere to go that the groups
    # already held had not.
    entered: list[Group]

    def freeze(self) -> State:
        return _new_state(State, _read_state(self))


# Copying the state's fields in and out is written from State._fields, once, so that a field
# added to the state is carried by every decision without being listed here. The opener is
# made the way namedtuple makes its methods: one unpacking, in one call, with no loop per
# decision (a decision is a few tens of microseconds; each Python call in it shows). The reader
# is one attrgetter, and the state is made without NamedTuple._make's length check.
_read_state = operator.attrgetter(*State._fields)
_new_state = tuple.__new__
_OPENER = (
    "def _open_tx(s):\n"
    "    tx = _Tx.__new__(_Tx)\n"
    "    tx.may_place = False\n"
    "    tx.entered = []\n"
    f"    ({', '.join(f'tx.{name}' for name in State._fields)},) = s\n"
    "    return tx\n"
)
_namespace: dict[str, Any] = {"_Tx": _Tx}
exec(_OPENER, _namespace)  # noqa: S102 (generated from State._fields only)
_open_tx: Callable[[State], _Tx] = _namespace["_open_tx"]


# --- event handlers ---------------------------------------------------------------------------


def _pool_configured(tx: _Tx, e: PoolConfigured, actions: list[Action]) -> None:
    tx.may_place = True
    replicas: dict[str, Replica] = {}
    serving: dict[tuple[Kind, str], list[str]] = {}
    routers_of: dict[str, list[str]] = {}
    for spec in e.replicas:
        fresh = Replica(
            name=spec.name,
            url=spec.url,
            kind=spec.kind,
            models=frozenset(spec.models),
            reports_load=spec.reports_load or bool(spec.load_from),
            load_from=spec.load_from,
            lookahead=spec.lookahead,
            kv_tokens=spec.kv_tokens,
            kv_configured=spec.kv_tokens is not None,
            gate_min_runs=spec.gate_min_runs,
            kv_slots=spec.kv_slots,
            slots_configured=spec.kv_slots is not None,
            host_cache=spec.host_cache,
            ejection_base_s=spec.ejection_base_s,
        )
        old = tx.replicas.get(spec.name)
        if old is not None:
            # A replica that stays in the pool keeps what its probes said.
            fresh = dataclasses.replace(
                fresh,
                healthy=old.healthy,
                probed=old.probed,
                running=old.running,
                waiting=old.waiting,
                others_waiting=old.others_waiting,
                read_at=old.read_at,
                kv_tokens=fresh.kv_tokens if fresh.kv_configured else old.kv_tokens,
                kv_slots=fresh.kv_slots if fresh.slots_configured else old.kv_slots,
                prompt_tokens=old.prompt_tokens,
                cached_tokens=old.cached_tokens,
                outlier=old.outlier,
            )
        replicas[spec.name] = fresh
        for model in spec.models:
            serving.setdefault((spec.kind, model), []).append(spec.name)
        for engine in spec.load_from:
            routers_of.setdefault(engine, []).append(spec.name)
    tx.replicas = Map(replicas)
    tx.order = tuple(s.name for s in e.replicas)
    tx.serving = Map({k: tuple(v) for k, v in serving.items()})
    tx.routers_of = Map({k: tuple(v) for k, v in routers_of.items()})
    for name in tx.order:
        if replicas[name].load_from:
            _refresh_router(tx, name)

    kept: list[Turn] = []
    gone: dict[str, list[str]] = {}
    for turn in sorted(tx.turns.values(), key=lambda t: t.seq):
        if turn.status is _PLACED and turn.replica not in replicas:
            reservation = tx.reservations.get(turn.turn_id)
            if reservation is not None and not reservation.revoked:
                gone.setdefault(reservation.dataplane, []).append(reservation.reservation_id)
            continue  # its replica left the pool: nothing to count it against
        if turn.status is _HELD and not tx.serving.get((turn.kind, turn.model)):
            actions.append(Refuse(turn.turn_id, turn.run_id, refusal_message(turn.kind, turn.model)))
            continue
        kept.append(turn)
    _rebuild(tx, list(tx.runs.values()), kept)
    # Its dataplane must not send a turn there on a reservation it still holds.
    actions.extend(Revoked(dataplane, tuple(ids)) for dataplane, ids in sorted(gone.items()))


def _replica_probed(tx: _Tx, e: ReplicaProbed, actions: list[Action]) -> None:
    replica = tx.replicas.get(e.name)
    if replica is None:
        return
    tx.may_place = True
    if replica.load_from:
        # A router's own reading is not its engines' load: only its health counts.
        replica = dataclasses.replace(replica, healthy=e.healthy, probed=True)
    else:
        # A probe that could not read the load leaves the last reading standing: forgetting it
        # would uncap a queueing engine because of one lost /metrics answer.
        replica = dataclasses.replace(
            replica,
            healthy=e.healthy,
            probed=True,
            running=e.running if e.running is not None else replica.running,
            waiting=e.waiting if e.waiting is not None else replica.waiting,
        )
    if e.kv_tokens is not None and e.kv_tokens > 0 and not replica.kv_configured:
        replica = dataclasses.replace(replica, kv_tokens=e.kv_tokens)
    if e.kv_slots is not None and e.kv_slots > 0 and not replica.slots_configured:
        replica = dataclasses.replace(replica, kv_slots=e.kv_slots)
    if e.prompt_tokens is not None and e.cached_tokens is not None:
        replica = dataclasses.replace(replica, prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens)
    tx.replicas = tx.replicas.set(e.name, replica)
    sent_at = e.sent_at if e.sent_at is not None else e.at
    if replica.load_from:
        _refresh_router(tx, e.name)
    elif e.waiting is not None:
        _confirm_by_reading(tx, e.name, sent_at)
    for router in tx.routers_of.get(e.name, ()):
        _refresh_router(tx, router)
        _confirm_by_reading(tx, router, sent_at)


def _turn_arrived(tx: _Tx, e: TurnArrived, actions: list[Action]) -> None:
    known = tx.turns.get(e.turn_id)
    if known is not None:
        # A retried admission: a placed turn gets its placement again; a held one keeps waiting.
        if known.status is _PLACED:
            assert known.replica is not None and known.placed_at is not None
            url = tx.replicas[known.replica].url
            actions.append(
                Place(
                    known.turn_id,
                    known.run_id,
                    known.replica,
                    url,
                    known.placed_at - known.arrived_at,
                    slot=_slot_of(tx, known),
                )
            )
        return
    if not tx.serving.get((e.kind, e.model)):
        actions.append(Refuse(e.turn_id, e.run_id, refusal_message(e.kind, e.model)))
        return
    turn = Turn(
        e.turn_id,
        e.run_id,
        e.service_class,
        e.caller,
        e.model,
        e.kind,
        e.at,
        tx.next_seq,
        dataplane=e.dataplane,
        request_bytes=e.request_bytes,
        max_tokens=e.max_tokens,
    )
    tx.next_seq += 1
    tx.turns = tx.turns.set(turn.turn_id, turn)
    # Counted open before the run is touched, so the run leaves the quiet index once, not twice.
    _open(tx, turn.run_id, 1)
    if _tracks_run(turn):
        _run_came_back(tx, e)
    _hold(tx, turn, _group(tx, turn))


def _run_came_back(tx: _Tx, e: TurnArrived) -> None:
    """A turn of the run arrived: the run is created, or carries the turn's class and caller."""
    run = tx.runs.get(e.run_id)
    # Until its usage is reported, what the request's size says it needs; a known run keeps the
    # larger of that and what it reported last.
    estimate = gate.estimated_working_set(e.request_bytes, e.max_tokens, tx.tokens_per_byte.get(e.model))
    # The class and caller are per turn; the run carries the latest.
    if run is None:
        run = Run(
            e.run_id,
            e.service_class,
            e.caller,
            _IDLE,
            None,
            e.at,
            dataplane=e.dataplane,
            working_set=estimate,
        )
    else:
        if run.phase is _PAUSED:
            # Back from a tool: how long its caller's tools take is what a kept slot lasts, and
            # what a paused run's place is kept for.
            pause = e.at - run.last_activity
            tx.pause_estimate = tx.pause_estimate.set(
                e.caller, admission.learn_pause(tx.pause_estimate.get(e.caller), pause)
            )
            tx.pause_samples = tx.pause_samples.set(
                e.caller, gate.learn_pause(tx.pause_samples.get(e.caller, ()), pause)
            )
        run = run.came_back(e.service_class, e.caller, e.at, e.dataplane, max(run.working_set, estimate))
    _set_run(tx, e.run_id, run)


# A turn's progress does not touch its run's last activity: a run with a turn open is never
# counted idle, and the turn's end stamps the time from which it is.


def _turn_started(tx: _Tx, e: TurnStarted, actions: list[Action]) -> None:
    if e.streamed:
        return  # a streamed turn confirms itself by its first token; nothing to remember
    turn = tx.turns.get(e.turn_id)
    if turn is not None and turn.status is _PLACED and turn.streamed is None:
        tx.turns = tx.turns.set(e.turn_id, turn.sent(streamed=False))


def _first_token(tx: _Tx, e: FirstToken, actions: list[Action]) -> None:
    turn = tx.turns.get(e.turn_id)
    if turn is not None and turn.status is _PLACED and not turn.confirmed:
        _confirm(tx, turn)


def _turn_completed(tx: _Tx, e: TurnCompleted, actions: list[Action]) -> None:
    turn = tx.turns.get(e.turn_id)
    if turn is not None:
        _count_outcome(tx, turn, failed=False)
    size = None
    if turn is not None and e.prompt_tokens > 0:
        # Its usage is what its run needs from now on, and teaches the model's tokens per byte.
        known = tx.tokens_per_byte.get(turn.model)
        learnt = gate.learn_tokens_per_byte(known, e.prompt_tokens, turn.request_bytes)
        if learnt != known and learnt is not None:
            tx.tokens_per_byte = tx.tokens_per_byte.set(turn.model, learnt)
        size = gate.measured_working_set(e.prompt_tokens, e.completion_tokens, turn.max_tokens)
    _end_turn(tx, e.turn_id, e.at, e.paused_on_tool, freed_engine_room=True, working_set=size)


def _turn_failed(tx: _Tx, e: TurnFailed | TurnAbandoned, actions: list[Action]) -> None:
    if isinstance(e, TurnFailed) and e.replica_fault:
        turn = tx.turns.get(e.turn_id)
        if turn is not None:
            _count_outcome(tx, turn, failed=True)
    _end_turn(tx, e.turn_id, e.at, False)


def _end_kept(tx: _Tx) -> None:
    """Paused runs whose tool is taking longer than their caller's usually do keep no more room."""
    while tx.kept_order:
        until, run_id = tx.kept_order.first()
        if until > tx.now:
            return
        _set_run(tx, run_id, tx.runs[run_id]._replace(kept_until=None))


def _end_holds(tx: _Tx) -> None:
    """Paused runs whose keep time ran out let go of their place: their room is the gate's again."""
    while tx.hold_order:
        until, run_id = tx.hold_order.first()
        if until > tx.now:
            return
        _set_run(tx, run_id, tx.runs[run_id].let_go())


def _run_ended(tx: _Tx, e: RunEnded, actions: list[Action]) -> None:
    if e.run_id in tx.runs:
        # Its turns still open stay counted: they hold engine slots until reported done.
        _set_run(tx, e.run_id, None)
        actions.append(RunForgotten(e.run_id, "ended"))


def _tick(tx: _Tx, e: Tick, actions: list[Action]) -> None:
    for name, replica in tx.replicas.items():
        if replica.outlier.ejected_until is not None:
            back = outliers.comes_back(replica.outlier, tx.now)
            if back is not None:
                # In service again if its probes say so; the drain tries it at once.
                tx.replicas = tx.replicas.set(name, dataclasses.replace(replica, outlier=back))
                tx.may_place = True
    # Both indexes are oldest first: each loop stops at the first entry not yet due.
    while tx.placed_order:
        placed_at, _, turn_id = tx.placed_order.first()
        if e.at - placed_at < TURN_TIMEOUT_S:
            break
        turn = _end_turn(tx, turn_id, e.at, False, touch=False)
        assert turn is not None and turn.replica is not None
        actions.append(TurnExpired(turn.turn_id, turn.run_id, turn.replica))
    while tx.quiet_order:
        last_activity, run_id = tx.quiet_order.first()
        if not lifecycle.forgotten(e.at - last_activity):
            break
        # A forgotten paused run frees the slot batch was keeping for it; the drain sees that.
        _set_run(tx, run_id, None)
        actions.append(RunForgotten(run_id, "idle"))


def _resynced(tx: _Tx, e: Resynced, actions: list[Action]) -> None:
    tx.may_place = True
    # Its reservations go with its old stream; it asks again on its new one.
    if e.dataplane in tx.reserving:
        tx.reserving = tx.reserving.delete(e.dataplane)
    # What other dataplanes sent stays: their placed turns, and the runs whose latest turn came
    # through them, unless this view names the run and saw it more recently.
    named = {r.run_id: r for r in e.runs}
    runs = {
        run.run_id: run
        for run in tx.runs.values()
        if run.dataplane != e.dataplane
        and (run.run_id not in named or run.last_activity > e.at - max(named[run.run_id].idle_s, 0.0))
    }
    for r in e.runs:
        if r.run_id not in runs:
            run = Run(
                r.run_id,
                r.service_class,
                r.caller,
                r.phase,
                r.replica or None,
                e.at - max(r.idle_s, 0.0),
                e.at + admission.keep_paused_for(tx.pause_estimate.get(r.caller))
                if r.phase is _PAUSED
                else None,
                e.dataplane,
            )
            # Its size is not in the view (0 until its next usage report); a paused one keeps
            # its place for its caller's keep time, as if it had just paused.
            runs[r.run_id] = (
                run._replace(hold_until=_hold_until(tx, run, e.at)) if r.phase is _PAUSED else run
            )
    # Held turns are ours alone (their dataplanes wait on them here); placed ones are their dataplane's word.
    turns = {t.turn_id: t for t in tx.turns.values() if t.status is _HELD or t.dataplane != e.dataplane}
    for t in e.turns:
        replica = tx.replicas.get(t.replica)
        if replica is None:
            continue  # a replica no longer in the pool: nothing to count it against
        held = turns.get(t.turn_id)
        if held is not None and held.status is not _HELD:
            continue  # placed for another dataplane: that one speaks for it
        if held is not None:
            # The dataplane already runs a turn we were holding: answer its waiting admission with that.
            actions.append(Place(t.turn_id, t.run_id, t.replica, replica.url, e.at - held.arrived_at))
        else:
            tx.next_seq += 1
        turns[t.turn_id] = Turn(
            t.turn_id,
            t.run_id,
            t.service_class,
            t.caller,
            t.model,
            t.kind,
            held.arrived_at if held else e.at,
            held.seq if held else tx.next_seq - 1,
            _PLACED,
            t.replica,
            e.at,
            dataplane=e.dataplane,
        )
    _rebuild(tx, list(runs.values()), sorted(turns.values(), key=lambda t: t.seq))


def _reservations_wanted(tx: _Tx, e: ReservationsWanted, actions: list[Action]) -> None:
    if e.dataplane not in tx.reserving:
        tx.reserving = tx.reserving.set(e.dataplane, Map())


def _reservation_used(tx: _Tx, e: ReservationUsed, actions: list[Action]) -> None:
    """The turn went to the reservation's replica without asking: its placeholder becomes the turn."""
    if e.reservation_id in tx.reservations:
        _end_turn(tx, e.reservation_id, e.at, False, touch=False)
    t = e.turn
    replica = tx.replicas.get(e.replica)
    if t.turn_id in tx.turns or replica is None:
        return  # already known (a duplicate report), or a replica no longer in the pool
    turn = Turn(
        t.turn_id, t.run_id, t.service_class, t.caller, t.model, t.kind, e.at, tx.next_seq,
        _PLACED, replica.name, tx.now, dataplane=t.dataplane, request_bytes=t.request_bytes,
        max_tokens=t.max_tokens,
    )  # fmt: skip
    tx.next_seq += 1
    _add_turn(tx, turn, _charge(tx, turn, tx.runs.get(turn.run_id) if _tracks_run(turn) else None))
    if _tracks_run(turn):
        _run_came_back(tx, t)
        run = tx.runs[turn.run_id]
        _set_run(tx, turn.run_id, run.placed_on(replica.name, tx.now, _slot_for(tx, run, replica)))
    _sent_there(tx, t.dataplane, replica.name)


def _reservation_returned(tx: _Tx, e: ReservationReturned, actions: list[Action]) -> None:
    if e.reservation_id in tx.reservations:
        _end_turn(tx, e.reservation_id, e.at, False, touch=False)


def _wants(tx: _Tx, dataplane: str, replica: str) -> bool:
    """Whether `dataplane` (taking reservations) sent a turn to `replica` within RESERVE_WINDOW_S."""
    sent = tx.reserving.get(dataplane)
    at = sent.get(replica) if sent is not None else None
    return at is not None and tx.now - at <= RESERVE_WINDOW_S


def _sent_there(tx: _Tx, dataplane: str, replica: str) -> None:
    """A turn of `dataplane` went to `replica` now: where it wants reservations, if it takes them."""
    sent = tx.reserving.get(dataplane)
    if sent is not None:
        tx.reserving = tx.reserving.set(dataplane, sent.set(replica, tx.now))


def _dataplane_left(tx: _Tx, e: DataplaneLeft, actions: list[Action]) -> None:
    if e.dataplane in tx.reserving:
        tx.reserving = tx.reserving.delete(e.dataplane)
    for reservation in list(tx.reservations.values()):
        if reservation.dataplane == e.dataplane:
            _end_turn(tx, reservation.reservation_id, e.at, False, touch=False)


_HANDLERS: dict[type, Callable[[_Tx, Any, list[Action]], None]] = {
    PoolConfigured: _pool_configured,
    ReplicaProbed: _replica_probed,
    TurnArrived: _turn_arrived,
    TurnStarted: _turn_started,
    FirstToken: _first_token,
    TurnCompleted: _turn_completed,
    TurnFailed: _turn_failed,
    TurnAbandoned: _turn_failed,
    RunEnded: _run_ended,
    Tick: _tick,
    Resynced: _resynced,
    ReservationsWanted: _reservations_wanted,
    ReservationUsed: _reservation_used,
    ReservationReturned: _reservation_returned,
    DataplaneLeft: _dataplane_left,
}


# --- replicas ---------------------------------------------------------------------------------


def _count_outcome(tx: _Tx, turn: Turn, failed: bool) -> None:
    """A placed turn ended on its replica, a success or a failure of the replica's own: counted
    toward ejecting it (outliers.py), which happens here unless it is the last in service."""
    if turn.status is not _PLACED or turn.replica is None or turn.caller == RESERVED_CALLER:
        return
    replica = tx.replicas.get(turn.replica)
    if replica is None:
        return
    record = outliers.turn_ended(replica.outlier, failed, tx.now)
    if failed and outliers.is_outlier(record) and _others_serve(tx, replica):
        record = outliers.eject(record, tx.now, replica.ejection_base_s)
        # The runs pinned there may go elsewhere now (`_choose`).
        tx.may_place = True
    tx.replicas = tx.replicas.set(replica.name, dataclasses.replace(replica, outlier=record))


def _others_serve(tx: _Tx, replica: Replica) -> bool:
    """Whether every model `replica` serves has another replica of its kind in service."""
    for model in replica.models:
        names = tx.serving.get((replica.kind, model), ())
        if not any(name != replica.name and tx.replicas[name].in_service for name in names):
            return False
    return True


def _refresh_router(tx: _Tx, name: str) -> None:
    """A router's load: the sums of its engines' last readings (None while none of them has one)."""
    router = tx.replicas[name]
    engines = [tx.replicas[n] for n in router.load_from if n in tx.replicas]
    running = [r.running for r in engines if r.running is not None]
    waiting = [r.waiting for r in engines if r.waiting is not None]
    router = dataclasses.replace(
        router, running=sum(running) if running else None, waiting=sum(waiting) if waiting else None
    )
    tx.replicas = tx.replicas.set(name, router)


# --- turns and runs: the only code that changes them, and with them the indexes ---------------


def _tracks_run(turn: Turn) -> bool:
    return lifecycle.keeps_run_state(turn.kind is _GENERATIVE, turn.run_id)


_pin = pinned_to


def _paused_at(run: Run | None) -> str | None:
    """Where an interactive run paused on a tool has room kept for it by batch, else None."""
    if (
        run is not None
        and run.phase is _PAUSED
        and run.service_class is _INTERACTIVE
        and run.kept_until is not None
    ):
        return run.replica
    return None


def _group(tx: _Tx, turn: Turn) -> Group:
    pin = _pin(tx.runs.get(turn.run_id)) if _tracks_run(turn) else None
    return Group(turn.kind, turn.model, pin, turn.service_class)


def _bump(counts: Map[str, int], key: str, delta: int) -> Map[str, int]:
    if not delta:
        return counts
    n = counts.get(key, 0) + delta
    return counts.set(key, n) if n else counts.delete(key)


def _set_run(tx: _Tx, run_id: str, new: Run | None) -> None:
    """Replaces (or with None, forgets) a run; moves its held turns when its pin changes."""
    old = tx.runs.get(run_id)
    was_paused, now_paused = _paused_at(old), _paused_at(new)
    if was_paused != now_paused:
        if was_paused is not None:
            tx.paused_by_replica = _bump(tx.paused_by_replica, was_paused, -1)
            tx.may_place = True
        if now_paused is not None:
            tx.paused_by_replica = _bump(tx.paused_by_replica, now_paused, 1)
    # `_paused_at` is not None only for a run: mypy cannot tell, and a check here would cost.
    old_kept = old.kept_until if was_paused is not None else None  # type: ignore[union-attr]
    new_kept = new.kept_until if now_paused is not None else None  # type: ignore[union-attr]
    if old_kept != new_kept:
        if old_kept is not None:
            tx.kept_order = tx.kept_order.remove((old_kept, run_id))
        if new_kept is not None:
            tx.kept_order = tx.kept_order.add((new_kept, run_id))
    if run_id not in tx.run_open:
        if old is not None:
            tx.quiet_order = tx.quiet_order.remove((old.last_activity, run_id))
        if new is not None:
            tx.quiet_order = tx.quiet_order.add((new.last_activity, run_id))
    old_hold = old.hold_until if old is not None else None
    new_hold = new.hold_until if new is not None else None
    if old_hold != new_hold:
        if old_hold is not None:
            tx.hold_order = tx.hold_order.remove((old_hold, run_id))
        if new_hold is not None:
            tx.hold_order = tx.hold_order.add((new_hold, run_id))
    tx.runs = tx.runs.set(run_id, new) if new is not None else tx.runs.delete(run_id)
    old_pin, new_pin = _pin(old), _pin(new)
    old_size = old.working_set if old is not None and old_pin is not None else 0
    new_size = new.working_set if new is not None and new_pin is not None else 0
    if old_pin != new_pin or old_size != new_size:
        # What the replicas hold for the gate: a run counts where it is pinned, by its size.
        if old_pin is not None:
            tx.held_kv = _bump(tx.held_kv, old_pin, -old_size)
            if old_pin != new_pin:
                tx.held_runs = _bump(tx.held_runs, old_pin, -1)
            if (old_pin != new_pin or new_size < old_size) and gate.known(tx.replicas[old_pin]):
                tx.may_place = True  # room for the gate (no other rule counts runs)
        if new_pin is not None:
            tx.held_kv = _bump(tx.held_kv, new_pin, new_size)
            if old_pin != new_pin:
                tx.held_runs = _bump(tx.held_runs, new_pin, 1)
    old_slot = old.slot if old_pin is not None else None  # type: ignore[union-attr]
    new_slot = new.slot if new_pin is not None else None  # type: ignore[union-attr]
    if old_slot != new_slot or (old_slot is not None and old_pin != new_pin):
        # The slots a slot engine's held runs keep their KV in (`_slot_for`).
        if old_slot is not None:
            assert old_pin is not None
            left = tx.held_slots.get(old_pin, frozenset()) - {old_slot}
            tx.held_slots = tx.held_slots.set(old_pin, left) if left else tx.held_slots.delete(old_pin)
        if new_slot is not None:
            assert new_pin is not None
            tx.held_slots = tx.held_slots.set(new_pin, tx.held_slots.get(new_pin, frozenset()) | {new_slot})
    if old_pin != new_pin:
        # Each lane of the run moves whole, by its first turn: O(log n) per lane, not per turn.
        for lane in tx.run_lanes.get(run_id, ()):
            head = tx.lanes[lane].first()[0]
            _unhold_lane(tx, lane, head, Group(lane.kind, lane.model, old_pin, lane.service_class))
            _hold_lane(tx, lane, head, Group(lane.kind, lane.model, new_pin, lane.service_class))


def _open(tx: _Tx, run_id: str, delta: int) -> None:
    """Counts a run's open turns; a run is in the quiet index exactly while it has none."""
    before = tx.run_open.get(run_id, 0)
    after = before + delta
    tx.run_open = tx.run_open.set(run_id, after) if after else tx.run_open.delete(run_id)
    run = tx.runs.get(run_id)
    if run is not None and (before == 0) != (after == 0):
        key = (run.last_activity, run_id)
        tx.quiet_order = tx.quiet_order.add(key) if after == 0 else tx.quiet_order.remove(key)


def _add_turn(tx: _Tx, turn: Turn, charge: int = 0) -> None:
    tx.turns = tx.turns.set(turn.turn_id, turn)
    _open(tx, turn.run_id, 1)
    if turn.status is _HELD:
        _hold(tx, turn, _group(tx, turn))
    else:
        _count_placed(tx, turn, 1, charge)


def _charge(tx: _Tx, turn: Turn, run: Run | None) -> int:
    """The engine tokens a turn's placement adds to its caller's attained service (fairness.py):
    its run's working set (`run`: the turn's, None for a turn outside one), or for a turn outside
    a run or of a run not yet sized, its estimate."""
    if run is not None and run.working_set > 0:
        return run.working_set
    return gate.estimated_working_set(turn.request_bytes, turn.max_tokens, tx.tokens_per_byte.get(turn.model))


def _end_turn(
    tx: _Tx,
    turn_id: str,
    at: float,
    paused_on_tool: bool,
    *,
    touch: bool = True,
    freed_engine_room: bool = False,
    working_set: int | None = None,
) -> Turn | None:
    """Removes a turn (held or placed) and moves its run to the phase `lifecycle.phase_after_turn`
    gives (`paused_on_tool`: it completed in tool calls).

    `freed_engine_room`: the turn ran to its end in the engine, so the engine has room for the
    next of ours in its queue (see `_confirm_next`).
    """
    turn = tx.turns.get(turn_id)
    if turn is None:
        return None  # already gone: expired, resynced away, or never ours
    if turn.caller == RESERVED_CALLER and turn_id in tx.reservations:
        tx.reservations = tx.reservations.delete(turn_id)
    tracked = _tracks_run(turn)
    if turn.status is _HELD:
        group = _group(tx, turn)
        _unhold(tx, turn, group)
        if group.pin is None:
            # The turn behind it in its group may fit where it did not (see `_choose`).
            tx.may_place = True
    else:
        _count_placed(tx, turn, -1)
        if freed_engine_room or turn.confirmed:
            assert turn.replica is not None
            _confirm_next(tx, turn.replica)
    tx.turns = tx.turns.delete(turn_id)
    run = tx.runs.get(turn.run_id) if tracked else None
    if run is not None:
        if working_set is not None:
            run = run.sized(working_set)
        phase = lifecycle.phase_after_turn(paused_on_tool, others_running=turn.run_id in tx.run_placed)
        paused = phase is _PAUSED
        kept_until = at + admission.keep_paused_for(tx.pause_estimate.get(run.caller)) if paused else None
        hold_until = _hold_until(tx, run, at) if paused else None
        ended = run.turn_ended(phase, at if touch else run.last_activity, kept_until, hold_until)
        # A caller whose tools take longer than a place is kept for lets go at once.
        _set_run(tx, run.run_id, ended.let_go() if hold_until is not None and hold_until <= at else ended)
    # Uncounted after the run is updated, so a run going quiet enters the quiet index once.
    _open(tx, turn.run_id, -1)
    return turn


def _hold_until(tx: _Tx, run: Run, at: float) -> float | None:
    """Until when `run`, paused at `at`, keeps its place on its replica; None where the gate is off
    there for a run of its size (`gate.gated`): it keeps its place, as without the gate."""
    known = tx.replicas.get(run.replica) if run.replica is not None else None
    if known is None or not gate.gated(known, run.working_set):
        return None
    return at + gate.hold_for(tx.pause_samples.get(run.caller, ()))


def _count_placed(tx: _Tx, turn: Turn, delta: int, charge: int = 0) -> None:
    """Adds (1) or removes (-1) a placed turn from the in-flight counts and the timeout index;
    `charge`: the engine tokens its placement adds to its caller's attained service."""
    assert turn.replica is not None and turn.placed_at is not None
    tx.in_flight_by_replica = _bump(tx.in_flight_by_replica, turn.replica, delta)
    attained = tx.attained.get(turn.caller, fairness.NONE)
    if charge > 0:
        attained = fairness.attain(attained, charge, tx.now)
    _set_caller_standing(tx, turn.caller, tx.in_flight_by_caller.get(turn.caller, 0) + delta, attained)
    key = (turn.placed_at, turn.seq, turn.turn_id)
    if turn.caller != RESERVED_CALLER:
        # A reservation lasts as long as its dataplane's stream, however quiet: it never times out.
        tx.placed_order = tx.placed_order.add(key) if delta > 0 else tx.placed_order.remove(key)
    if _tracks_run(turn):
        tx.run_placed = _bump(tx.run_placed, turn.run_id, delta)
    if not turn.confirmed:
        replica = tx.replicas.get(turn.replica)
        if replica is not None and not admission.uncapped(replica):
            _set_unconfirmed(tx, turn, delta > 0)


def _set_unconfirmed(tx: _Tx, turn: Turn, present: bool) -> None:
    """Counts a placed turn among its replica's unconfirmed ones (present) or no longer."""
    replica = turn.replica
    assert replica is not None and turn.placed_at is not None
    if not present:
        tx.may_place = True
    # Keyed in the order the turns went out, which is their order in the engine's queue: what
    # `_confirm_next` (its head) and `_confirm_by_reading` (the newest still there) rely on. A
    # turn held longer goes out after turns that arrived after it.
    key = (turn.placed_at, turn.seq, turn.turn_id)
    waiting = tx.unconfirmed.get(replica, EMPTY)
    waiting = waiting.add(key) if present else waiting.remove(key)
    tx.unconfirmed = tx.unconfirmed.set(replica, waiting) if waiting else tx.unconfirmed.delete(replica)
    if turn.service_class is _INTERACTIVE:
        tx.unconfirmed_interactive = _bump(tx.unconfirmed_interactive, replica, 1 if present else -1)


def _confirm(tx: _Tx, turn: Turn) -> None:
    """The engine has started `turn`: it no longer counts against its replica's lookahead."""
    assert turn.replica is not None and turn.placed_at is not None
    tx.turns = tx.turns.set(turn.turn_id, turn.started())
    replica = tx.replicas[turn.replica]
    if admission.uncapped(replica):
        return  # an uncapped replica's turns are never counted as waiting (see `_count_placed`)
    _set_unconfirmed(tx, turn, False)
    if replica.others_waiting and (replica.read_at is None or turn.placed_at > replica.read_at):
        # Sent after the reading and started: whatever queued ahead of it then has started too.
        tx.replicas = tx.replicas.set(replica.name, dataclasses.replace(replica, others_waiting=0))


def _confirm_next(tx: _Tx, replica: str) -> None:
    """A turn of ours finished on `replica`: the oldest of ours waiting there is what its engine
    starts next. Only a turn whose reply is not streamed is confirmed this way, or any turn on a
    slot engine (`_confirm_on_a_free_slot`); a streamed one says so itself with its first token,
    exactly, but only after its prefill."""
    waiting = tx.unconfirmed.get(replica)
    if not waiting:
        return
    turn = tx.turns[waiting.first()[-1]]
    if turn.streamed is False or tx.replicas[replica].kv_slots is not None:
        _confirm(tx, turn)


def _confirm_on_a_free_slot(tx: _Tx, turn: Turn, replica: Replica) -> None:
    """A slot engine (llama.cpp: `kv_slots`) starts a request the moment it has a free slot, and
    it has one while our turns there are no more than its slots and its last reading showed
    nothing of others' queued: the turn just placed is running, not waiting. Counting it as
    waiting until its first token would leave a slot idle through each prefill, which on such an
    engine is the longest part of a turn. Another client's requests running there take slots
    this cannot see; its probes correct the count (`_confirm_by_reading`)."""
    slots = replica.kv_slots
    if slots is None or replica.others_waiting or admission.uncapped(replica):
        return
    if tx.in_flight_by_replica.get(replica.name, 0) <= slots:
        _confirm(tx, turn)


def _confirm_by_reading(tx: _Tx, name: str, sent_at: float) -> None:
    """A load reading of `name`: of our turns placed before it was asked for, all but the newest
    `waiting` of them are running (see `admission.still_waiting`)."""
    waiting = tx.unconfirmed.get(name)
    sent = [tx.turns[turn_id] for _, _, turn_id in waiting] if waiting else []
    sent = [t for t in sent if t.placed_at is not None and t.placed_at <= sent_at]
    replica = tx.replicas[name]
    keep = admission.still_waiting(len(sent), replica.waiting)
    others = admission.others_waiting(len(sent), replica.waiting)
    if others != replica.others_waiting or replica.read_at != sent_at:
        tx.replicas = tx.replicas.set(
            name, dataclasses.replace(replica, others_waiting=others, read_at=sent_at)
        )
    for turn in sent[: len(sent) - keep]:
        _confirm(tx, turn)


def _standing(tx: _Tx, caller: str) -> tuple[float, int]:
    """Where `caller` stands in the drain's order: the least attained service first, then the
    fewest turns in flight (fairness.py)."""
    return (tx.attained.get(caller, fairness.NONE), tx.in_flight_by_caller.get(caller, 0))


def _set_caller_standing(tx: _Tx, caller: str, count: int, attained: float) -> None:
    """Changes a caller's in-flight count and attained service and re-keys it in every group
    where it has turns held."""
    before = _standing(tx, caller)
    tx.in_flight_by_caller = (
        tx.in_flight_by_caller.set(caller, count) if count else tx.in_flight_by_caller.delete(caller)
    )
    if attained != before[0]:
        tx.attained = tx.attained.set(caller, attained)
    after = (attained, count)
    if after == before:
        return
    for group in tx.caller_groups.get(caller, ()):
        head = tx.held_queues[(group, caller)].first()[0]
        callers = tx.held_groups[group].replace((before, head, caller), (after, head, caller))
        tx.held_groups = tx.held_groups.set(group, callers)


def _lane(turn: Turn) -> Lane:
    return Lane(turn.run_id, turn.kind, turn.model, turn.service_class, turn.caller)


def _hold(tx: _Tx, turn: Turn, group: Group) -> None:
    """Puts a held turn in its lane; a new first turn of the lane stands for it in its group."""
    lane = _lane(turn)
    queue = tx.lanes.get(lane)
    if queue is None:
        tx.lanes = tx.lanes.set(lane, EMPTY.add((turn.seq, turn.turn_id)))
        if _tracks_run(turn):
            tx.run_lanes = tx.run_lanes.set(turn.run_id, (*tx.run_lanes.get(turn.run_id, ()), lane))
        _hold_lane(tx, lane, turn.seq, group)
        return
    head = queue.first()[0]
    tx.lanes = tx.lanes.set(lane, queue.add((turn.seq, turn.turn_id)))
    if turn.seq < head:
        _unhold_lane(tx, lane, head, group)
        _hold_lane(tx, lane, turn.seq, group)


def _unhold(tx: _Tx, turn: Turn, group: Group) -> None:
    """Takes a held turn out of its lane; the lane's next turn, if any, stands for it from now on."""
    lane = _lane(turn)
    queue = tx.lanes[lane]
    head = queue.first()[0]
    queue = queue.remove((turn.seq, turn.turn_id))
    if not queue:
        tx.lanes = tx.lanes.delete(lane)
        if _tracks_run(turn):
            rest = tuple(x for x in tx.run_lanes[turn.run_id] if x != lane)
            tx.run_lanes = tx.run_lanes.set(turn.run_id, rest) if rest else tx.run_lanes.delete(turn.run_id)
        _unhold_lane(tx, lane, head, group)
        return
    tx.lanes = tx.lanes.set(lane, queue)
    if turn.seq == head:
        _move_lane_head(tx, lane, head, queue.first()[0], group)


def _move_lane_head(tx: _Tx, lane: Lane, head: int, new_head: int, group: Group) -> None:
    """A lane that stays in `group` is now stood for by a later turn (`new_head`, after `head`):
    `_unhold_lane` then `_hold_lane`, in one change of each index. The group gains no turn that
    could go anywhere its other turns could not, so it has not `entered` anywhere."""
    caller = lane.caller
    key = (group, caller)
    queue = tx.held_queues[key]
    first = queue.first()[0]
    queue = queue.replace((head, lane), (new_head, lane))
    tx.held_queues = tx.held_queues.set(key, queue)
    if head == first:
        # The lane stood for its caller in the group; whichever lane is first now does.
        count = _standing(tx, caller)
        callers = tx.held_groups[group].replace((count, first, caller), (count, queue.first()[0], caller))
        tx.held_groups = tx.held_groups.set(group, callers)


def _hold_lane(tx: _Tx, lane: Lane, head: int, group: Group) -> None:
    """Enters a lane, by its first turn's seq, in its group's queue for its caller."""
    tx.entered.append(group)
    caller = lane.caller
    key = (group, caller)
    queue = tx.held_queues.get(key)
    count = _standing(tx, caller)
    callers = tx.held_groups.get(group, EMPTY)
    if queue is None:
        tx.held_queues = tx.held_queues.set(key, EMPTY.add((head, lane)))
        tx.caller_groups = tx.caller_groups.set(caller, tx.caller_groups.get(caller, frozenset()) | {group})
        callers = callers.add((count, head, caller))
    else:
        first = queue.first()[0]
        tx.held_queues = tx.held_queues.set(key, queue.add((head, lane)))
        if head < first:
            callers = callers.replace((count, first, caller), (count, head, caller))
    tx.held_groups = tx.held_groups.set(group, callers)


def _unhold_lane(tx: _Tx, lane: Lane, head: int, group: Group) -> None:
    caller = lane.caller
    key = (group, caller)
    queue = tx.held_queues[key]
    first = queue.first()[0]
    queue = queue.remove((head, lane))
    count = _standing(tx, caller)
    callers = tx.held_groups[group]
    if not queue:
        tx.held_queues = tx.held_queues.delete(key)
        left = tx.caller_groups[caller] - {group}
        tx.caller_groups = tx.caller_groups.set(caller, left) if left else tx.caller_groups.delete(caller)
        callers = callers.remove((count, first, caller))
    else:
        tx.held_queues = tx.held_queues.set(key, queue)
        if head == first:
            callers = callers.replace((count, first, caller), (count, queue.first()[0], caller))
    tx.held_groups = tx.held_groups.set(group, callers) if callers else tx.held_groups.delete(group)


def _rebuild(tx: _Tx, runs: list[Run], turns: list[Turn]) -> None:
    """Replaces every run and turn, rebuilding the indexes from nothing (pool change, resync)."""
    tx.runs = Map()
    tx.turns = Map()
    tx.in_flight_by_replica = Map()
    tx.in_flight_by_caller = Map()
    tx.paused_by_replica = Map()
    tx.held_queues = Map()
    tx.held_groups = Map()
    tx.caller_groups = Map()
    tx.lanes = Map()
    tx.run_lanes = Map()
    tx.run_open = Map()
    tx.run_placed = Map()
    tx.placed_order = tx.quiet_order = EMPTY
    tx.unconfirmed = Map()
    tx.unconfirmed_interactive = Map()
    tx.kept_order = EMPTY
    tx.held_kv = Map()
    tx.held_runs = Map()
    tx.held_slots = Map()
    tx.hold_order = EMPTY
    for run in runs:
        _set_run(tx, run.run_id, run)
    for turn in turns:
        _add_turn(tx, turn)
    # A reservation lasts exactly as long as its placeholder (a resync drops its dataplane's).
    if tx.reservations:
        tx.reservations = Map({k: r for k, r in tx.reservations.items() if k in tx.turns})


# --- placement --------------------------------------------------------------------------------


def _room_of(tx: _Tx, replica: Replica, spare: int = 0) -> tuple[bool, bool]:
    """Whether `replica` has room for (an interactive turn, a batch turn): `admission.room` over
    the counts the indexes keep; with `spare`, room left beside that many more turns of ours."""
    name = replica.name
    waiting = tx.unconfirmed.get(name)
    others = replica.others_waiting
    return admission.room(
        replica,
        (len(waiting) if waiting is not None else 0) + others + spare,
        tx.unconfirmed_interactive.get(name, 0) + others,
        tx.paused_by_replica.get(name, 0),
    )


def _rooms(tx: _Tx) -> tuple[list[str], list[str]]:
    """The replicas with room for an interactive turn, and those with room for a batch one, in
    config order. The batch list is always within the interactive one."""
    interactive: list[str] = []
    batch: list[str] = []
    for replica in tx.replicas.values():
        for_interactive, for_batch = _room_of(tx, replica)
        if for_interactive:
            interactive.append(replica.name)
            if for_batch:
                batch.append(replica.name)
    return interactive, batch


def _choose(tx: _Tx, group: Group, room: list[str]) -> Replica | None:
    """Where a turn of `group` goes now, given the replicas with room for its class; None: it waits."""
    kind, model, pin, _ = group
    names = tx.serving.get((kind, model), ())
    if pin is not None and pin in names and tx.replicas[pin].in_service:
        return tx.replicas[pin] if pin in room else None
    # A run not held anywhere goes only where it fits beside the runs held there (gate.py); its
    # size is looked up only for a replica whose pool is known.
    size: int | None = -1
    best: str | None = None
    best_load = 0
    for name in names:
        if name in room:
            replica = tx.replicas[name]
            if gate.known(replica):
                if size == -1:
                    size = _head_working_set(tx, group)
                if size is not None and not gate.fits(
                    replica, tx.held_kv.get(name, 0), tx.held_runs.get(name, 0), size
                ):
                    continue
            load = tx.in_flight_by_replica.get(name, 0)
            if best is None or load < best_load:
                best, best_load = name, load
    return tx.replicas[best] if best is not None else None


def _head_working_set(tx: _Tx, group: Group) -> int | None:
    """The working set of the run of the turn `group` would place next, None when that turn
    belongs to no run (the gate admits runs; a turn outside one passes)."""
    callers = tx.held_groups.get(group)
    if callers is None:
        return None
    lane = tx.held_queues[(group, callers.first()[2])].first()[1]
    run = tx.runs.get(lane.run_id) if lane.kind is _GENERATIVE and lane.run_id else None
    return run.working_set if run is not None else None


def _entered_may_place(tx: _Tx, room_interactive: list[str], room_batch: list[str]) -> bool:
    """Whether a group that gained a lane in this decision could place its turn now. Only those
    groups can: every other held turn had nowhere to go after the last decision, and no room grew."""
    if not room_interactive:
        return False
    for group in tx.entered:
        if group in tx.held_groups:
            room = room_batch if group.service_class is _BATCH else room_interactive
            if room and _choose(tx, group, room) is not None:
                return True
    return False


def _drain(tx: _Tx, actions: list[Action], room_interactive: list[str], room_batch: list[str]) -> None:
    """Places held turns, one at a time, the first in drain order that has somewhere to go.

    Each group's first key is its best turn: (caller's standing, arrival). Across groups,
    interactive goes before batch. A group whose best turn cannot be placed has no turn that
    can, so it is passed over whole. Placing a turn changes its caller's count, and so the
    order, which is why each round starts again from the indexes. A placement only takes room
    away (from the replica it went to), so a group found with nowhere to go stays so for the
    rest of the drain: the first round looks at every group, the later ones only at those that
    could still place (or were not looked at) and those a lane entered meanwhile; when room did
    grow somewhere (a paused run's kept room given up elsewhere), the next round looks at all
    again. A saturated pool ends the drain at once. `room_interactive` and `room_batch` are
    `_rooms(tx)` as the decision left them.
    """
    looking: Iterable[Group] | None = None  # None: every held group
    while True:
        if not room_interactive:
            return
        best_key: tuple[bool, tuple[float, int], int] | None = None
        best: tuple[Group, str, Replica] | None = None
        still: list[Group] = []
        groups = tx.held_groups
        for group in groups if looking is None else looking:
            callers = groups.get(group)
            if callers is None:
                continue
            batch = group.service_class is _BATCH
            if batch and not room_batch:
                continue
            count, seq, caller = callers.first()
            key = (batch, count, seq)
            if best_key is not None and key >= best_key:
                still.append(group)  # not looked at: it may have somewhere to go
                continue
            replica = _choose(tx, group, room_batch if batch else room_interactive)
            if replica is not None:
                still.append(group)
                best_key, best = key, (group, caller, replica)
        if best is None:
            return
        group, caller, replica = best
        lane = tx.held_queues[(group, caller)].first()[1]
        turn = tx.turns[tx.lanes[lane].first()[1]]
        kept_at = _paused_at(tx.runs.get(turn.run_id)) if _tracks_run(turn) else None
        entered = len(tx.entered)
        slot = _place(tx, turn, group, replica)
        actions.append(
            Place(turn.turn_id, turn.run_id, replica.name, replica.url, tx.now - turn.arrived_at, slot=slot)
        )
        looking = {*still, *tx.entered[entered:]}
        name = replica.name
        if kept_at is not None and kept_at != name:
            # A paused run's turn went elsewhere: batch gets back the room it kept on `kept_at`.
            room_interactive, room_batch = _rooms(tx)
            looking = None
            continue
        # Only the room of the replica the turn went to changed, and only downwards.
        for_interactive, for_batch = _room_of(tx, tx.replicas[name])
        if not for_interactive and name in room_interactive:
            room_interactive = [n for n in room_interactive if n != name]
        if not for_batch and name in room_batch:
            room_batch = [n for n in room_batch if n != name]


def _place(tx: _Tx, turn: Turn, group: Group, replica: Replica) -> int | None:
    """Places a held turn on `replica`; returns the slot its request names (`_slot_for`)."""
    _unhold(tx, turn, group)
    # Renumbered in the order turns go out, which is the engine's queue order even among turns
    # placed in one decision, where fairness may send a later arrival first.
    placed = turn.placed_on(replica.name, tx.now, tx.next_seq)
    tx.next_seq += 1
    tx.turns = tx.turns.set(turn.turn_id, placed)
    run = tx.runs.get(turn.run_id) if _tracks_run(turn) else None
    _count_placed(tx, placed, 1, _charge(tx, placed, run))
    _confirm_on_a_free_slot(tx, placed, replica)
    if run is None:
        return None
    # A paused interactive run coming back turns its kept slot into a turn (see `_set_run`).
    slot = _slot_for(tx, run, replica)
    _set_run(tx, run.run_id, run.placed_on(replica.name, tx.now, slot))
    return slot


def _slot_for(tx: _Tx, run: Run, replica: Replica) -> int | None:
    """The slot of `replica` that `run`, placed there now, keeps its KV in: the one it has where it
    is held there already, else the lowest that no run held there has (`gate.names_slots`: on a
    slot engine the gate holds runs on; None elsewhere, or where none is free). Named in the
    request, it keeps the engine from giving a new run the slot of a run paused on its tool:
    llama.cpp picks an idle slot by prompt similarity, and every run's prompt opens alike."""
    slots = replica.kv_slots
    if slots is None or not gate.names_slots(replica):
        return None
    if run.slot is not None and _pin(run) == replica.name:
        return run.slot
    taken = tx.held_slots.get(replica.name, frozenset())
    return next((n for n in range(slots) if n not in taken), None)


def _slot_of(tx: _Tx, turn: Turn) -> int | None:
    """The slot a placed turn's request names (its run's, on the replica it went to)."""
    run = tx.runs.get(turn.run_id) if _tracks_run(turn) else None
    return run.slot if run is not None and run.replica == turn.replica else None


# --- reservations -----------------------------------------------------------------------------


def _reserve(tx: _Tx, actions: list[Action], grant: bool = True) -> None:
    """Sets room aside for dataplanes while nothing is held, and takes it back when something is.

    A turn admitted the usual way waits a round trip to the scheduler before its engine request
    goes out, though while nothing is held the answer is foregone: the run's replica, if it has
    room. So a dataplane that asks for reservations (`ReservationsWanted`) gets reservations on
    each replica its turns have been placed on, while that replica has room for a batch turn
    (the stricter class) and nothing is held anywhere: one at a time to each dataplane in turn,
    at most the replica's lookahead each, and where more than one dataplane wants them never
    the replica's last turn of room, which stays free for whichever asks. A dataplane wants them
    where one of its turns went within `RESERVE_WINDOW_S`; one that has sent nothing there for
    that long has its reservations there revoked and gets none until a turn of its goes there
    again, so room does not sit with a dataplane that has stopped sending there. A reservation
    is counted by a placeholder turn, placed, unconfirmed and interactive, so it takes room from
    both classes and the replica's room is what it would be had a turn of either class been
    placed there. The dataplane sends
    a turn of a run that last ran there straight to it and reports the reservation used; the
    turn then takes its placeholder's place, and the decision grants another if there is room.
    A turn it cannot send on one (a run it does not know, another replica's) it admits the usual
    way, giving back first, in the same message, its reservations on replicas serving the turn's
    model; and while only its turns are held, one that its own dataplane holds a reservation for
    where it may go (granted while the turn was on its way) takes that reservation's room, the
    placement naming it: its own reservations never keep a dataplane's turns waiting.

    Once a turn is held, every reservation is revoked (`Revoked`), and so is one on a replica
    that turned unhealthy: it still counts until its dataplane gives it back or reports it used,
    whichever its message says first, so room is never counted twice; the held turn is placed
    when the room comes back. A dataplane's reservations end with its stream (`DataplaneLeft`)
    or its resync, never by the turn timeout (a revoked one counts until given back), and one
    whose replica leaves the pool is revoked as it goes.
    """
    for action in actions:
        if type(action) is Place:
            turn = tx.turns.get(action.turn_id)
            if turn is not None and turn.kind is _GENERATIVE:
                _sent_there(tx, turn.dataplane, action.replica)
    held = bool(tx.held_groups)
    if held and not tx.reservations:
        return  # the usual case under load: nothing to revoke, nothing to grant
    if held and any(not r.revoked for r in tx.reservations.values()):
        _take_own_reservations(tx, actions)
        held = bool(tx.held_groups)
    revoke: dict[str, list[str]] = {}
    for reservation in tx.reservations.values():
        if not reservation.revoked and (
            held
            or not tx.replicas[reservation.replica].in_service
            or not _wants(tx, reservation.dataplane, reservation.replica)
        ):
            revoke.setdefault(reservation.dataplane, []).append(reservation.reservation_id)
    for dataplane in sorted(revoke):
        ids = sorted(revoke[dataplane])
        for reservation_id in ids:
            tx.reservations = tx.reservations.set(
                reservation_id, tx.reservations[reservation_id]._replace(revoked=True)
            )
        actions.append(Revoked(dataplane, tuple(ids)))
    if held or not grant or not tx.reserving:
        return
    # Per dataplane, the replicas where it wants room.
    wanting = [
        (dataplane, {name for name in sent if _wants(tx, dataplane, name)})
        for dataplane, sent in sorted(tx.reserving.items())
    ]
    have: dict[tuple[str, str], int] = {}
    for r in tx.reservations.values():
        have[(r.dataplane, r.replica)] = have.get((r.dataplane, r.replica), 0) + 1
    # Where several dataplanes want room, a turn's worth is left free for whichever asks.
    contested: set[str] = set()
    seen: set[str] = set()
    for _, wanted in wanting:
        contested |= seen & wanted
        seen |= wanted
    # In rounds, one reservation per dataplane and replica each, while there is room: dataplanes
    # share a replica's room, and none holds more than its lookahead (one where it is uncapped).
    granted = True
    while granted:
        granted = False
        for dataplane, wanted in wanting:
            for name in tx.order:
                if name not in wanted:
                    continue
                replica = tx.replicas[name]
                if (
                    have.get((dataplane, name), 0) >= max(replica.lookahead, 1)
                    or not _room_of(tx, replica, 1 if name in contested else 0)[1]
                ):
                    continue
                reservation_id = f"reservation-{tx.next_seq}"
                _add_turn(
                    tx,
                    Turn(
                        reservation_id, "", _INTERACTIVE, RESERVED_CALLER, "", _GENERATIVE, tx.now, tx.next_seq,
                        _PLACED, name, tx.now, dataplane=dataplane,
                    ),
                )  # fmt: skip
                tx.next_seq += 1
                tx.reservations = tx.reservations.set(
                    reservation_id, Reservation(reservation_id, dataplane, name)
                )
                have[(dataplane, name)] = have.get((dataplane, name), 0) + 1
                actions.append(
                    Reserved(reservation_id, dataplane, name, replica.url, tuple(sorted(replica.models)))
                )
                granted = True


def _take_own_reservations(tx: _Tx, actions: list[Action]) -> None:
    """While the turns held are all one dataplane's, those it holds a reservation (not revoked)
    for where they may go are placed on its room, in drain order (see `_reserve`): no other
    dataplane's turn waits for that room."""
    held = [t for t in tx.turns.values() if t.status is _HELD]
    if len({t.dataplane for t in held}) != 1:
        return
    for turn in sorted(held, key=lambda t: (t.service_class is _BATCH, t.seq)):
        group = _group(tx, turn)
        serving = tx.serving.get((turn.kind, turn.model), ())
        for reservation in tx.reservations.values():
            if (
                reservation.dataplane == turn.dataplane
                and not reservation.revoked
                and reservation.replica in serving
                and (group.pin is None or group.pin == reservation.replica)
                and tx.replicas[reservation.replica].in_service
            ):
                _end_turn(tx, reservation.reservation_id, tx.now, False, touch=False)
                replica = tx.replicas[reservation.replica]
                _place(tx, turn, group, replica)
                actions.append(
                    Place(turn.turn_id, turn.run_id, replica.name, replica.url, tx.now - turn.arrived_at,
                          reservation.reservation_id)
                )  # fmt: skip
                break
