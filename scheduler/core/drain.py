"""The drain: after a decision that may let a held turn go somewhere, held turns are placed one
at a time, the first in drain order (interactive before batch, then the caller's standing, then
arrival) that has somewhere to go, until none has.
"""

from __future__ import annotations

from collections.abc import Iterable

from luftpause.scheduler.actions import Action, Place
from luftpause.scheduler.core.place import _choose, _place, _room_of, _rooms
from luftpause.scheduler.core.reserve import _sent_there
from luftpause.scheduler.core.tx import _BATCH, _GENERATIVE, _paused_at, _tracks_run, _Tx
from luftpause.scheduler.state import (
    Group,
    Replica,
)


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
        best, still = _first_placeable(tx, looking, room_interactive, room_batch)
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
        if turn.kind is _GENERATIVE:
            _sent_there(tx, turn.dataplane, replica.name)  # where it wants reservations (reserve.py)
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


def _first_placeable(
    tx: _Tx, looking: Iterable[Group] | None, room_interactive: list[str], room_batch: list[str]
) -> tuple[tuple[Group, str, Replica] | None, list[Group]]:
    """One round of the drain: of the groups `looking` (None: every held group), the first in
    drain order whose best turn has somewhere to go, as (group, its caller, the replica), or
    None; and the groups that may still have somewhere to go (those not looked at included)."""
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
    return best, still
