"""A dataplane's resync: its view of the runs and placed turns it speaks for replaces ours, and
what other dataplanes sent stays.
"""

from __future__ import annotations

from luftpause.scheduler import admission, gate
from luftpause.scheduler.actions import Action, Place
from luftpause.scheduler.core.runs import _hold_until, _rebuild
from luftpause.scheduler.core.tx import _HELD, _PAUSED, _PLACED, _Tx
from luftpause.scheduler.events import (
    Resynced,
)
from luftpause.scheduler.state import (
    Run,
    Turn,
)


def _resynced(tx: _Tx, e: Resynced, actions: list[Action]) -> None:
    """A dataplane's view replaces what it spoke for (see the module's docstring)."""
    tx.may_place = True
    # Its reservations go with its old stream; it asks again on its new one.
    if e.dataplane in tx.reserving:
        tx.reserving = tx.reserving.delete(e.dataplane)
    runs = _runs_after(tx, e)
    turns = _turns_after(tx, e, actions)
    _rebuild(tx, list(runs.values()), sorted(turns.values(), key=lambda t: t.seq))


def _runs_after(tx: _Tx, e: Resynced) -> dict[str, Run]:
    """The runs after the resync `e`: others' as they were, and the ones its view names."""
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
                # Sized by its latest usage as the view has it (0 where none was reported: until
                # its next report the gate counts it as nothing).
                gate.measured_working_set(r.prompt_tokens, r.completion_tokens, r.max_tokens)
                if r.prompt_tokens > 0
                else 0,
            )
            if r.phase is _PAUSED:
                # It keeps its place for its keep time on its tool, as if it had just paused.
                tool = gate.tool_key(r.tool_names)
                run = run._replace(hold_until=_hold_until(tx, run, e.at, tool), tool=tool)
            runs[r.run_id] = run
    return runs


def _turns_after(tx: _Tx, e: Resynced, actions: list[Action]) -> dict[str, Turn]:
    """The turns after the resync `e`: the held ones, others' placed ones, and the ones its view
    names as placed (a held one among them is answered with its placement)."""
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
            # The dataplane already runs a turn we were holding: answer its waiting admission with
            # that (not `_sent_there`: its reservations went with its old stream, see above).
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
    return turns
