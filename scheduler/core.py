"""The scheduler's decisions: `decide(state, event) -> (state, actions)`, and nothing else.

Theory of operation
-------------------

The scheduler answers one question, "where does this turn go, and when?", for a pool of
replicas it does not own and runs it only hears about. It does no I/O, reads no clock and draws
no random numbers: everything it knows arrives as an event (`events.py`), stamped with the time
it happened, and everything it wants done leaves as an action (`actions.py`). The gRPC host, the
prober and the clock (`host.py`, `prober.py`) translate between the world and these two
vocabularies; the simulator feeds the same function in virtual time. Feeding the same events to
the same state gives the same actions, always: replaying a recorded log reproduces every decision.

There are three kinds of thing, each with a small state machine:

  Replica   healthy or not (as last probed; unprobed counts as healthy, so a fresh stack serves at
            once and the first failed probe takes it out), with the engine's load as last read:
            `running` and `waiting`. While the engine queues nothing, a replica takes turns; once
            it reports a queue, our turns in flight there are capped at what it runs. A replica
            whose engine reports no load is never capped.

  Run       IDLE -> GENERATING when one of its turns is placed;
            GENERATING -> PAUSED when that turn completes in tool calls (the run will be back,
            and its prefix is cached on that replica); -> IDLE when it completes otherwise,
            fails, or is abandoned (a failed turn never leaves its run paused, so a retry is
            admitted like any next turn). A run is forgotten when it ends or has been quiet
            for RUN_IDLE_EXPIRY_S.

  Turn      arrives -> refused at once when no replica of its kind serves its model at all;
            otherwise HELD -> PLACED (an Admit answered) -> gone when reported completed, failed
            or abandoned, or dropped after TURN_TIMEOUT_S without a report. A held turn can also
            be abandoned (its client cancelled the Admit).

Placement. A held turn may go to a healthy replica of its kind that serves its model. A run that
is GENERATING or PAUSED may go only to its last replica, while that replica is healthy and serves
the model, even when others have room: that is where its KV cache is. A replica has room when it
is uncapped or our turns there are below its cap; a batch turn must also leave one slot free for
each interactive run paused on a tool there. Of the replicas with room, the one with the fewest
of our turns in flight wins; ties go to config order.

Draining. Whenever room may have appeared (a turn arrived or ended, a probe, a resync, a tick that
expired something), held turns are tried in order: interactive before batch, then the caller with
the fewest turns in flight (so one caller's flood cannot starve another), then arrival. A turn
that cannot be placed (its pinned replica is full) does not block the ones behind it. The order is
re-evaluated after each placement, since placing a turn changes its caller's count.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from immutables import Map

from luftpause.scheduler.actions import Action, Place, Refuse, RunForgotten, TurnExpired
from luftpause.scheduler.events import (
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    Resynced,
    RunEnded,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, Phase, Replica, Run, ServiceClass, State, Turn, TurnStatus

# A placed turn whose end is never reported (the dataplane crashed mid-turn) is dropped after this.
TURN_TIMEOUT_S = 600.0
# A run with no turn for this long is forgotten; its next turn starts without affinity.
RUN_IDLE_EXPIRY_S = 1800.0

Decision = tuple[State, tuple[Action, ...]]


def decide(state: State, event: Event) -> Decision:
    """The one entry point: the state after `event`, and what the host must do about it."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"decide: not a scheduler event: {event!r}")
    # Events from different sources (prober, clock, Admit) may be stamped slightly out of order;
    # the state's clock only moves forward.
    state = dataclasses.replace(state, now=max(state.now, event.at))
    state, actions = handler(state, event)
    return state, tuple(actions)


def refusal_message(kind: Kind, model: str) -> str:
    """What a client sees when no replica of `kind` serves `model` (404 at the dataplane)."""
    return f"no {kind.title} replica serves model '{model}'"


# --- event handlers ---------------------------------------------------------------------------


