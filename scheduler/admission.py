"""Admission: whether a replica may take one more of our turns now. One rule, one limit per replica.

Theory of operation
-------------------

An engine runs what fits in its memory and queues the rest, first come, first served. A turn we
send to an engine that is full does not wait with us, where an interactive turn could still go
ahead of it: it waits in the engine's own queue, ahead of everything sent after it. So the limit
is not on how many of our turns a replica runs (that is the engine's business, and it changes
with every prompt's length) but on how many of them may be *waiting inside it*: its lookahead,
a small number per replica (the config's `lookahead`, `config.LOOKAHEAD` unless set). A couple
of turns queued in the engine keep it busy in the moment between one request finishing and our
next arriving; more than that only takes away our power to reorder.

We do not see the engine's queue between its 2 s probes, so the core keeps an estimate of which
of our placed turns may still be waiting there: the *unconfirmed* ones. A placed turn is
unconfirmed until something shows the engine took it:

- its first token (streamed replies): exact, and within one prefill of the engine starting it;
- a probe of the engine's load: of our turns sent before the probe, at most `waiting` can be in
  its queue, so all but the `waiting` newest are running;
- for a reply that is not streamed (no first token until it is whole), a turn of ours finishing
  on that replica: the engine had room for one more, and the oldest of our waiting turns, which
  is at the head of the engine's FIFO queue, is the one it takes.

An engine may have other clients. Requests of theirs that its last reading showed queued, beyond
any of ours, count against the lookahead too (our turns would wait behind them), until one of our
turns sent after that reading starts: the queue ahead of it has cleared. So a replica whose queue
someone else filled takes no more of our turns, and a turn that may go elsewhere does.

Interactive turns count only among themselves. Holding one back behind batch turns already sent
would win nothing: it goes into the engine's queue at once, behind at most the lookahead's worth of
batch turns (which luftpause would have let go before it anyway), or ahead of them where the
engine honours priorities (`engine_priority`). So at most a lookahead of interactive turns and a
lookahead of batch turns can wait in an engine.

So the limit a replica has, in the Netflix concurrency-limits sense, is "our turns it runs, plus
the lookahead": it grows with each first token instead of with each probe, it follows the engine
down as soon as the engine stops starting turns, and it comes back after a queue clears one
turn at a time, never in a burst. A replica with room is filled: nothing here leaves an engine
idle while a turn it may take is held. Lookahead 0 switches the limit off (a hosted API with room
for anything); it is the only uncapped case.

Paused interactive runs. An interactive run paused on a tool will be back, on this replica, and
should find the engine's queue short when it does. So each such run takes one turn of lookahead
away from batch, down to one: batch may always keep one turn waiting in the engine, so an engine
with room is still filled (one turn at a time), and the interactive turn that comes back waits
behind at most that one batch turn there, with luftpause's own queue putting it first. What that
costs batch is bounded twice: by the lookahead (only that many paused runs count on a replica)
and by time (a run counts only while its tool is expected back soon: `keep_paused_for`).
Measured in the simulator (`luftpause bench sim flood` and `light`): letting paused runs stop
batch altogether won about half an interactive run a minute in the flood and cost batch 9 % in
`light`, where the engines have room and nothing needed protecting.

Everything here is pure: the core passes in the counts it keeps, the status page and the
simulator read the same functions.
"""

from __future__ import annotations

from luftpause.scheduler.state import Replica


def uncapped(replica: Replica) -> bool:
    """Whether the replica takes any number of our turns (its lookahead is 0)."""
    return replica.lookahead <= 0


def room(
    replica: Replica, waiting_ours: int, waiting_interactive: int, paused_interactive: int
) -> tuple[bool, bool]:
    """Whether `replica` has room now for (an interactive turn, a batch turn).

    `waiting_ours`: our placed turns there not yet seen running, plus others' requests queued
    ahead of them (see the module docstring); `waiting_interactive`: the same counting only our
    interactive turns; `paused_interactive`: interactive runs paused on a tool whose next turn
    will come back there. Batch room implies interactive room.
    """
    if not replica.in_service:
        return False, False
    lookahead = replica.lookahead
    if lookahead <= 0:
        return True, True
    for_batch = waiting_ours + min(paused_interactive, lookahead - 1) < lookahead
    return waiting_interactive < lookahead, for_batch


def limit(replica: Replica, in_flight: int, waiting_interactive: int) -> int | None:
    """The most of our turns the replica may hold now, None when uncapped: those it holds, plus
    the interactive turns it still has room for (`room`; batch may have room for fewer)."""
    if uncapped(replica):
        return None
    return in_flight + max(0, replica.lookahead - replica.others_waiting - waiting_interactive)


def others_waiting(unconfirmed_sent: int, engine_waiting: int | None) -> int:
    """Of an engine's `engine_waiting` queued requests, how many are surely not ours: those beyond
    our `unconfirmed_sent` turns that may be there. Ours wait behind them."""
    if engine_waiting is None:
        return 0
    return max(0, engine_waiting - unconfirmed_sent)


def still_waiting(unconfirmed_sent: int, engine_waiting: int | None) -> int:
    """Of our `unconfirmed_sent` turns sent before a load reading, how many may still be queued.

    An engine that reports `engine_waiting` requests in its queue cannot be queueing more of ours
    than that; the newest are the ones still there. No reading: all of them may be.
    """
    if engine_waiting is None:
        return unconfirmed_sent
    return max(0, min(unconfirmed_sent, engine_waiting))


# The most a paused run keeps room for itself: a tool that takes longer than this costs batch more
# engine time than the returning turn can win back by not queueing.
KEEP_PAUSED_MAX_S = 10.0
# A kept slot lasts this many times the caller's usual pause, so a tool a little slower than its
# average still finds the room.
KEEP_PAUSED_FACTOR = 2.0
# Weight of each new pause in a caller's running average.
PAUSE_LEARNING_RATE = 0.2


def keep_paused_for(pause_estimate: float | None) -> float:
    """How long batch keeps room for a paused interactive run whose caller's pauses average
    `pause_estimate` seconds (None: no pause seen yet, so the longest)."""
    if pause_estimate is None:
        return KEEP_PAUSED_MAX_S
    return min(KEEP_PAUSED_FACTOR * pause_estimate, KEEP_PAUSED_MAX_S)


def learn_pause(pause_estimate: float | None, pause_s: float) -> float:
    """The caller's running average after one more of its runs came back from a tool after `pause_s`."""
    pause_s = max(pause_s, 0.0)
    if pause_estimate is None:
        return pause_s
    return pause_estimate + PAUSE_LEARNING_RATE * (pause_s - pause_estimate)
