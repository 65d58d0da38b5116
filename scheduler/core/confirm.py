"""Confirmation: which of our placed turns a replica's engine has started.

A placed turn counts against its replica's lookahead (admission.py) until the engine is known to
have started it: by its first token, by a load reading that shows fewer of ours waiting than we
sent, by a turn finishing ahead of it (for replies that do not stream, or on a slot engine), or
at once on a slot engine with a free slot. This module keeps the per-replica index of the turns
not yet confirmed (`unconfirmed`, in the order they went out) and applies each of those rules.
"""

from __future__ import annotations

from luftpause.scheduler import admission
from luftpause.scheduler.core.tx import _INTERACTIVE, _bump, _Tx
from luftpause.scheduler.ordered import EMPTY
from luftpause.scheduler.state import (
    Replica,
    Turn,
)


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
        tx.replicas = tx.replicas.set(replica.name, replica._replace(others_waiting=0))


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
        tx.replicas = tx.replicas.set(name, replica._replace(others_waiting=others, read_at=sent_at))
    for turn in sent[: len(sent) - keep]:
        _confirm(tx, turn)