def _pool_configured(state: State, e: PoolConfigured) -> tuple[State, list[Action]]:
    replicas: dict[str, Replica] = {}
    for spec in e.replicas:
        old = state.replicas.get(spec.name)
        fresh = Replica(
            name=spec.name,
            url=spec.url,
            kind=spec.kind,
            models=frozenset(spec.models),
            reports_load=spec.reports_load,
            load_from=spec.load_from,
        )
        if old is not None:
            # A replica that stays in the pool keeps what its probes said.
            fresh = dataclasses.replace(
                fresh, healthy=old.healthy, probed=old.probed, running=old.running, waiting=old.waiting
            )
        replicas[spec.name] = fresh
    state = dataclasses.replace(state, replicas=Map(replicas), order=tuple(s.name for s in e.replicas))

    actions: list[Action] = []
    turns = state.turns.mutate()
    for turn in sorted(state.turns.values(), key=lambda t: t.seq):
        if turn.status is TurnStatus.PLACED and turn.replica not in replicas:
            del turns[turn.turn_id]  # its replica left the pool: nothing to count it against
        elif turn.status is TurnStatus.HELD and not _serving(state, turn.kind, turn.model):
            del turns[turn.turn_id]
            actions.append(Refuse(turn.turn_id, turn.run_id, refusal_message(turn.kind, turn.model)))
    state = dataclasses.replace(state, turns=turns.finish())
    return _drain(state, actions)


def _replica_probed(state: State, e: ReplicaProbed) -> tuple[State, list[Action]]:
    replica = state.replicas.get(e.name)
    if replica is None:
        return state, []
    # A probe that could not read the load leaves the last reading standing: forgetting it would
    # uncap a queueing engine because of one lost /metrics answer.
    replica = dataclasses.replace(
        replica,
        healthy=e.healthy,
        probed=True,
        running=e.running if e.running is not None else replica.running,
        waiting=e.waiting if e.waiting is not None else replica.waiting,
    )
    state = dataclasses.replace(state, replicas=state.replicas.set(e.name, replica))
    return _drain(state, [])


def _turn_arrived(state: State, e: TurnArrived) -> tuple[State, list[Action]]:
    known = state.turns.get(e.turn_id)
    if known is not None:
        # A retried admission: a placed turn gets its placement again; a held one keeps waiting.
        if known.status is TurnStatus.PLACED:
            assert known.replica is not None and known.placed_at is not None
            url = state.replicas[known.replica].url
            return state, [
                Place(known.turn_id, known.run_id, known.replica, url, known.placed_at - known.arrived_at)
            ]
        return state, []
    if not _serving(state, e.kind, e.model):
        return state, [Refuse(e.turn_id, e.run_id, refusal_message(e.kind, e.model))]

    turn = Turn(
        turn_id=e.turn_id,
        run_id=e.run_id,
        service_class=e.service_class,
        caller=e.caller,
        model=e.model,
        kind=e.kind,
        arrived_at=e.at,
        seq=state.next_seq,
    )
    state = dataclasses.replace(state, turns=state.turns.set(e.turn_id, turn), next_seq=state.next_seq + 1)
    if _tracks_run(turn):
        run = state.runs.get(e.run_id)
        if run is None:
            run = Run(e.run_id, e.service_class, e.caller, last_activity=e.at)
        else:
            # The class and caller are per turn; the run carries the latest.
            run = dataclasses.replace(run, service_class=e.service_class, caller=e.caller, last_activity=e.at)
        state = dataclasses.replace(state, runs=state.runs.set(e.run_id, run))
    return _drain(state, [])


def _turn_progressed(state: State, e: TurnStarted | FirstToken) -> tuple[State, list[Action]]:
    return _touch_run(state, e.run_id, e.at), []


def _turn_completed(state: State, e: TurnCompleted) -> tuple[State, list[Action]]:
    return _end_turn(state, e.turn_id, e.at, Phase.PAUSED if e.paused_on_tool else Phase.IDLE)


def _turn_failed(state: State, e: TurnFailed | TurnAbandoned) -> tuple[State, list[Action]]:
    return _end_turn(state, e.turn_id, e.at, Phase.IDLE)


def _run_ended(state: State, e: RunEnded) -> tuple[State, list[Action]]:
    if e.run_id not in state.runs:
        return state, []
    # Its turns still open stay counted: they hold engine slots until reported done.
    return dataclasses.replace(state, runs=state.runs.delete(e.run_id)), [RunForgotten(e.run_id, "ended")]


