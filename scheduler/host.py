"""The scheduler process: the gRPC server, the prober, the clock and the status server around `decide`.

Everything here translates. Each dataplane keeps one Turns stream open (a `Link` here): an admit
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
carry it as a bearer token (`BearerCheck`). All of it runs on one asyncio event loop and
`SchedulerHost.feed` never awaits, so calls into `decide` are serialised without a lock: each runs
to completion, actions included, before the next event is looked at.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import StatusCode

from luftpause import config as _config
from luftpause import counts, http_server, tracing
from luftpause.bearer import bearer_matches, token_from_env
from luftpause.config import TOKEN_ENV
from luftpause.hosts import HostGuard, allowed_hosts
from luftpause.lifecycle import EndedRuns
from luftpause.proto import DATAPLANE_KEY, MAX_BATCH_ITEMS, pb, rpc
from luftpause.scheduler import events as ev
from luftpause.scheduler.actions import Action, Place, Refuse, Reserved, Revoked, RunForgotten, TurnExpired
from luftpause.scheduler.core import decide
from luftpause.scheduler.metrics import ACTION_NAMES, HostCounts, SchedulerCollector, registry_of
from luftpause.scheduler.prober import run_prober
from luftpause.scheduler.run_identity import RunIdentity
from luftpause.scheduler.state import Kind, Phase, ServiceClass, State
from luftpause.scheduler.status import HeldHistory, build_app, runtime_origins

log = logging.getLogger("luftpause.scheduler")

TICK_PERIOD_S = 1.0
# A dataplane with no Turns stream open for this long is forgotten (its entry in /status's
# `dataplanes`); what came through it stays, as after any stream's end: its runs until they go idle
# or move to another dataplane, its turns in flight until reported or TURN_TIMEOUT_S (core.py).
DATAPLANE_FORGET_S = 300.0
# How long a refused call's request stream is read before the refusal is sent.
REFUSAL_DRAIN_S = 1.0

_CLASSES = {pb.INTERACTIVE: ServiceClass.INTERACTIVE, pb.BATCH: ServiceClass.BATCH}
_KINDS = {pb.GENERATIVE: Kind.GENERATIVE, pb.SINGLE_PASS: Kind.SINGLE_PASS}
_PHASES = {pb.IDLE: Phase.IDLE, pb.GENERATING: Phase.GENERATING, pb.PAUSED: Phase.PAUSED}


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
        # Reservations granted and revoked since the last message (see core._reserve).
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


def placement(action: Place | Refuse) -> pb.Placement:
    """The core's answer to a turn as the dataplane reads it."""
    if isinstance(action, Refuse):
        reply = pb.AdmitReply(
            outcome=pb.AdmitReply.UNKNOWN_MODEL, message=action.message, run_id=action.run_id
        )
    else:
        reply = pb.AdmitReply(
            outcome=pb.AdmitReply.PLACED,
            replica=action.replica,
            url=action.url,
            held_ms=action.held_s * 1000.0,
            run_id=action.run_id,
            reservation_id=action.reservation_id,
        )
        if action.slot is not None:
            reply.slot = action.slot
    return pb.Placement(turn_id=action.turn_id, reply=reply)


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


def turn_event(message: pb.TurnEvent, at: float) -> ev.Event | None:
    """The core event for one turn event from the Turns stream, or None for one with no event set."""
    match message.WhichOneof("event"):
        case "started":
            return ev.TurnStarted(message.turn_id, message.run_id, at, message.started.streamed)
        case "first_token":
            return ev.FirstToken(message.turn_id, message.run_id, at)
        case "completed":
            c = message.completed
            # A count out of range is unknown, as one never sent (0 on the wire): luftpause/counts.py.
            return ev.TurnCompleted(
                message.turn_id,
                message.run_id,
                c.finish_reason,
                counts.token_count(c.prompt_tokens) or 0,
                counts.token_count(c.completion_tokens) or 0,
                tuple(c.tool_call_ids),
                at,
            )
        case "failed":
            failed = message.failed
            return ev.TurnFailed(message.turn_id, message.run_id, failed.error, at, failed.replica_fault)
        case "abandoned":
            return ev.TurnAbandoned(message.turn_id, message.run_id, at)
        case "run_ended":
            return ev.RunEnded(message.run_id, at)
    return None


def _admit_attributes(turn_id: str, run_id: str) -> dict[str, str | float | bool]:
    return {"luftpause.turn_id": turn_id, "luftpause.run_id": run_id}


def _turn_fields(message: pb.AdmitRequest | pb.InFlightTurn) -> dict[str, Any]:
    """What an admission and a turn in a resync say alike about a turn, as the core's fields; an
    admission also its size, which a turn in a resync does not carry."""
    fields: dict[str, Any] = {
        "turn_id": message.turn_id,
        "run_id": message.run_id,
        "service_class": _CLASSES.get(message.service_class, ServiceClass.INTERACTIVE),
        "caller": message.caller,
        "model": message.model,
        "kind": _KINDS.get(message.kind, Kind.GENERATIVE),
    }
    if isinstance(message, pb.AdmitRequest):
        # 0 on the wire is "not sent" (an older dataplane, or a body without max_tokens).
        fields["request_bytes"] = max(0, message.request_bytes)
        fields["max_tokens"] = counts.token_count(message.max_tokens) or None
    return fields


