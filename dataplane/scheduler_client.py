"""The dataplane's side of the scheduler contract: Admit per turn, one Report stream, Resync.

Admission is a unary call held by the scheduler until the turn is placed or refused; cancelling
it abandons the turn. Turn events go out on one long-lived client stream fed from a queue, so
reporting never waits on the network. The scheduler may be down or restarting at any moment:

- an Admit that finds it unreachable is retried every second under the same turn id, and only
  once the connection has been re-established and resynced;
- when the report stream breaks, it is reopened a second later, and before that (and before any
  admission goes out again) Resync replaces the scheduler's view of runs and turns in flight
  with the dataplane's own (`runs.RunBook`), which every reported event has also updated.

Events still queued when the stream broke are dropped rather than resent: the resync already
carries their effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from luftpause.dataplane.errors import SchedulerFailed, UnknownModel
from luftpause.dataplane.runs import PlacedTurn, RunBook
from luftpause.proto import pb, rpc

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
ADMIT_RETRY_S = 1.0
# A scheduler that takes the connection but never answers the resync is treated as unreachable.
RESYNC_TIMEOUT_S = 10.0

# Status codes meaning the scheduler is not there to answer (down, restarting, or shutting down
# and cancelling its calls), as opposed to having answered with an error.
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

_CHANNEL_OPTIONS = [
    # gRPC's own reconnect backoff grows to two minutes by default; a restarted scheduler must
    # be found again within about the report reconnect period.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class SchedulerClient:
    """One connection to the scheduler; open with `start()`, close with `close()`."""

    def __init__(self, target: str, runs: RunBook, token: str | None = None) -> None:
        self._target = target
        self.runs = runs
        # The scheduler's gRPC port takes only calls carrying the token (scheduler/host.py).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: rpc.SchedulerStub | None = None
        # One queue per report stream; None tells a stream's feeder that its stream is over.
        self._events: asyncio.Queue[pb.TurnEvent | None] = asyncio.Queue()
        self._synced = asyncio.Event()
        self._report_call: grpc.aio.StreamUnaryCall | None = None
        self._report_task: asyncio.Task[None] | None = None
        self._outage_logged = False

    @property
    def connected(self) -> bool:
        """Resynced and reporting: admissions go out."""
        return self._synced.is_set()

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
        self._stub = rpc.SchedulerStub(self._channel)
        self._report_task = asyncio.create_task(self._keep_reporting(), name="scheduler-report")

    async def close(self) -> None:
        if self._report_task is not None:
            self._report_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._report_task
        if self._channel is not None:
            await self._channel.close(grace=None)

    # -- admission --

    async def admit(
        self, request: pb.AdmitRequest, abandoned: asyncio.Future[object]
    ) -> pb.AdmitReply | None:
        """Waits until the scheduler places the turn; raises UnknownModel or SchedulerFailed.

        While the scheduler is unreachable this keeps trying, every second, under the same turn
        id. When `abandoned` completes first (the client left), the call is cancelled, which the
        scheduler takes as the turn being abandoned, and None is returned; if the scheduler had
        placed the turn at that very moment, its reply is returned all the same and the caller
        must report the turn failed to free the slot. A cancel that gRPC accepts does not prove
        the scheduler had not placed the turn already (its reply may be on the wire), so the
        turn is then also reported abandoned on the report stream (`_abandon`).
        """
        assert self._stub is not None, "start() first"
        while True:
            synced = asyncio.ensure_future(self._synced.wait())
            if not await _first(synced, abandoned):
                return None
            call = self._stub.Admit(request, metadata=self._metadata)
            answered = asyncio.ensure_future(_reply_of(call))
            try:
                await asyncio.wait({answered, abandoned}, return_when=asyncio.FIRST_COMPLETED)
                # cancel() is False when the reply is already in: then it is read like any other.
                if not answered.done() and call.cancel():
                    answered.cancel()
                    self._abandon(request)
                    return None
                await asyncio.wait({answered})
            except asyncio.CancelledError:
                if call.cancel():
                    self._abandon(request)
                answered.cancel()
                raise
            error = answered.exception()
            if isinstance(error, grpc.aio.AioRpcError):
                if error.code() not in _UNREACHABLE:
                    raise SchedulerFailed(f"scheduler: {error.code().name}: {error.details()}")
                log.warning(
                    "scheduler unreachable for turn %s (%s); retrying", request.turn_id, error.code().name
                )
                self._connection_lost()
                pause = asyncio.ensure_future(asyncio.sleep(ADMIT_RETRY_S))
                if not await _first(pause, abandoned):
                    return None
                continue
            if error is not None:
                raise error
            reply = answered.result()
            if reply.outcome == pb.AdmitReply.UNKNOWN_MODEL:
                raise UnknownModel(reply.message or f"no Generative replica serves model '{request.model}'")
            return reply

    # -- reporting --

    def placed(self, turn: PlacedTurn) -> None:
        self.runs.placed(turn)

    def report(self, event: pb.TurnEvent) -> None:
        """Records the event in the run book and queues it for the scheduler; never blocks."""
        self.runs.apply(event)
        self._events.put_nowait(event)

    def _abandon(self, request: pb.AdmitRequest) -> None:
        """Tells the scheduler that a turn whose Admit we cancelled is abandoned, wherever it is:
        held (the cancel says so as well), or placed just before the cancel, with a reply we will
        never read and a slot that would otherwise stay taken until the turn timeout."""
        self.report(pb.TurnEvent(turn_id=request.turn_id, run_id=request.run_id, abandoned=pb.TurnAbandoned()))

    def _connection_lost(self) -> None:
        """Makes the report loop reconnect and resync before anything else is admitted."""
        self._synced.clear()
        if self._report_call is not None:
            self._report_call.cancel()

    @staticmethod
    async def _outgoing(events: asyncio.Queue[pb.TurnEvent | None]) -> AsyncIterator[pb.TurnEvent]:
        while (event := await events.get()) is not None:
            yield event

    async def _keep_reporting(self) -> None:
        assert self._stub is not None
        while True:
            try:
                # Events still queued for the last stream are already part of the run book the
                # resync sends; gRPC may keep that stream's feeder waiting on its queue, so it is
                # told to stop rather than left to take events meant for the new stream.
                self._events.put_nowait(None)
                self._events = asyncio.Queue()
                chunks = self.runs.resync_chunks()
                await self._stub.Resync(iter(chunks), timeout=RESYNC_TIMEOUT_S, metadata=self._metadata)
                self._report_call = self._stub.Report(self._outgoing(self._events), metadata=self._metadata)
                self._synced.set()
                self._outage_logged = False
                log.info(
                    "connected to scheduler at %s (resynced %d runs, %d turns in flight)",
                    self._target,
                    sum(len(c.runs) for c in chunks),
                    sum(len(c.turns) for c in chunks),
                )
                await self._report_call
                log.warning("scheduler ended the report stream; reconnecting")
            except grpc.aio.AioRpcError as e:
                if self._synced.is_set():
                    log.warning("report stream to the scheduler broke (%s); reconnecting", e.code().name)
                elif e.code() in _UNREACHABLE:
                    # Once per outage: turns are held meanwhile, and whoever reads the log should know why.
                    log.log(
                        logging.DEBUG if self._outage_logged else logging.WARNING,
                        "scheduler at %s not reachable (%s); holding turns and retrying every %.0f s",
                        self._target,
                        e.code().name,
                        RECONNECT_S,
                    )
                    self._outage_logged = True
                else:
                    log.warning(
                        "scheduler at %s refused the resync: %s: %s", self._target, e.code().name, e.details()
                    )
            except asyncio.CancelledError:
                # Our own cancel of the call (to force a resync) lands here too; only a cancel of
                # this task itself ends the loop.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            finally:
                self._synced.clear()
                if self._report_call is not None:
                    self._report_call.cancel()
                    self._report_call = None
            await asyncio.sleep(RECONNECT_S)


async def _reply_of(call: grpc.aio.UnaryUnaryCall) -> pb.AdmitReply:
    return await call


async def _first(work: asyncio.Future[object], abandoned: asyncio.Future[object]) -> bool:
    """Waits for `work` unless `abandoned` completes first; True when `work` finished.

    `work` is cancelled when it loses. When both are done at once, `work` wins: a result that
    arrived must not be dropped.
    """
    try:
        await asyncio.wait({work, abandoned}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    if work.done():
        return True
    work.cancel()
    return False