def _tick(state: State, e: Tick) -> tuple[State, list[Action]]:
    actions: list[Action] = []
    expired = sorted(
        (t for t in state.placed() if t.placed_at is not None and e.at - t.placed_at >= TURN_TIMEOUT_S),
        key=lambda t: t.seq,
    )
    for turn in expired:
        assert turn.replica is not None
        state, _ = _end_turn(state, turn.turn_id, e.at, Phase.IDLE, drain=False, touch=False)
        actions.append(TurnExpired(turn.turn_id, turn.run_id, turn.replica))

    busy = {t.run_id for t in state.turns.values()}
    quiet = sorted(
        r.run_id
        for r in state.runs.values()
        if r.run_id not in busy and e.at - r.last_activity >= RUN_IDLE_EXPIRY_S
    )
    if quiet:
        runs = state.runs.mutate()
        for run_id in quiet:
            del runs[run_id]
            actions.append(RunForgotten(run_id, "idle"))
        state = dataclasses.replace(state, runs=runs.finish())
    # A forgotten paused run frees the slot batch was keeping for it, so this may place turns too.
    if expired or quiet:
        return _drain(state, actions)
    return state, actions


def _resynced(state: State, e: Resynced) -> tuple[State, list[Action]]:
    runs = {
        r.run_id: Run(
            run_id=r.run_id,
            service_class=r.service_class,
            caller=r.caller,
            phase=r.phase,
            replica=r.replica or None,
            last_activity=e.at - max(r.idle_s, 0.0),
        )
        for r in e.runs
    }
    # Held turns are ours alone (their Admit calls are open here); placed ones are the dataplane's word.
    turns = {t.turn_id: t for t in state.turns.values() if t.status is TurnStatus.HELD}
    actions: list[Action] = []
    seq = state.next_seq
    for r in e.turns:
        replica = state.replicas.get(r.replica)
        if replica is None:
            continue  # a replica no longer in the pool: nothing to count it against
        held = turns.get(r.turn_id)
        turns[r.turn_id] = Turn(
            turn_id=r.turn_id,
            run_id=r.run_id,
            service_class=r.service_class,
            caller=r.caller,
            model=r.model,
            kind=r.kind,
            arrived_at=held.arrived_at if held else e.at,
            seq=held.seq if held else seq,
            status=TurnStatus.PLACED,
            replica=r.replica,
            placed_at=e.at,
        )
        if held is not None:
            # The dataplane already runs a turn we were holding: answer its open Admit with that.
            actions.append(Place(r.turn_id, r.run_id, r.replica, replica.url, e.at - held.arrived_at))
        else:
            seq += 1
    state = dataclasses.replace(state, runs=Map(runs), turns=Map(turns), next_seq=seq)
    return _drain(state, actions)


_HANDLERS: dict[type, Callable[[State, Any], tuple[State, list[Action]]]] = {
    PoolConfigured: _pool_configured,
    ReplicaProbed: _replica_probed,
    TurnArrived: _turn_arrived,
    TurnStarted: _turn_progressed,
    FirstToken: _turn_progressed,
    TurnCompleted: _turn_completed,
    TurnFailed: _turn_failed,
    TurnAbandoned: _turn_failed,
    RunEnded: _run_ended,
    Tick: _tick,
    Resynced: _resynced,
}


# --- turns and runs ---------------------------------------------------------------------------


def _tracks_run(turn: Turn) -> bool:
    # Single-pass turns keep no state between calls, so they never enter run state.
    return turn.kind is Kind.GENERATIVE and turn.run_id != ""


def _touch_run(state: State, run_id: str, at: float) -> State:
    run = state.runs.get(run_id)
    if run is None:
        return state
    return dataclasses.replace(state, runs=state.runs.set(run_id, dataclasses.replace(run, last_activity=at)))


def _end_turn(
    state: State, turn_id: str, at: float, phase: Phase, *, drain: bool = True, touch: bool = True
) -> tuple[State, list[Action]]:
    """Removes a turn (held or placed) and moves its run to `phase` unless another turn of it still runs."""
    turn = state.turns.get(turn_id)
    if turn is None:
        return state, []  # already gone: expired, resynced away, or never ours
    state = dataclasses.replace(state, turns=state.turns.delete(turn_id))
    run = state.runs.get(turn.run_id) if _tracks_run(turn) else None
    if run is not None:
        still_running = any(
            t.run_id == run.run_id and t.status is TurnStatus.PLACED and t.kind is Kind.GENERATIVE
            for t in state.turns.values()
        )
        run = dataclasses.replace(
            run,
            phase=Phase.GENERATING if still_running else phase,
            last_activity=at if touch else run.last_activity,
        )
        state = dataclasses.replace(state, runs=state.runs.set(run.run_id, run))
    return _drain(state, []) if drain else (state, [])


