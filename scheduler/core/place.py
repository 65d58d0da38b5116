"""Where a held turn may go, and placing it there: a replica's room (`admission.room` over the
indexes' counts), the choice among the replicas with room (its run's pin, else the run gate and
the fewest turns in flight), the placement itself, and the engine slot its request names.
"""

from __future__ import annotations

from luftpause.scheduler import admission, gate
from luftpause.scheduler.core.confirm import _confirm_on_a_free_slot
from luftpause.scheduler.core.indexes import _unhold
from luftpause.scheduler.core.runs import _charge, _count_placed, _set_run
from luftpause.scheduler.core.tx import _GENERATIVE, _pin, _tracks_run, _Tx
from luftpause.scheduler.state import (
    Group,
    Replica,
    Run,
    Turn,
)


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
