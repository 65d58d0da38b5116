"""The held-turn indexes: lanes, the callers of each group, and each caller's standing.

Held turns sit in three levels (see `State`): a lane's turns in arrival order; per (group,
caller), the lanes there by their first turn; per group, its callers keyed by (standing, first
turn), so that a group's first key is the turn the drain would place next. These helpers are
the only code that changes those indexes, each in O(log n).
"""

from __future__ import annotations

from luftpause.scheduler import fairness
from luftpause.scheduler.core.tx import _lane, _tracks_run, _Tx
from luftpause.scheduler.ordered import EMPTY
from luftpause.scheduler.state import (
    Group,
    Lane,
    Turn,
)


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
