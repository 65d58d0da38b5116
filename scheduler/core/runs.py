"""Run state and the turns' lifetimes: the only code that changes a run or adds and removes a
turn, and with them every index that depends on what changed (in-flight counts, the quiet,
timeout, kept and hold orders, what the gate counts per replica, the slots held, the lanes of a
run whose pin moves); and the rebuild from nothing that a new pool or a resync needs.
"""

from __future__ import annotations

from immutables import Map

from luftpause import lifecycle
from luftpause.scheduler import admission, fairness, gate
from luftpause.scheduler.core.confirm import _confirm_next, _set_unconfirmed
from luftpause.scheduler.core.indexes import _hold, _hold_lane, _set_caller_standing, _unhold, _unhold_lane
from luftpause.scheduler.core.tx import (
    _HELD,
    _IDLE,
    _PAUSED,
    _bump,
    _group,
    _paused_at,
    _pin,
    _tracks_run,
    _Tx,
)
from luftpause.scheduler.events import (
    TurnArrived,
)
from luftpause.scheduler.ordered import EMPTY
from luftpause.scheduler.state import (
    RESERVED_CALLER,
    Group,
    Run,
    Turn,
)


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
            if run.tool:
                tools = tx.tool_pauses.get(e.caller, ())
                tx.tool_pauses = tx.tool_pauses.set(e.caller, gate.learn_tool_pause(tools, run.tool, pause))
        run = run.came_back(e.service_class, e.caller, e.at, e.dataplane, max(run.working_set, estimate))
    _set_run(tx, e.run_id, run)


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
        _move_held(tx, old_pin, old_size, new_pin, new_size)
    old_slot = old.slot if old_pin is not None else None  # type: ignore[union-attr]
    new_slot = new.slot if new_pin is not None else None  # type: ignore[union-attr]
    if old_slot != new_slot or (old_slot is not None and old_pin != new_pin):
        _move_slot(tx, old_pin, old_slot, new_pin, new_slot)
    if old_pin != new_pin:
        # Each lane of the run moves whole, by its first turn: O(log n) per lane, not per turn.
        for lane in tx.run_lanes.get(run_id, ()):
            head = tx.lanes[lane].first()[0]
            _unhold_lane(tx, lane, head, Group(lane.kind, lane.model, old_pin, lane.service_class))
            _hold_lane(tx, lane, head, Group(lane.kind, lane.model, new_pin, lane.service_class))


def _move_held(tx: _Tx, old_pin: str | None, old_size: int, new_pin: str | None, new_size: int) -> None:
    """What the replicas hold for the gate, after a run pinned to `old_pin` with its working set
    `old_size` is pinned to `new_pin` with `new_size`: a run counts where it is pinned, by its size."""
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


def _move_slot(
    tx: _Tx, old_pin: str | None, old_slot: int | None, new_pin: str | None, new_slot: int | None
) -> None:
    """The slots a slot engine's held runs keep their KV in (`_slot_for`), after a run held in
    `old_slot` of `old_pin` is held in `new_slot` of `new_pin` (None: none)."""
    if old_slot is not None:
        assert old_pin is not None
        left = tx.held_slots.get(old_pin, frozenset()) - {old_slot}
        tx.held_slots = tx.held_slots.set(old_pin, left) if left else tx.held_slots.delete(old_pin)
    if new_slot is not None:
        assert new_pin is not None
        tx.held_slots = tx.held_slots.set(new_pin, tx.held_slots.get(new_pin, frozenset()) | {new_slot})


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
    tool: str = "",
) -> Turn | None:
    """Removes a turn (held or placed) and moves its run to the phase `lifecycle.phase_after_turn`
    gives (`paused_on_tool`: it completed in tool calls, on `tool`: `gate.tool_key`).

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
        tool = tool if paused else ""
        hold_until = _hold_until(tx, run, at, tool) if paused else None
        ended = run.turn_ended(phase, at if touch else run.last_activity, kept_until, hold_until, tool)
        # A caller whose tools take longer than a place is kept for lets go at once.
        _set_run(tx, run.run_id, ended.let_go() if hold_until is not None and hold_until <= at else ended)
    # Uncounted after the run is updated, so a run going quiet enters the quiet index once.
    _open(tx, turn.run_id, -1)
    return turn


def _hold_until(tx: _Tx, run: Run, at: float, tool: str) -> float | None:
    """Until when `run`, paused on `tool` at `at`, keeps its place on its replica; None where the
    gate is off there for a run of its size (`gate.gated`): it keeps its place, as without the gate."""
    known = tx.replicas.get(run.replica) if run.replica is not None else None
    if known is None or not gate.gated(known, run.working_set):
        return None
    pauses = gate.pauses_on(tx.pause_samples.get(run.caller, ()), tx.tool_pauses.get(run.caller, ()), tool)
    return at + gate.hold_for(pauses)


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
