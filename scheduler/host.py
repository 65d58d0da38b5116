"""The host around `decide`: the state, the events fed to it, the actions carried out, and the
gRPC service the dataplanes call (the process that runs it is main.py).

Everything here translates (the messages themselves: wire.py). Each dataplane keeps one Turns stream open (a `Link` here): an admit
on it becomes a `TurnArrived`, and the `Place` or `Refuse` the core emits for that turn (at once
or after being held) goes back on the same stream; every other item becomes the matching turn
event, stamped with this process's monotonic clock on receipt. A stream that ends abandons the
turns still waiting on it. Every stream is told whether the core holds any turn (at its start
and whenever that changes, in every message): while it holds none, no decision waits on a
turn's events, and the dataplane lets them ride with its next admission. A dataplane that asks
for reservations gets the core's `Reserved` and `Revoked` on its latest stream; the stream's end
(or a newer stream of the same dataplane) voids them (`DataplaneLeft`). A Resync becomes
`Resynced`, scoped to the dataplane that sent it.
An admit without a run header is put in its run here (`run_identity`), by the tool_call_ids it
echoes, so that it is found whichever dataplane its run's last turn went through. The prober and a 1 s tick
feed `ReplicaProbed` and `Tick`. With `LUFTPAUSE_TOKEN` set, the gRPC port takes only calls that
carry it as a bearer token (grpc_auth.py). All of it runs on one asyncio event loop and
`SchedulerHost.feed` never awaits, so calls into `decide` are serialised without a lock: each runs
to completion, actions included, before the next event is looked at.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterable, Callable, Sequence
from typing import Any

import grpc
from opentelemetry.trace import StatusCode

from luftpause import config as _config
from luftpause import tracing
from luftpause.lifecycle import EndedRuns
from luftpause.proto import MAX_BATCH_ITEMS, pb, rpc
from luftpause.scheduler import events as ev
from luftpause.scheduler.actions import Action, Place, Refuse, Reserved, Revoked, RunForgotten, TurnExpired
from luftpause.scheduler.core import decide
from luftpause.scheduler.metrics import ACTION_NAMES, HostCounts
from luftpause.scheduler.run_identity import RunIdentity
from luftpause.scheduler.state import State
from luftpause.scheduler.status import HeldHistory
from luftpause.scheduler.wire import dataplane_of, placement, resynced, turn_event, turn_fields

log = logging.getLogger("luftpause.scheduler")

# A dataplane with no Turns stream open for this long is forgotten (its entry in /status's
# `dataplanes`); what came through it stays, as after any stream's end: its runs until they go idle
# or move to another dataplane, its turns in flight until reported or TURN_TIMEOUT_S (core/turns.py).
DATAPLANE_FORGET_S = 300.0


class Link:
    """One dataplane's Turns stream as the host sees it: the turns waiting on it for an answer
    (by turn id, with their run), the placements ready to be written to it, and whether it has
    yet to hear that the scheduler started or stopped holding turns."""

    __slots__ = (
        "dataplane",
        "waiting",
        "outbox",
        "reserved",
        "revoked",
        "nothing_held",
        "told",
        "ready",
        "closed",
        "foreign_logged",
        "ended",
    )

    def __init__(self, dataplane: str = "") -> None:
        self.dataplane = dataplane
        self.waiting: dict[str, str] = {}
        self.outbox: list[pb.Placement] = []
        # Reservations granted and revoked since the last message (see core.reserve).
        self.reserved: list[pb.Reservation] = []
        self.revoked: list[str] = []
        self.nothing_held = False
        self.told = True
        self.ready = asyncio.Event()
        self.closed = False
        # Whether a report on another dataplane's turn has been logged for this stream (once).
        self.foreign_logged = False
        # Runs ended elsewhere, for the dataplane to drop from its book (SchedulerBatch.ended_runs).
        self.ended: list[str] = []

    def answer(self, action: Place | Refuse) -> None:
        self.waiting.pop(action.turn_id, None)
        self.outbox.append(placement(action))
        self.ready.set()

    def reserve(self, action: Reserved) -> None:
        self.reserved.append(
            pb.Reservation(
                id=action.reservation_id, replica=action.replica, url=action.url, models=action.models
            )
        )
        self.ready.set()

    def revoke(self, action: Revoked) -> None:
        self.revoked.extend(action.reservation_ids)
        self.ready.set()

    def end(self, run_ids: Sequence[str]) -> None:
        """The runs ended through another stream: this one's dataplane is told to let them go."""
        self.ended.extend(run_ids)
        self.ready.set()

    def tell(self, nothing_held: bool) -> None:
        """The scheduler now holds no turn (True) or holds some (False): the dataplane is told,
        in a message of its own if no placement is going out."""
        self.nothing_held = nothing_held
        self.told = False
        self.ready.set()

    def take(self) -> pb.SchedulerBatch | None:
        """The message to write now, None when there is nothing new; waits again unless the
        stream is over. Every message says whether the scheduler holds any turn."""
        out, self.outbox = self.outbox, []
        if not self.closed:
            self.ready.clear()
        if not out and self.told and not self.reserved and not self.revoked and not self.ended:
            return None
        self.told = True
        batch = pb.SchedulerBatch(placements=out, nothing_held=self.nothing_held)
        if self.ended:
            batch.ended_runs.extend(self.ended)
            self.ended = []
        if self.reserved or self.revoked:
            batch.reservations.extend(self.reserved)
            batch.revoked.extend(self.revoked)
            self.reserved, self.revoked = [], []
        return batch

    def close(self) -> None:
        self.closed = True
        self.ready.set()


