"""One decision's working copy of the state (`_Tx`), and the small reads of it that every
part of the core shares: which turns keep run state, a run's pin and kept room, a turn's group
and lane, and the counter arithmetic the indexes use.

A decision opens the state into a `_Tx` (`_open_tx`), whose fields the handlers rebind as they
change, and `freeze`s it into the next state: the state handed in is never touched.
"""

from __future__ import annotations

import operator

from immutables import Map

from luftpause import lifecycle
from luftpause.scheduler.actions import Action
from luftpause.scheduler.ordered import SortedSet
from luftpause.scheduler.state import (
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
    ToolPauses,
    Turn,
    TurnKey,
    TurnStatus,
    pinned_to,
)

Decision = tuple[State, tuple[Action, ...]]

_HELD = TurnStatus.HELD
_PLACED = TurnStatus.PLACED
_IDLE = Phase.IDLE
_PAUSED = Phase.PAUSED
_GENERATING = Phase.GENERATING
_INTERACTIVE = ServiceClass.INTERACTIVE
_BATCH = ServiceClass.BATCH
_GENERATIVE = Kind.GENERATIVE


class _Tx:
    """One decision's working copy of the state: the same fields, rebound as they change.

    Every field holds an immutable value, so the state handed in is never touched; `freeze`
    makes the new one. Only runs.py changes the facts (turns, runs), and each of its helpers
    keeps the indexes that depend on what it changed current.
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
    tool_pauses: Map[str, ToolPauses]

    __slots__ = (*State._fields, "may_place", "entered")
    # Set by whatever may let a held turn be placed; see `decide`.
    may_place: bool
    # Groups a lane entered in this decision: they may have somewhere to go that the groups
    # already held had not.
    entered: list[Group]

    def freeze(self) -> State:
        return _new_state(State, _read_state(self))


# Copying the state's fields in and out: one unpacking in and one attrgetter out, with no loop
# per decision (a decision is a few tens of microseconds; each Python call in it shows), and the
# state made without NamedTuple._make's length check. The unpacking names the state's fields in
# their order: a field added to the state fails every decision at once (too many values to
# unpack), and tests/scheduler/test_core_fields.py keeps the names the state's, in order.
_read_state = operator.attrgetter(*State._fields)
_new_state = tuple.__new__


def _open_tx(s: State) -> _Tx:
    """A decision's working copy of the state `s`."""
    tx = _Tx.__new__(_Tx)
    tx.may_place = False
    tx.entered = []
    (
        tx.replicas,
        tx.order,
        tx.runs,
        tx.turns,
        tx.next_seq,
        tx.now,
        tx.serving,
        tx.routers_of,
        tx.in_flight_by_replica,
        tx.in_flight_by_caller,
        tx.paused_by_replica,
        tx.held_queues,
        tx.held_groups,
        tx.caller_groups,
        tx.lanes,
        tx.run_lanes,
        tx.run_open,
        tx.run_placed,
        tx.placed_order,
        tx.quiet_order,
        tx.unconfirmed,
        tx.kept_order,
        tx.pause_estimate,
        tx.unconfirmed_interactive,
        tx.reserving,
        tx.reservations,
        tx.held_kv,
        tx.held_runs,
        tx.hold_order,
        tx.pause_samples,
        tx.tokens_per_byte,
        tx.attained,
        tx.held_slots,
        tx.tool_pauses,
    ) = s
    return tx


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


def _lane(turn: Turn) -> Lane:
    return Lane(turn.run_id, turn.kind, turn.model, turn.service_class, turn.caller)


def _bump(counts: Map[str, int], key: str, delta: int) -> Map[str, int]:
    if not delta:
        return counts
    n = counts.get(key, 0) + delta
    return counts.set(key, n) if n else counts.delete(key)