# --- placement --------------------------------------------------------------------------------


def _serving(state: State, kind: Kind, model: str) -> list[Replica]:
    """Replicas of `kind` serving `model`, healthy or not, in config order."""
    return [r for r in state.replicas_in_order() if r.kind is kind and model in r.models]


class _Load:
    """Counts the drain needs, computed once per drain and kept current as it places turns."""

    def __init__(self, state: State) -> None:
        self.in_flight: Counter[str] = Counter()
        self.caller_in_flight: Counter[str] = Counter()
        for t in state.placed():
            assert t.replica is not None
            self.in_flight[t.replica] += 1
            self.caller_in_flight[t.caller] += 1
        self.paused_interactive: Counter[str] = Counter(
            r.replica
            for r in state.runs.values()
            if r.phase is Phase.PAUSED and r.service_class is ServiceClass.INTERACTIVE and r.replica
        )

    def has_room(self, replica: Replica, turn: Turn) -> bool:
        cap = replica.capacity()
        if cap is None:
            return True
        used = self.in_flight[replica.name]
        if turn.service_class is ServiceClass.BATCH:
            used += self.paused_interactive[replica.name]
        return used < cap


def _choose(state: State, turn: Turn, load: _Load) -> Replica | None:
    """The replica `turn` goes to now, or None when it must wait."""
    candidates = [r for r in _serving(state, turn.kind, turn.model) if r.healthy]
    run = state.runs.get(turn.run_id) if _tracks_run(turn) else None
    if run is not None and run.phase in (Phase.GENERATING, Phase.PAUSED) and run.replica is not None:
        pinned = [r for r in candidates if r.name == run.replica]
        if pinned:
            candidates = pinned
    best: Replica | None = None
    for replica in candidates:
        if load.has_room(replica, turn) and (
            best is None or load.in_flight[replica.name] < load.in_flight[best.name]
        ):
            best = replica
    return best


def _drain_order(turn: Turn, load: _Load) -> tuple[int, int, int]:
    return (
        0 if turn.service_class is ServiceClass.INTERACTIVE else 1,
        load.caller_in_flight[turn.caller],
        turn.seq,
    )


def _drain(state: State, actions: list[Action]) -> tuple[State, list[Action]]:
    """Places every held turn that has somewhere to go, in drain order."""
    held = state.held()
    if not held:
        return state, actions
    load = _Load(state)
    while held:
        held.sort(key=lambda t: _drain_order(t, load))
        for i, turn in enumerate(held):
            replica = _choose(state, turn, load)
            if replica is not None:
                state = _place(state, turn, replica, load)
                actions.append(
                    Place(turn.turn_id, turn.run_id, replica.name, replica.url, state.now - turn.arrived_at)
                )
                del held[i]
                break
        else:
            break
    return state, actions


def _place(state: State, turn: Turn, replica: Replica, load: _Load) -> State:
    placed = dataclasses.replace(turn, status=TurnStatus.PLACED, replica=replica.name, placed_at=state.now)
    state = dataclasses.replace(state, turns=state.turns.set(turn.turn_id, placed))
    load.in_flight[replica.name] += 1
    load.caller_in_flight[turn.caller] += 1
    run = state.runs.get(turn.run_id) if _tracks_run(turn) else None
    if run is not None:
        if run.phase is Phase.PAUSED and run.service_class is ServiceClass.INTERACTIVE and run.replica:
            load.paused_interactive[run.replica] -= 1  # it came back: its reserved slot is now a turn
        run = dataclasses.replace(run, phase=Phase.GENERATING, replica=replica.name, last_activity=state.now)
        state = dataclasses.replace(state, runs=state.runs.set(run.run_id, run))
    return state


def replay(events: Iterable[Event], state: State | None = None) -> tuple[State, list[Action]]:
    """Feeds `events` in order from `state` (default: empty); returns the final state and every action."""
    state = state if state is not None else State()
    actions: list[Action] = []
    for event in events:
        state, out = decide(state, event)
        actions.extend(out)
    return state, actions