@dataclasses.dataclass(slots=True)
class DataplaneSeen:
    """What the host knows of one dataplane (by the name it gives, dataplane/scheduler_client.py
    `dataplane_name`; "" for one that gives none), kept until it has been gone `DATAPLANE_FORGET_S`."""

    streams: int = 0  # Turns streams open now
    resyncs: int = 0
    # What its last resync carried.
    runs: int = 0
    turns: int = 0
    # Since when (on the events' clock) it has had no stream open; None while it has one.
    gone_since: float | None = None

    def document(self, name: str) -> dict[str, Any]:
        return {"name": name, "streams": self.streams, "resyncs": self.resyncs,
                "last_resync": {"runs": self.runs, "turns": self.turns}}  # fmt: skip


class SchedulerHost:
    """Holds the current state, feeds it events, and carries out the actions that come back."""

    def __init__(self, config: _config.Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.state = State()
        self.identity = RunIdentity()
        self.dataplanes: dict[str, DataplaneSeen] = {}
        # The stream each held turn's answer goes to.
        self._waiting: dict[str, Link] = {}
        # Every Turns stream open, and whether they were last told that nothing is held.
        self._links: set[Link] = set()
        # Each dataplane's latest stream: where its reservations go.
        self._link_of: dict[str, Link] = {}
        self._nothing_held = True
        # Runs ended lately, wherever their DELETE landed; and per dataplane, the ended runs its
        # last resync still named, for its stream to be told when it opens.
        self.ended = EndedRuns()
        self._left_out: dict[str, list[str]] = {}
        # Counted for the metrics as decisions are carried out (the gauges are read from the state).
        self.counts = HostCounts()
        # Held turns per class, sampled every tick: the status page's chart.
        self.held_history = HeldHistory()
        # With tracing on: each held turn's traceparent and when it arrived (ns), for its admit span.
        self._arrivals: dict[str, tuple[str, int]] = {}
        self.feed(ev.PoolConfigured.from_config(config.replicas, at=clock()))

    def feed(self, event: ev.Event) -> tuple[Action, ...]:
        before = self.state
        self.state, actions = decide(self.state, event)
        if isinstance(event, ev.ReplicaProbed):
            self._log_health_change(before, event)
            if not event.healthy:
                self.counts.probe_failures[event.name] += 1
        elif isinstance(event, (ev.TurnFailed, ev.Tick)):
            self._log_ejections(before)
        decisions = self.counts.decisions
        for action in actions:
            decisions[ACTION_NAMES[type(action)]] += 1
            self._carry_out(action)
        nothing_held = not self.state.held_groups
        if nothing_held is not self._nothing_held:
            # Whether a decision may be waiting on the dataplanes' events changed: they are told.
            self._nothing_held = nothing_held
            for link in self._links:
                link.tell(nothing_held)
        return actions

    def _carry_out(self, action: Action) -> None:
        match action:
            case Place() | Refuse():
                if isinstance(action, Refuse):
                    log.info("turn %s refused: %s", action.turn_id, action.message)
                else:
                    log.debug("turn %s of run %s placed on %s after %.3f s", action.turn_id, action.run_id,
                              action.replica, action.held_s)  # fmt: skip
                link = self._waiting.pop(action.turn_id, None)
                if link is not None:
                    link.answer(action)
                if tracing.TRACER is not None:
                    self._admit_span(action.turn_id, action.run_id, action)
            case TurnExpired():
                log.warning("turn %s of run %s on %s never reported done; dropped, its slot freed",
                            action.turn_id, action.run_id, action.replica)  # fmt: skip
            case RunForgotten():
                log.debug("run %s forgotten (%s)", action.run_id, action.reason)
                self.identity.forget(action.run_id)
            case Reserved() | Revoked():
                # The core grants only to a dataplane whose stream is open (DataplaneLeft ends them).
                owner = self._link_of.get(action.dataplane)
                if owner is not None:
                    if isinstance(action, Reserved):
                        owner.reserve(action)
                    else:
                        owner.revoke(action)

    def _log_ejections(self, before: State) -> None:
        """A replica taken out of rotation for failing turns, or back in (scheduler/outliers.py)."""
        for name, replica in self.state.replicas.items():
            old = before.replicas.get(name)
            if old is None or old.outlier.ejected_until == replica.outlier.ejected_until:
                continue
            record = replica.outlier
            if record.ejected_until is not None:
                log.warning(
                    "replica %s ejected for %.0f s: its turns kept failing (%d in a row, %d of %d lately; ejection %d)",
                    name,
                    record.ejected_until - self.state.now,
                    record.consecutive,
                    record.failures,
                    record.turns,
                    record.ejections,
                )
            else:
                log.info("replica %s is back from its ejection", name)

    def _log_health_change(self, before: State, probe: ev.ReplicaProbed) -> None:
        old = before.replicas.get(probe.name)
        if old is not None and (old.healthy != probe.healthy or not old.probed):
            log.info("replica %s is %s", probe.name, "healthy" if probe.healthy else "unhealthy")

    def _admit_span(self, turn_id: str, run_id: str, answer: Place | Refuse | None) -> None:
        """The `admit` span of a turn the core placed or refused (`answer`), or that was abandoned
        while held (None): from its arrival to now, a child of the dataplane's turn span."""
        arrival = self._arrivals.pop(turn_id, None)
        if arrival is None or tracing.TRACER is None:
            return
        traceparent, start_ns = arrival
        span = tracing.TRACER.start_span(
            "admit",
            context=tracing.parent(traceparent),
            start_time=start_ns,
            attributes=_admit_attributes(turn_id, run_id),
        )
        if isinstance(answer, Place):
            span.set_attributes({"luftpause.replica": answer.replica, "luftpause.held_ms": answer.held_s * 1000.0,
                                 "luftpause.reservation": False})  # fmt: skip
        elif isinstance(answer, Refuse):
            span.set_attribute("luftpause.outcome", "refused")
            span.set_status(StatusCode.ERROR, answer.message)
        else:
            span.set_attribute("luftpause.outcome", "abandoned")
        span.end()

    def used_reservation(self, used: ev.ReservationUsed, traceparent: str) -> None:
        """A turn the dataplane sent on a reservation, without asking: fed to the core, and with
        tracing on given the admit span it would otherwise lack, held 0 ms."""
        self.ended.discard(used.turn.run_id)
        self.feed(used)
        if tracing.TRACER is not None:
            attributes = _admit_attributes(used.turn.turn_id, used.turn.run_id)
            attributes.update(
                {"luftpause.replica": used.replica, "luftpause.held_ms": 0.0, "luftpause.reservation": True}
            )
            tracing.TRACER.start_span(
                "admit", context=tracing.parent(traceparent), attributes=attributes
            ).end()

    def trace_arrival(self, turn_id: str, traceparent: str) -> None:
        """With tracing on: the turn's admit span starts now (kept until it is placed, refused or
        abandoned), a child of `traceparent`, the dataplane's turn span. A turn admitted again
        under the same id keeps its first arrival."""
        self._arrivals.setdefault(turn_id, (traceparent, time.time_ns()))

    def admit(self, arrived: ev.TurnArrived, link: Link, echoed: Sequence[str] = ()) -> None:
        """Holds the turn until the core places or refuses it; the answer goes to `link`.

        `echoed`: the tool_call_ids of a turn sent without a run header; one of a known run's
        latest reply puts the turn in that run. A turn admitted again under the same id (its
        dataplane reconnected while the old stream was still open here) is not held twice: its
        answer goes to the newer stream.
        """
        if echoed:
            run_id = self.identity.run_of(echoed)
            if run_id is not None:
                arrived = dataclasses.replace(arrived, run_id=run_id)
        # A turn of an id that ended: the id is in use again.
        self.ended.discard(arrived.run_id)
        owner = self._waiting.get(arrived.turn_id)
        self._waiting[arrived.turn_id] = link
        link.waiting[arrived.turn_id] = arrived.run_id
        if owner is not None:
            if owner is not link:
                owner.waiting.pop(arrived.turn_id, None)
            return
        self.feed(arrived)

    def report(self, event: ev.Event) -> None:
        """A turn event from a dataplane; a reply's tool calls are remembered for its run's next
        turn, and a run's end is told to every stream, as other workers' books may hold the run."""
        if isinstance(event, ev.RunEnded):
            self._run_ended(event.run_id, event.at)
            return
        self.feed(event)
        if isinstance(event, ev.TurnCompleted) and event.tool_call_ids and event.run_id in self.state.runs:
            self.identity.remember(event.run_id, event.tool_call_ids)

    def _run_ended(self, run_id: str, at: float) -> None:
        """The run is over (a DELETE reached some dataplane): forgotten here, remembered as ended,
        and every stream told so that no book keeps it."""
        if self.ended.add(run_id, at):
            for link in self._links:
                link.end((run_id,))
        if run_id in self.state.runs:
            self.feed(ev.RunEnded(run_id, at))

    def resync(self, request: pb.ResyncRequest, dataplane: str) -> None:
        """Replaces what came through `dataplane` with its view (the core's `Resynced`), and the
        tool_call_ids of the runs it names with its word on them. A run ended lately is left out
        of it (its stream is told once it opens); the runs it says it ended are ended."""
        now = self.clock()
        self.ended.prune(now)
        left_out = [r.run_id for r in request.runs if r.run_id in self.ended]
        if left_out:
            kept = [r for r in request.runs if r.run_id not in self.ended]
            request = pb.ResyncRequest(runs=kept, turns=request.turns, ended_runs=request.ended_runs)
            self._left_out[dataplane] = left_out
            log.info("resync%s named %d runs ended lately: left out, its stream will be told",
                     f" from {dataplane}" if dataplane else "", len(left_out))  # fmt: skip
        else:
            self._left_out.pop(dataplane, None)
        self.feed(resynced(request, now, dataplane))
        for run_id in request.ended_runs:
            self._run_ended(run_id, now)
        seen = self._seen(dataplane)
        seen.resyncs, seen.runs, seen.turns = seen.resyncs + 1, len(request.runs), len(request.turns)
        self.counts.resyncs += 1
        runs = self.state.runs
        self.identity.keep_only(runs)
        for r in request.runs:
            if r.tool_call_ids and r.run_id in runs and runs[r.run_id].dataplane == dataplane:
                self.identity.remember(r.run_id, r.tool_call_ids)

    def abandon(self, turn_id: str, run_id: str) -> None:
        """The client left: the turn leaves the queue if held, or frees its slot if just placed."""
        link = self._waiting.pop(turn_id, None)
        if link is not None:
            link.waiting.pop(turn_id, None)
        self.feed(ev.TurnAbandoned(turn_id, run_id, self.clock()))
        if turn_id in self._arrivals:
            self._admit_span(turn_id, run_id, None)

    def _seen(self, dataplane: str) -> DataplaneSeen:
        seen = self.dataplanes.get(dataplane)
        if seen is None:
            # Gone until its stream opens (a resync comes first).
            seen = self.dataplanes[dataplane] = DataplaneSeen(gone_since=self.clock())
        return seen

    def connect(self, link: Link) -> None:
        seen = self._seen(link.dataplane)
        seen.streams += 1
        seen.gone_since = None
        self._links.add(link)
        previous = self._link_of.get(link.dataplane)
        self._link_of[link.dataplane] = link
        left_out = self._left_out.pop(link.dataplane, None)
        if left_out:
            link.end(left_out)
        if previous is not None:
            # It reconnected while its old stream is still open here: what that one was granted is void.
            self.feed(ev.DataplaneLeft(link.dataplane, self.clock()))
        link.tell(self._nothing_held)

    def streams_open(self) -> int:
        return len(self._links)

    def dataplane_documents(self) -> list[dict[str, Any]]:
        return [seen.document(name) for name, seen in sorted(self.dataplanes.items())]

    def disconnect(self, link: Link) -> None:
        """A stream ended: the turns still waiting on it are abandoned, as their dataplane is gone
        (or will admit them again, under the same ids, once it has reconnected and resynced)."""
        link.close()
        self._links.discard(link)
        seen = self._seen(link.dataplane)
        seen.streams -= 1
        if not seen.streams:
            seen.gone_since = self.clock()
        if self._link_of.get(link.dataplane) is link:
            del self._link_of[link.dataplane]
            self.feed(ev.DataplaneLeft(link.dataplane, self.clock()))
        for turn_id, run_id in list(link.waiting.items()):
            if self._waiting.get(turn_id) is link:
                self.abandon(turn_id, run_id)
        link.waiting.clear()

    def tick(self) -> None:
        now = self.clock()
        self.feed(ev.Tick(now))
        self.held_history.sample(self.state, now)
        for name, seen in list(self.dataplanes.items()):
            if seen.gone_since is not None and now - seen.gone_since >= DATAPLANE_FORGET_S:
                del self.dataplanes[name]
                self._left_out.pop(name, None)
                log.info("dataplane %r forgotten: no stream from it for %.0f s", name, now - seen.gone_since)

    def owns(self, link: Link, turn_id: str) -> bool:
        """Whether `link` may report on the turn: one the scheduler knows was admitted (or
        resynced) through another dataplane is not its to speak for; such a report is ignored,
        logged once a stream. A turn not known here (already ended, never ours) is anyone's."""
        turn = self.state.turns.get(turn_id)
        if turn is None or turn.dataplane == link.dataplane:
            return True
        if not link.foreign_logged:
            link.foreign_logged = True
            log.warning("dataplane %r reported on turn %s of dataplane %r: ignored (logged once a stream)",
                        link.dataplane, turn_id, turn.dataplane)  # fmt: skip
        return False


def _admit_attributes(turn_id: str, run_id: str) -> dict[str, str | float | bool]:
    return {"luftpause.turn_id": turn_id, "luftpause.run_id": run_id}


class BatchTooLarge(Exception):
    """A Turns message carried more items than `MAX_BATCH_ITEMS`: its stream ends with this, unapplied."""

    def __init__(self, items: int, dataplane: str) -> None:
        self.dataplane = dataplane
        super().__init__(
            f"a Turns message carried {items} items; at most {MAX_BATCH_ITEMS} a message "
            "(MAX_BATCH_ITEMS, luftpause/proto/__init__.py): send them over several messages"
        )


class SchedulerService(rpc.SchedulerServicer):
    """The gRPC face of `SchedulerHost`."""

    def __init__(self, host: SchedulerHost) -> None:
        self.host = host

    async def Turns(
        self,
        request_iterator: AsyncIterable[pb.DataplaneBatch],
        context: grpc.aio.ServicerContext[pb.DataplaneBatch, pb.SchedulerBatch],
    ) -> None:
        link = Link(dataplane_of(context))
        self.host.connect(link)
        reader = asyncio.ensure_future(self._read(request_iterator, link))
        try:
            while True:
                await link.ready.wait()
                batch = link.take()
                if batch is not None:
                    await context.write(batch)
                elif link.closed:
                    break
        finally:
            reader.cancel()
            self.host.disconnect(link)
        if not reader.cancelled() and (error := reader.exception()) is not None:
            if isinstance(error, BatchTooLarge):
                log.warning(
                    "turns stream%s ended: %s", f" of {link.dataplane}" if link.dataplane else "", error
                )
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            raise error

    async def _read(self, request_iterator: AsyncIterable[pb.DataplaneBatch], link: Link) -> None:
        try:
            async for batch in request_iterator:
                if len(batch.items) > MAX_BATCH_ITEMS:
                    # Refused whole, before any of it is applied: applying it would stall the loop.
                    raise BatchTooLarge(len(batch.items), link.dataplane)
                for item in batch.items:
                    self._apply(item, link)
        finally:
            link.close()

    def _apply(self, item: pb.DataplaneItem, link: Link) -> None:
        host = self.host
        match item.WhichOneof("item"):
            case "admit":
                request = item.admit
                if not request.turn_id:
                    log.warning("an admit without a turn_id was ignored (run %r)", request.run_id)
                    return
                arrived = ev.TurnArrived(**turn_fields(request), at=host.clock(), dataplane=link.dataplane)
                if tracing.TRACER is not None:
                    host.trace_arrival(request.turn_id, request.traceparent)
                host.admit(arrived, link, request.echoed_tool_call_ids)
                return
            case "reservation_used":
                used = item.reservation_used
                if not used.admit.turn_id:
                    log.warning("a used reservation without a turn_id was ignored (%r)", used.reservation_id)
                    return
                at = host.clock()
                arrived = ev.TurnArrived(**turn_fields(used.admit), at=at, dataplane=link.dataplane)
                host.used_reservation(
                    ev.ReservationUsed(used.reservation_id, used.replica, arrived, at), used.admit.traceparent
                )
                return
            case "reservation_returned":
                host.feed(ev.ReservationReturned(item.reservation_returned, host.clock()))
                return
            case "want_reservations":
                host.feed(ev.ReservationsWanted(link.dataplane, host.clock()))
                return
        message = item.event
        if message.turn_id and not host.owns(link, message.turn_id):
            return
        if message.WhichOneof("event") == "abandoned":
            host.abandon(message.turn_id, message.run_id)
            return
        event = turn_event(message, host.clock())
        if event is not None:
            host.report(event)

    async def Resync(
        self,
        request_iterator: AsyncIterable[pb.ResyncRequest],
        context: grpc.aio.ServicerContext[pb.ResyncRequest, pb.ResyncReply],
    ) -> pb.ResyncReply:
        # The whole view first: a stream that breaks off before its end leaves the state as it was.
        whole = pb.ResyncRequest()
        async for chunk in request_iterator:
            whole.runs.extend(chunk.runs)
            whole.turns.extend(chunk.turns)
            whole.ended_runs.extend(chunk.ended_runs)
        dataplane = dataplane_of(context)
        self.host.resync(whole, dataplane)
        state = self.host.state
        log.info("resynced%s: %d runs, %d turns in flight", f" from {dataplane}" if dataplane else "",
                 len(state.runs), len(state.placed()))  # fmt: skip
        return pb.ResyncReply(runs=len(state.runs), turns=len(state.placed()))


# The request and response messages of whichever call an interceptor or handler sees.
