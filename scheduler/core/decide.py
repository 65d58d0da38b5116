"""The entry point: `decide(state, event) -> (state, actions)`, which hands each event to its
handler and then lets the drain and the reservations act on what changed; `replay` feeds a
sequence of events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from luftpause.scheduler.actions import Action
from luftpause.scheduler.core.drain import _drain, _entered_may_place
from luftpause.scheduler.core.place import _rooms
from luftpause.scheduler.core.pool import _pool_configured, _replica_probed
from luftpause.scheduler.core.reserve import (
    _dataplane_left,
    _reservation_returned,
    _reservation_used,
    _reservations_wanted,
    _reserve,
)
from luftpause.scheduler.core.resync import _resynced
from luftpause.scheduler.core.runs import _end_holds, _end_kept
from luftpause.scheduler.core.turns import (
    _first_token,
    _run_ended,
    _tick,
    _turn_arrived,
    _turn_completed,
    _turn_failed,
    _turn_started,
)
from luftpause.scheduler.core.tx import Decision, _open_tx, _Tx
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
from luftpause.scheduler.state import (
    State,
)


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


def replay(events: Iterable[Event], state: State | None = None) -> tuple[State, list[Action]]:
    """Feeds `events` in order from `state` (default: empty); returns the final state and every action."""
    state = state if state is not None else State()
    actions: list[Action] = []
    for event in events:
        state, out = decide(state, event)
        actions.extend(out)
    return state, actions


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
