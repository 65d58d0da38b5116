"""The scheduler's decisions: `decide(state, event) -> (state, actions)`, and nothing else.

Theory of operation
-------------------

The scheduler answers one question, "where does this turn go, and when?", for a pool of
replicas it does not own and runs it only hears about. It does no I/O, reads no clock and draws
no random numbers: everything it knows arrives as an event (`events.py`), stamped with the time
it happened, and everything it wants done leaves as an action (`actions.py`). The gRPC host, the
prober and the clock (`host.py`, `wire.py`, `prober.py`, `main.py`) translate between the world
and these two vocabularies; the simulator feeds the same function in virtual time. Feeding the
same events to the same state gives the same actions, always: replaying a recorded log
reproduces every decision.

There are three kinds of thing, each with a small state machine:

  Replica   healthy or not (as last probed; unprobed counts as healthy, so a fresh stack serves at
            once and the first failed probe takes it out), ejected or not (its turns kept failing:
            outliers.py, counted from the turns' reports), with the engine's load as last read:
            `running` and `waiting`. How many of our turns it may take is admission's rule
            (`admission.py`): no more than its lookahead of them may be waiting inside the engine
            at once, counted as the placed turns the engine is not yet known to have started
            (a first token, a load reading or, for replies that do not stream, a turn finishing
            there is what confirms one). A router (`load_from`) is a replica whose load is the
            sum of the last readings of the engines behind it.

  Run       IDLE -> GENERATING when one of its turns is placed;
            GENERATING -> PAUSED when that turn completes in tool calls (the run will be back,
            and its prefix is cached on that replica); -> IDLE when it completes otherwise,
            fails, or is abandoned (a failed turn never leaves its run paused, so a retry is
            admitted like any next turn). Where the run gate holds it (`gate.py`), a paused run
            lets go of its replica when its keep time runs out (still PAUSED, no replica). A
            run is forgotten when it ends or has been quiet for RUN_IDLE_EXPIRY_S.

  Turn      arrives -> refused at once when no replica of its kind serves its model at all;
            otherwise HELD -> PLACED (its admission answered) -> gone when reported completed, failed
            or abandoned, or dropped after TURN_TIMEOUT_S without a report. A held turn can also
            be abandoned (its client left).

Placement. A held turn may go to a replica in service (healthy, and not ejected for turns that
keep failing: outliers.py) of its kind that serves its model. A run that is GENERATING or PAUSED
may go only to its last replica, while that replica is in service and serves the model, even
when others have room: that is where its KV cache is. Whether a replica has room
is `admission.room`: fewer of our turns waiting in its engine than its lookahead, and for a batch
turn one fewer for each interactive run paused on a tool there with room kept for it (never the
last one); a paused run keeps that room only for about as long as its caller's tools take. Of the
replicas with room, the one with the fewest of our turns in flight wins; ties go to config order.
A run that no replica holds (a new one, or one that let go) goes only where `gate.fits` finds
its working set room beside the runs held there: the run gate, whose rules and reasons are
gate.py's; a pinned run's turn is never held for that room.

Draining. After every event that may let a held turn go somewhere (a replica gained room, or a
held turn entered a group it was not in: it arrived, or its run's pin moved), held turns are
tried in order: interactive before batch, then the caller with the least attained service (the
engine tokens its turns asked for lately: fairness.py; so one caller's flood cannot starve
another), then the fewest turns in flight, then arrival. A turn that cannot be placed (its pinned
replica is full) does not block the ones behind it. The order is re-evaluated after each
placement, since placing a turn changes its caller's standing. So after every decision no held turn
has a replica it could go to.

Reservations. While nothing is held, a placement is foregone, so a dataplane that asks is
granted room ahead of need on the replicas its turns went to, counted like a turn placed there
and not yet started; it sends a known run's next turn on one without asking and reports it
used. The first held turn revokes them all (`reserve._reserve` has the rules). A scheduler whose
dataplanes never ask decides exactly as without them: the simulator's never do.

Cost. Nothing here scans every turn or run. Held turns are indexed by group: (kind, model, the
replica their run is pinned to, class). All turns of a group can go to the same replicas, so the
drain asks "is there room?" once per group, and each group keeps its callers in a sorted set keyed
((attained service, turns in flight), first arrival), so the group's first key is the turn it would place next. Under a
caller, a run's turns of one group form a lane that enters the group by its first turn only, so a
run whose pin moves moves one entry per lane. Placed turns and quiet runs sit in sorted sets by
time, so expiry looks only at what is due. Each index is a persistent map or B-tree: a decision
costs O(log n) in the turns and runs held, plus one look at each replica and group per placement.

Where things live
-----------------

  decide.py   the entry point: each event to its handler, then the drain and the reservations
  turns.py    the turn events and the clock (arrival, start, first token, end, run end, tick)
  pool.py     the replicas: pool configuration, probes, outcomes toward ejection, routers' load
  resync.py   a dataplane's view replacing its part of ours
  reserve.py  reservations, and the events that ask for, use and give them back
  drain.py    placing held turns in drain order after a decision
  place.py    a replica's room, where a turn may go, placing it, the slot it names
  runs.py     run state and turns' lifetimes: the only code that changes them, and their indexes
  indexes.py  the held-turn indexes (lanes, each group's callers, a caller's standing)
  confirm.py  which placed turns an engine has started
  tx.py       one decision's working copy of the state, and the small reads everyone shares

The run gate is `scheduler/gate.py`, admission's rules `scheduler/admission.py`, fairness
`scheduler/fairness.py`, ejection `scheduler/outliers.py`; the state is `scheduler/state.py`.
Names with a leading underscore are the package's own: callers import what is re-exported here.
"""

from __future__ import annotations

from luftpause.lifecycle import RUN_IDLE_EXPIRY_S
from luftpause.scheduler.core.decide import decide, replay
from luftpause.scheduler.core.pool import refusal_message
from luftpause.scheduler.core.reserve import RESERVE_WINDOW_S
from luftpause.scheduler.core.turns import TURN_TIMEOUT_S
from luftpause.scheduler.core.tx import Decision

__all__ = [
    "RESERVE_WINDOW_S",
    "RUN_IDLE_EXPIRY_S",
    "TURN_TIMEOUT_S",
    "Decision",
    "decide",
    "refusal_message",
    "replay",
]
