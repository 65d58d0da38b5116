"""What the dataplane's Turns stream carries next, and when (`Outbox`): the one table of how
soon each item must reach the scheduler (`urgency`).

Not every event is worth a message of its own. How soon each must reach the scheduler is its
`Urgency`: a turn that pauses its run on a tool goes at once (the run's next turn may reach
another dataplane and must find the run there), and so does a failed one (rare, and what a
client retries on); an event that frees room or confirms a turn goes at once while the
scheduler holds a turn somewhere (a decision may wait on it) or this dataplane waits for an
admission; otherwise it rides with the next message, or goes after `RIDE_AT_MOST_S` if none
comes. Each message from the scheduler says whether it holds any turn (`nothing_held`); until
the first one says so, everything goes at once. So a quiet stack costs one message each way per
turn, and a busy one reports as promptly as before.
"""

from __future__ import annotations

import asyncio
import enum

from luftpause.lifecycle import pauses_run
from luftpause.proto import pb

# The longest an event no decision waits on stays in the dataplane before it goes out on its own.
RIDE_AT_MOST_S = 0.02


class Urgency(enum.IntEnum):
    """How soon an event must reach the scheduler (see the module docstring)."""

    RIDES = 0  # no decision waits on it: it goes with the next message
    WHILE_HELD = 1  # a held turn may wait on it: at once while the scheduler holds any
    NOW = 2  # at once, always


# How soon each item of a message must go, by what it is; `urgency` reads it.
_URGENCY = {
    # A turn asking, and room given back for one that asks: a client waits on each.
    "admit": Urgency.NOW,
    "reservation_returned": Urgency.NOW,
    # Asked for first on each new stream (`Outbox.open`).
    "want_reservations": Urgency.NOW,
    # The use of a reservation rides like a streamed turn's start: the room already counts on
    # that replica (`SchedulerClient._use_reservation`).
    "reservation_used": Urgency.RIDES,
    # A first token confirms a turn started and a run's end frees its room: a held turn may
    # wait on either.
    "first_token": Urgency.WHILE_HELD,
    "run_ended": Urgency.WHILE_HELD,
    # Rare, and what a client retries on: the scheduler has it before the retry comes.
    "failed": Urgency.NOW,
    # The client left: the turn leaves the queue or frees its slot at once.
    "abandoned": Urgency.NOW,
}


def urgency(item: pb.DataplaneItem) -> Urgency:
    """How soon `item` must reach the scheduler: `_URGENCY`, but for a turn's start and end.

    A streamed reply's start tells the scheduler nothing the first token will not say
    (admission.py), so it rides; a reply read whole is confirmed by its end, which the core
    times from its start. A reply that pauses its run on a tool goes at once (the run's next
    turn may reach another dataplane first); any other end may free room for a held turn.
    """
    what = item.WhichOneof("item")
    if what == "event":
        event = item.event
        what = event.WhichOneof("event")
        if what == "started":
            return Urgency.RIDES if event.started.streamed else Urgency.WHILE_HELD
        if what == "completed":
            paused = pauses_run(event.completed.finish_reason, event.completed.tool_call_ids)
            return Urgency.NOW if paused else Urgency.WHILE_HELD
    assert what is not None, "an empty item"
    return _URGENCY[what]


class Outbox:
    """The items the current stream is to carry next, in order, and its writer's wake-up."""

    def __init__(self) -> None:
        self.items: list[pb.DataplaneItem] = []
        # What the scheduler last said: it holds no turn, so events may ride.
        self.nothing_held = False
        self._wake = asyncio.Event()
        self._ride_timer: asyncio.TimerHandle | None = None

    def put(self, item: pb.DataplaneItem, waiting: bool) -> None:
        """Queues `item`, and wakes the writer for it as soon as its `urgency` asks; `waiting`:
        this dataplane waits on room a held turn's events may free (an admission of its own, or
        its last reservation on a replica)."""
        self.items.append(item)
        due = urgency(item)
        if due is Urgency.NOW or (due is Urgency.WHILE_HELD and (not self.nothing_held or waiting)):
            self._wake.set()
        elif self._ride_timer is None:
            self._ride_timer = asyncio.get_running_loop().call_later(RIDE_AT_MOST_S, self._wake.set)

    def told(self, nothing_held: bool) -> None:
        """The scheduler says whether it holds any turn; once it does, what waited goes out."""
        self.nothing_held = nothing_held
        if not nothing_held and self.items:
            self._wake.set()

    def open(self, first: list[pb.DataplaneItem]) -> None:
        """A new stream: it carries `first` before anything else, at once."""
        self.items = first
        self._wake.set()

    def close(self) -> None:
        """The stream is gone: what it did not carry is dropped (the next resync carries its
        effect), and until the next one says otherwise, the scheduler may hold turns."""
        self.items = []
        self.nothing_held = False
        self._stop_ride_timer()

    async def take(self) -> list[pb.DataplaneItem]:
        """Waits until the writer is woken; everything queued by then, and taken out."""
        await self._wake.wait()
        # What the other turns queue in this turn of the event loop goes in the same message.
        await asyncio.sleep(0)
        self._wake.clear()
        self._stop_ride_timer()
        items, self.items = self.items, []
        return items

    def _stop_ride_timer(self) -> None:
        if self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
