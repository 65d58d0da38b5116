"""The turn events and the clock: a turn arriving, starting, streaming its first token, ending
(completed, failed or abandoned), a run ending, and the tick that brings ejected replicas back,
expires placed turns never reported and forgets quiet runs.
"""

from __future__ import annotations

from luftpause import lifecycle
from luftpause.scheduler import gate, outliers
from luftpause.scheduler.actions import Action, Place, Refuse, RunForgotten, TurnExpired
from luftpause.scheduler.core.confirm import _confirm
from luftpause.scheduler.core.indexes import _hold
from luftpause.scheduler.core.place import _slot_of
from luftpause.scheduler.core.pool import _count_outcome, refusal_message
from luftpause.scheduler.core.reserve import _sent_there
from luftpause.scheduler.core.runs import _end_turn, _open, _run_came_back, _set_run
from luftpause.scheduler.core.tx import _GENERATIVE, _PLACED, _group, _tracks_run, _Tx
from luftpause.scheduler.events import (
    FirstToken,
    RunEnded,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from luftpause.scheduler.state import (
    Turn,
)

# A placed turn whose end is never reported (the dataplane crashed mid-turn) is dropped after this.
TURN_TIMEOUT_S = 600.0


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
            if known.kind is _GENERATIVE:
                _sent_there(tx, known.dataplane, known.replica)
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
    _end_turn(
        tx,
        e.turn_id,
        e.at,
        e.paused_on_tool,
        freed_engine_room=True,
        working_set=size,
        tool=gate.tool_key(e.tool_names),
    )


def _turn_failed(tx: _Tx, e: TurnFailed | TurnAbandoned, actions: list[Action]) -> None:
    if isinstance(e, TurnFailed) and e.replica_fault:
        turn = tx.turns.get(e.turn_id)
        if turn is not None:
            _count_outcome(tx, turn, failed=True)
    _end_turn(tx, e.turn_id, e.at, False)


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
                tx.replicas = tx.replicas.set(name, replica._replace(outlier=back))
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
