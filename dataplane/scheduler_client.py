"""The dataplane's side of the scheduler contract: one Turns stream for admissions and events, Resync.

Admissions and turn events go out on one long-lived bidirectional stream, placements come back
on it. What is ready goes out in one message whenever the stream is free to write (`_write`), so
nothing waits for a batch to fill and a busy dataplane sends one message for many turns (several
when more than `MAX_BATCH_ITEMS` are ready, the most the scheduler takes in one).

Not every event is worth a message of its own: how soon each goes is its urgency, and what
waits for the next message waits in the `outbox.Outbox`.

The scheduler may be down or restarting at any moment:

- a turn waiting for admission stays waiting in the dataplane while the scheduler is away, and
  is admitted again under the same turn id on the next stream;
- when the stream breaks, it is reopened a second later, and before that Resync replaces the
  scheduler's view of runs and turns in flight with the dataplane's own (`runs.RunBook`, this
  client's alone), which every reported event has also updated.

Events still queued when the stream broke are dropped rather than resent: the resync already
carries their effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence

import grpc
import grpc.aio

from luftpause import config as lp_config
from luftpause.dataplane.errors import SchedulerFailed, UnknownModel
from luftpause.dataplane.outbox import Outbox
from luftpause.dataplane.reservations import ReservationPool
from luftpause.dataplane.runs import PRUNE_PERIOD_S, PlacedTurn, RunBook
from luftpause.errors import no_replica_serves
from luftpause.proto import DATAPLANE_KEY, MAX_BATCH_ITEMS, pb, rpc

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
# A scheduler that takes the connection but never answers the resync is treated as unreachable.
RESYNC_TIMEOUT_S = 10.0

# Status codes meaning the scheduler is not there to answer (down, restarting, or shutting down
# and cancelling its calls), as opposed to having answered with an error.
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _channel_options() -> list[tuple[str, int]]:
    return [
        # gRPC's own reconnect backoff grows to two minutes by default; a restarted scheduler must
        # be found again within about the stream reconnect period.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 1000),
        *lp_config.scheduler_keepalive_options(),
    ]


def dataplane_name(settings: lp_config.DataplaneSettings, worker: int | None = None) -> str:
    """The name a dataplane gives itself to the scheduler, which scopes its resync to what came
    through it: `[dataplane] name`, or `<hostname>/<host>:<port>` (no two processes on one
    machine listen on one address and port, and a restart keeps it, so that the restarted
    dataplane's resync replaces what its last life left); worker `k` of several adds `/k`."""
    base = settings.name or f"{socket.gethostname()}/{settings.host}:{settings.port}"
    return base if worker is None else f"{base}/{worker}"


class SchedulerClient:
    """One connection to the scheduler; open with `start()`, close with `close()`."""

    def __init__(
        self, target: str, token: str | None = None, name: str = "", runs: RunBook | None = None
    ) -> None:
        self._target = target
        # The run book is this client's alone: what it reports and what the scheduler says change
        # it, its resyncs read it, and it forgets quiet runs (`_prune_forever`). `runs`: a book
        # to start from (a test's, filled beforehand), else an empty one.
        self.runs = RunBook() if runs is None else runs
        self._pruner: asyncio.Task[None] | None = None
        # The scheduler's gRPC port takes only calls carrying the token (scheduler/grpc_auth.py); the
        # name (`dataplane_name`) scopes this dataplane's resync where several share the scheduler.
        metadata = []
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        if name:
            metadata.append((DATAPLANE_KEY, name))
        self._metadata = tuple(metadata) or None
        self._channel: grpc.aio.Channel | None = None
        self._stub: rpc.SchedulerStub | None = None
        # Turns waiting for their placement, by turn id: re-admitted on every new stream.
        self._pending: dict[str, tuple[pb.AdmitRequest, asyncio.Future[pb.AdmitReply]]] = {}
        # What the current stream is to carry next, and when.
        self._outbox = Outbox()
        # Reservations the scheduler granted on the current stream.
        self._reservations = ReservationPool()
        self._synced = asyncio.Event()
        self._call: grpc.aio.StreamStreamCall[pb.DataplaneBatch, pb.SchedulerBatch] | None = None
        self._stream_task: asyncio.Task[None] | None = None
        self._outage_logged = False
        # Told each time the link comes up (True) or goes down (False): the metrics' gauge.
        self.on_connected: Callable[[bool], None] = lambda _connected: None

    @property
    def connected(self) -> bool:
        """Resynced and streaming: admissions go out."""
        return self._synced.is_set()

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._target, options=_channel_options())
        self._stub = rpc.SchedulerStub(self._channel)
        self._stream_task = asyncio.create_task(self._keep_streaming(), name="scheduler-stream")
        self._pruner = asyncio.create_task(self._prune_forever(), name="dataplane-prune")

    async def close(self) -> None:
        for task in (self._pruner, self._stream_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._channel is not None:
            await self._channel.close(grace=None)

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_PERIOD_S)
            self.runs.prune()

    # -- admission --

    async def admit(self, request: pb.AdmitRequest, abandoned: asyncio.Future[None]) -> pb.AdmitReply | None:
        """Waits until the scheduler places the turn; raises UnknownModel or SchedulerFailed.

        While the scheduler is unreachable the turn waits here, and is admitted again under the
        same turn id once a new stream is up. When `abandoned` completes first (the client
        left), the turn is reported abandoned, which takes it out of the scheduler's queue or,
        if its placement was already on its way, frees the slot; None is returned. When both
        happen at once the placement wins and is returned: the caller must then report the turn
        failed to free the slot.
        """
        assert self._stub is not None, "start() first"
        if self._reservations and not abandoned.done():
            reserved = self._use_reservation(request)
            if reserved is not None:
                return reserved
            self._give_back_room_for(request)
        placed: asyncio.Future[pb.AdmitReply] = asyncio.get_running_loop().create_future()
        self._pending[request.turn_id] = (request, placed)
        self._send(pb.DataplaneItem(admit=request))

        def leave(_: asyncio.Future[None]) -> None:
            # The client left: stop waiting, unless the placement is already here (it wins).
            if not placed.done():
                placed.cancel()

        abandoned.add_done_callback(leave)
        try:
            if abandoned.done():
                placed.cancel()
            reply = await placed
        except asyncio.CancelledError:
            self._withdraw(request)
            task = asyncio.current_task()
            if abandoned.done() and (task is None or task.cancelling() == 0):
                return None
            raise
        finally:
            abandoned.remove_done_callback(leave)
        if reply.outcome == pb.AdmitReply.UNKNOWN_MODEL:
            kind = "generative" if request.kind == pb.GENERATIVE else "single-pass"
            raise UnknownModel(reply.message or no_replica_serves(kind, request.model))
        if reply.outcome != pb.AdmitReply.PLACED:
            raise SchedulerFailed(f"scheduler: unexpected admission outcome {reply.outcome}")
        return reply

    def _use_reservation(self, request: pb.AdmitRequest) -> pb.AdmitReply | None:
        """The placement of a turn that may go without asking, else None.

        It may while the scheduler holds nothing and this dataplane waits on no admission, when
        the turn is a generative one of a run the run book knows, and this dataplane holds a
        reservation on the replica the run last ran on that serves the turn's model: where the
        scheduler would have placed it. Other turns ask: a run the book does not know may have
        run through another dataplane, and one found by its echoed tool_call_ids is the
        scheduler's to name.

        The use rides like a streamed turn's start (the reservation already counts on that
        replica), unless it leaves the replica one or none: then the turn's next event goes at
        once, so that the scheduler, seeing the room again, grants more while the last one still
        serves the next turn.
        """
        if not self._outbox.nothing_held or self._pending:
            return None
        if request.kind != pb.GENERATIVE or request.echoed_tool_call_ids or not request.run_id:
            return None
        booked = self.runs.runs.get(request.run_id)
        if booked is None:
            return None
        reservation = self._reservations.take_for(booked.replica, request.model)
        if reservation is None:
            return None
        used = pb.ReservationUsed(reservation_id=reservation.id, replica=reservation.replica, admit=request)
        self._send(pb.DataplaneItem(reservation_used=used))
        return pb.AdmitReply(
            outcome=pb.AdmitReply.PLACED,
            replica=reservation.replica,
            url=reservation.url,
            run_id=request.run_id,
        )

    def _give_back_room_for(self, request: pb.AdmitRequest) -> None:
        """A turn that asks gives back, ahead of its admission, this dataplane's reservations on
        the replicas that could take it, so that they do not keep it waiting (core.reserve)."""
        if request.kind != pb.GENERATIVE:
            return
        for reservation in self._reservations.take_serving(request.model):
            self._send(pb.DataplaneItem(reservation_returned=reservation.id))

    def _reserved(self, batch: pb.SchedulerBatch) -> None:
        """Reservations granted are kept; those revoked and not yet used are given back at once."""
        self._reservations.granted(list(batch.reservations))
        if batch.revoked:
            for reservation in self._reservations.take_out(set(batch.revoked)):
                self._send(pb.DataplaneItem(reservation_returned=reservation.id))

    def _withdraw(self, request: pb.AdmitRequest) -> None:
        """The client left before the placement was read: the scheduler is told the turn is
        abandoned, wherever it is (held, or placed with a reply we will never read)."""
        if self._pending.pop(request.turn_id, None) is not None:
            self.report(
                pb.TurnEvent(turn_id=request.turn_id, run_id=request.run_id, abandoned=pb.TurnAbandoned())
            )

    def _placed(self, placement: pb.Placement) -> None:
        if placement.reply.reservation_id:
            # The turn took the room of a reservation of ours: it is no longer ours to use.
            self._reservations.take_out({placement.reply.reservation_id})
        # A placement for a turn withdrawn meanwhile is ignored: its abandon is on its way.
        waiting = self._pending.pop(placement.turn_id, None)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(placement.reply)

    # -- reporting: what happened to a placed turn, and to a run --

    def placed(self, turn: PlacedTurn) -> None:
        self.runs.placed(turn)

    def started(self, turn_id: str, run_id: str, streamed: bool) -> None:
        """The engine request went out."""
        self.report(pb.TurnEvent(turn_id=turn_id, run_id=run_id, started=pb.TurnStarted(streamed=streamed)))

    def first_token(self, turn_id: str, run_id: str) -> None:
        self.report(pb.TurnEvent(turn_id=turn_id, run_id=run_id, first_token=pb.FirstToken()))

    def completed(
        self,
        turn_id: str,
        run_id: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        tool_call_ids: list[str],
        tool_names: Sequence[str] = (),
    ) -> None:
        completed = pb.TurnCompleted(
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tool_call_ids=tool_call_ids,
            tool_names=tool_names,
        )
        self.report(pb.TurnEvent(turn_id=turn_id, run_id=run_id, completed=completed))

    def failed(self, turn_id: str, run_id: str, error: str, replica_fault: bool = False) -> None:
        failed = pb.TurnFailed(error=error, replica_fault=replica_fault)
        self.report(pb.TurnEvent(turn_id=turn_id, run_id=run_id, failed=failed))

    def run_ended(self, run_id: str) -> None:
        self.report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))

    def report(self, event: pb.TurnEvent) -> None:
        """Records the event in the run book and queues it for the scheduler; never blocks.
        It goes out, in order with everything else, as soon as its `urgency` asks."""
        self.runs.apply(event)
        self._send(pb.DataplaneItem(event=event))

    def _send(self, item: pb.DataplaneItem) -> None:
        """Queues `item` for the stream, which carries it as soon as its urgency asks."""
        # While no stream is up, events are carried by the next resync and admissions by the
        # pending turns; neither is kept for the stream.
        if not self._synced.is_set():
            return
        self._outbox.put(item, waiting=bool(self._pending) or self._reservations.running_low)

    # -- the stream --

    async def _write(self, call: grpc.aio.StreamStreamCall[pb.DataplaneBatch, pb.SchedulerBatch]) -> None:
        """Writes whatever is ready in one message each time the stream is free. A write that
        fails ends the stream, so that its reader ends too and the stream is opened again."""
        try:
            while True:
                items = await self._outbox.take()
                self._reservations.running_low = False
                # At most MAX_BATCH_ITEMS a message: the scheduler ends a stream that sends more.
                for start in range(0, len(items), MAX_BATCH_ITEMS):
                    await call.write(pb.DataplaneBatch(items=items[start : start + MAX_BATCH_ITEMS]))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.debug("write to the turns stream failed: %r", e)
            call.cancel()

    async def _keep_streaming(self) -> None:
        assert self._stub is not None
        while True:
            writer: asyncio.Future[None] | None = None
            try:
                call = await self._open(self._stub)
                writer = asyncio.ensure_future(self._write(call))
                await self._read(call)
                log.warning("scheduler ended the turns stream; reconnecting")
            except grpc.aio.AioRpcError as e:
                self._log_broken(e)
            except asyncio.CancelledError:
                # gRPC's cancel of the call (a write failed) lands here too; only a cancel of
                # this task itself ends the loop.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            finally:
                if self._synced.is_set():
                    self._synced.clear()
                    self.on_connected(False)
                self._outbox.close()
                self._reservations.clear()
                if writer is not None:
                    writer.cancel()
                if self._call is not None:
                    self._call.cancel()
                    self._call = None
            await asyncio.sleep(RECONNECT_S)

    async def _open(
        self, stub: rpc.SchedulerStub
    ) -> grpc.aio.StreamStreamCall[pb.DataplaneBatch, pb.SchedulerBatch]:
        """Resyncs the scheduler from the run book and opens a new Turns stream on which this
        dataplane takes reservations and admits again the turns still waiting."""
        self._outbox.close()
        chunks = self.runs.resync_chunks()
        await stub.Resync(iter(chunks), timeout=RESYNC_TIMEOUT_S, metadata=self._metadata)
        call: grpc.aio.StreamStreamCall[pb.DataplaneBatch, pb.SchedulerBatch] = stub.Turns(
            metadata=self._metadata
        )
        self._call = call
        self._reservations.clear()
        # This dataplane takes reservations; then the turns still waiting, under their own ids, in the order they came.
        first = [pb.DataplaneItem(want_reservations=pb.WantReservations())]
        first += [pb.DataplaneItem(admit=request) for request, _ in self._pending.values()]
        self._outbox.open(first)
        self._synced.set()
        self.on_connected(True)
        self._outage_logged = False
        log.info(
            "connected to scheduler at %s (resynced %d runs, %d turns in flight); %d held turns admitted again",
            self._target,
            sum(len(c.runs) for c in chunks),
            sum(len(c.turns) for c in chunks),
            len(self._pending),
        )
        return call

    async def _read(self, call: grpc.aio.StreamStreamCall[pb.DataplaneBatch, pb.SchedulerBatch]) -> None:
        """What the scheduler sends on the stream, until it ends it."""
        # Until grpc.aio.EOF, the one thing read that is not a message.
        while isinstance(batch := await call.read(), pb.SchedulerBatch):
            # Reservations first: a placement may name one granted in this same message.
            if batch.reservations or batch.revoked:
                self._reserved(batch)
            for placement in batch.placements:
                self._placed(placement)
            # Runs whose DELETE reached another worker (or dataplane): out of this book.
            for run_id in batch.ended_runs:
                self.runs.forget_run(run_id)
            if batch.nothing_held is not self._outbox.nothing_held:
                self._outbox.told(batch.nothing_held)

    def _log_broken(self, e: grpc.aio.AioRpcError) -> None:
        if self._synced.is_set():
            log.warning("turns stream to the scheduler broke (%s); reconnecting", e.code().name)
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