def dataplane_of(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The name a call's dataplane gives itself; "" for a single unnamed one."""
    for key, value in context.invocation_metadata() or ():
        if key == DATAPLANE_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def resynced(request: pb.ResyncRequest, at: float, dataplane: str = "") -> ev.Resynced:
    """The core event for a whole resync (its messages' runs and turns put together)."""
    return ev.Resynced(
        runs=tuple(
            ev.ResyncedRun(
                run_id=r.run_id,
                replica=r.replica or None,
                phase=_PHASES.get(r.phase, Phase.IDLE),
                service_class=_CLASSES.get(r.service_class, ServiceClass.INTERACTIVE),
                caller=r.caller,
                # Not a finite time (NaN, inf, negative): unknown, taken as active just now.
                idle_s=counts.duration_s(r.idle_s) or 0.0,
            )
            for r in request.runs
        ),
        turns=tuple(ev.ResyncedTurn(**_turn_fields(t), replica=t.replica) for t in request.turns),
        at=at,
        dataplane=dataplane,
    )


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
                arrived = ev.TurnArrived(**_turn_fields(request), at=host.clock(), dataplane=link.dataplane)
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
                arrived = ev.TurnArrived(**_turn_fields(used.admit), at=at, dataplane=link.dataplane)
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
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class BearerCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks `authorization: Bearer <token>`,
    compared in constant time as the dataplane compares its clients' (dataplane/auth.py)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, str):  # gRPC gives bytes only for keys ending in -bin
            authorization = authorization.encode()
        if handler is None or bearer_matches(authorization or None, self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler[_Req, _Resp]) -> grpc.RpcMethodHandler[_Req, _Resp]:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED and does nothing else."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[_Req, _Resp]) -> None:
        if handler.request_streaming:
            # Read what the client sends (for a moment at most) before answering: a stream closed
            # under a client still writing reaches it as INTERNAL, not as the refusal.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REFUSAL_DRAIN_S):
                    async for _ in request:
                        pass
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token (see {TOKEN_ENV})"
        )

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip


def grpc_server(token: str | None) -> grpc.aio.Server:
    """The scheduler's gRPC server, taking only calls that carry `token` when there is one."""
    return grpc.aio.server(
        interceptors=[BearerCheck(token)] if token else None,
        # gRPC sets SO_REUSEPORT by default, which lets a second scheduler bind the same port and
        # take half of the first one's connections; a port in use must be an error instead.
        options=[("grpc.so_reuseport", 0)],
    )


class _StatusServer(http_server.Server):
    """The status port, bounded as every HTTP port is (luftpause/http_server.py, `[scheduler]`)."""

    # The process handles SIGTERM/SIGINT itself (see `_main`) and then stops this server.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # uvicorn's own backlog: a burst of connections waits in the kernel's queue rather than
    # having its handshakes dropped (and retried a second later).
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _ticks(host: SchedulerHost) -> None:
    while True:
        await asyncio.sleep(TICK_PERIOD_S)
        host.tick()


async def _main(config: _config.Config) -> None:
    settings = config.scheduler
    host = SchedulerHost(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    try:
        status_socket = _listen(settings.host, settings.status_port)
    except OSError as e:
        raise SystemExit(
            f"luftpause scheduler: cannot listen on {settings.host}:{settings.status_port}: {e.strerror}"
        ) from None

    token = token_from_env(f"the scheduler's gRPC port takes calls from anyone who can reach {settings.host}")
    server = grpc_server(token)
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    try:
        bound = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        status_socket.close()
        raise SystemExit(f"luftpause scheduler: cannot listen on {settings.host}:{settings.grpc_port} (gRPC)")
    await server.start()

    status = _StatusServer(
        http_server.uvicorn_config(
            HostGuard(
                build_app(
                    lambda: host.state,
                    host.clock,
                    token,
                    host.dataplane_documents,
                    registry_of(
                        SchedulerCollector(lambda: host.state, host.clock, host.counts, host.streams_open)
                    ),
                    host.held_history,
                    runtime_origins(config),
                ),
                allowed_hosts(config),
            ),
            settings,
            "scheduler",
            log_level="warning",
            access_log=False,
            lifespan="off",
        ),
        settings,
        "scheduler",
    )
    tasks = [
        asyncio.create_task(status.serve(sockets=[status_socket]), name="status"),
        asyncio.create_task(
            run_prober(config.replicas, settings.probe_period_s, host.feed, host.clock), name="prober"
        ),
        asyncio.create_task(_ticks(host), name="clock"),
    ]
    log.info(
        "gRPC on %s:%d, status on http://%s:%d/, %d replicas: %s",
        settings.host,
        settings.grpc_port,
        settings.host,
        settings.status_port,
        len(config.replicas),
        ", ".join(r.name for r in config.replicas),
    )

    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failed = [t for t in done if t is not stopped]
    for task in failed:
        log.error("the %s task stopped unexpectedly", task.get_name(), exc_info=task.exception())

    log.info("stopping")
    status.should_exit = True
    # Open Turns streams are cancelled here; their held turns leave the queue as abandoned.
    await server.stop(grace=1.0)
    for task in tasks[1:]:
        task.cancel()
    stopped.cancel()
    await asyncio.gather(*tasks, stopped, return_exceptions=True)
    if failed:
        raise SystemExit(1)


def serve(config: _config.Config) -> None:
    """Runs the scheduler in the foreground until SIGTERM or SIGINT."""
    tracing.setup("luftpause-scheduler")
    asyncio.run(_main(config))
