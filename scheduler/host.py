"""The scheduler process: the gRPC server, the prober, the clock and the status server around `decide`.

Everything here translates. An Admit call becomes a `TurnArrived` and waits for the `Place` or
`Refuse` the core emits for that turn (at once or after being held); a cancelled Admit becomes a
`TurnAbandoned`. Each message on the Report stream becomes the matching turn event, stamped with
this process's monotonic clock on receipt; a Resync becomes `Resynced`. The prober and a 1 s tick
feed `ReplicaProbed` and `Tick`. With `LUFTPAUSE_TOKEN` set, the gRPC port takes only calls that
carry it as a bearer token (`BearerCheck`). All of it runs on one asyncio event loop and
`SchedulerHost.feed` never awaits, so calls into `decide` are serialised without a lock: each runs
to completion, actions included, before the next event is looked at.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import uvicorn

from luftpause import config as _config
from luftpause.config import TOKEN_ENV
from luftpause.dataplane.auth import bearer_matches
from luftpause.hosts import HostGuard, allowed_hosts
from luftpause.proto import pb, rpc
from luftpause.scheduler import events as ev
from luftpause.scheduler.actions import Action, Place, Refuse, RunForgotten, TurnExpired
from luftpause.scheduler.core import decide
from luftpause.scheduler.prober import run_prober
from luftpause.scheduler.state import Kind, Phase, ServiceClass, State
from luftpause.scheduler.status import build_app

log = logging.getLogger("luftpause.scheduler")

TICK_PERIOD_S = 1.0
# How long an abandon reported before its turn's Admit arrived is remembered.
ABANDONED_EARLY_KEPT_S = 60.0

_CLASSES = {pb.INTERACTIVE: ServiceClass.INTERACTIVE, pb.BATCH: ServiceClass.BATCH}
_KINDS = {pb.GENERATIVE: Kind.GENERATIVE, pb.SINGLE_PASS: Kind.SINGLE_PASS}
_PHASES = {pb.IDLE: Phase.IDLE, pb.GENERATING: Phase.GENERATING, pb.PAUSED: Phase.PAUSED}


class SchedulerHost:
    """Holds the current state, feeds it events, and carries out the actions that come back."""

    def __init__(self, config: _config.Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.state = State()
        # Open Admit calls per turn id; a retried admission may wait beside the first.
        self._waiting: dict[str, list[asyncio.Future[Place | Refuse]]] = {}
        # Turns reported abandoned before their Admit was seen (the Report stream overtook the
        # call the client had just cancelled), by when: such an Admit is dropped on arrival.
        self._abandoned_early: dict[str, float] = {}
        self.feed(ev.PoolConfigured.from_config(config.replicas, at=clock()))

    def feed(self, event: ev.Event) -> tuple[Action, ...]:
        before = self.state
        if isinstance(event, ev.TurnAbandoned) and event.turn_id not in before.turns:
            self._abandoned_early[event.turn_id] = event.at
        self.state, actions = decide(self.state, event)
        if isinstance(event, ev.ReplicaProbed):
            self._log_health_change(before, event)
        for action in actions:
            self._carry_out(action)
        return actions

    def _carry_out(self, action: Action) -> None:
        match action:
            case Place() | Refuse():
                if isinstance(action, Refuse):
                    log.info("turn %s refused: %s", action.turn_id, action.message)
                else:
                    log.debug("turn %s of run %s placed on %s after %.3f s", action.turn_id, action.run_id,
                              action.replica, action.held_s)  # fmt: skip
                for waiter in self._waiting.pop(action.turn_id, []):
                    if not waiter.done():
                        waiter.set_result(action)
            case TurnExpired():
                log.warning("turn %s of run %s on %s never reported done; dropped, its slot freed",
                            action.turn_id, action.run_id, action.replica)  # fmt: skip
            case RunForgotten():
                log.debug("run %s forgotten (%s)", action.run_id, action.reason)

    def _log_health_change(self, before: State, probe: ev.ReplicaProbed) -> None:
        old = before.replicas.get(probe.name)
        if old is not None and (old.healthy != probe.healthy or not old.probed):
            log.info("replica %s is %s", probe.name, "healthy" if probe.healthy else "unhealthy")

    def abandoned_already(self, turn_id: str) -> bool:
        """Whether the dataplane reported this turn abandoned before its Admit arrived."""
        return self._abandoned_early.pop(turn_id, None) is not None

    async def admit(self, arrived: ev.TurnArrived) -> Place | Refuse:
        """Waits until the core places or refuses the turn; cancelling the wait abandons the turn."""
        waiter: asyncio.Future[Place | Refuse] = asyncio.get_running_loop().create_future()
        # Registered before the event is fed, since the answer may come back from this very call.
        self._waiting.setdefault(arrived.turn_id, []).append(waiter)
        self.feed(arrived)
        try:
            return await waiter
        except asyncio.CancelledError:
            others = [w for w in self._waiting.get(arrived.turn_id, []) if w is not waiter]
            if others:
                self._waiting[arrived.turn_id] = others
            else:
                self._waiting.pop(arrived.turn_id, None)
                self.feed(ev.TurnAbandoned(arrived.turn_id, arrived.run_id, self.clock()))
            raise

    def tick(self) -> None:
        now = self.clock()
        self.feed(ev.Tick(now))
        # An Admit comes within moments of its own cancel, or not at all.
        for turn_id in [t for t, at in self._abandoned_early.items() if now - at > ABANDONED_EARLY_KEPT_S]:
            del self._abandoned_early[turn_id]


def turn_event(message: pb.TurnEvent, at: float) -> ev.Event | None:
    """The core event for one Report message, or None for a message with no event set."""
    match message.WhichOneof("event"):
        case "started":
            return ev.TurnStarted(message.turn_id, message.run_id, at, message.started.streamed)
        case "first_token":
            return ev.FirstToken(message.turn_id, message.run_id, at)
        case "completed":
            c = message.completed
            return ev.TurnCompleted(
                message.turn_id,
                message.run_id,
                c.finish_reason,
                c.prompt_tokens,
                c.completion_tokens,
                tuple(c.tool_call_ids),
                at,
            )
        case "failed":
            return ev.TurnFailed(message.turn_id, message.run_id, message.failed.error, at)
        case "abandoned":
            return ev.TurnAbandoned(message.turn_id, message.run_id, at)
        case "run_ended":
            return ev.RunEnded(message.run_id, at)
    return None


def resynced(request: pb.ResyncRequest, at: float) -> ev.Resynced:
    """The core event for a whole resync (its messages' runs and turns put together)."""
    return ev.Resynced(
        runs=tuple(
            ev.ResyncedRun(
                run_id=r.run_id,
                replica=r.replica or None,
                phase=_PHASES.get(r.phase, Phase.IDLE),
                service_class=_CLASSES.get(r.service_class, ServiceClass.INTERACTIVE),
                caller=r.caller,
                idle_s=r.idle_s,
            )
            for r in request.runs
        ),
        turns=tuple(
            ev.ResyncedTurn(
                turn_id=t.turn_id,
                run_id=t.run_id,
                replica=t.replica,
                service_class=_CLASSES.get(t.service_class, ServiceClass.INTERACTIVE),
                caller=t.caller,
                model=t.model,
                kind=_KINDS.get(t.kind, Kind.GENERATIVE),
            )
            for t in request.turns
        ),
        at=at,
    )


class SchedulerService(rpc.SchedulerServicer):
    """The gRPC face of `SchedulerHost`."""

    def __init__(self, host: SchedulerHost) -> None:
        self.host = host

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext) -> pb.AdmitReply:
        if not request.turn_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "turn_id is required")
        if self.host.abandoned_already(request.turn_id):
            await context.abort(grpc.StatusCode.CANCELLED, "the turn was already reported abandoned")
        arrived = ev.TurnArrived(
            turn_id=request.turn_id,
            run_id=request.run_id,
            service_class=_CLASSES.get(request.service_class, ServiceClass.INTERACTIVE),
            caller=request.caller,
            model=request.model,
            kind=_KINDS.get(request.kind, Kind.GENERATIVE),
            at=self.host.clock(),
        )
        outcome = await self.host.admit(arrived)
        if isinstance(outcome, Refuse):
            return pb.AdmitReply(outcome=pb.AdmitReply.UNKNOWN_MODEL, message=outcome.message)
        return pb.AdmitReply(
            outcome=pb.AdmitReply.PLACED,
            replica=outcome.replica,
            url=outcome.url,
            held_ms=outcome.held_s * 1000.0,
        )

    async def Report(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.ReportAck:
        async for message in request_iterator:
            event = turn_event(message, self.host.clock())
            if event is not None:
                self.host.feed(event)
        return pb.ReportAck()

    async def Resync(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.ResyncReply:
        # The whole view first: a stream that breaks off before its end leaves the state as it was.
        whole = pb.ResyncRequest()
        async for chunk in request_iterator:
            whole.runs.extend(chunk.runs)
            whole.turns.extend(chunk.turns)
        self.host.feed(resynced(whole, self.host.clock()))
        state = self.host.state
        log.info("resynced: %d runs, %d turns in flight", len(state.runs), len(state.placed()))
        return pb.ResyncReply(runs=len(state.runs), turns=len(state.placed()))


class BearerCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks `authorization: Bearer <token>`,
    compared in constant time as the dataplane compares its clients' (dataplane/auth.py)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001 (gRPC's types)
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if handler is None or bearer_matches(authorization.encode() if authorization else None, self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED and does nothing else."""

    async def refuse(_request, context: grpc.aio.ServicerContext):  # noqa: ANN001, ANN202
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token (see {TOKEN_ENV})")

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


class _StatusServer(uvicorn.Server):
    # The process handles SIGTERM/SIGINT itself (see `_main`) and then stops this server.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
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

    token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        log.warning("%s is not set: the scheduler's gRPC port takes calls from anyone who can reach %s",
                    TOKEN_ENV, settings.host)  # fmt: skip
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
        uvicorn.Config(
            HostGuard(build_app(lambda: host.state, host.clock, token), allowed_hosts(config)),
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
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
    # Open Admit calls are cancelled here; their turns leave the held queue as abandoned.
    await server.stop(grace=1.0)
    for task in tasks[1:]:
        task.cancel()
    stopped.cancel()
    await asyncio.gather(*tasks, stopped, return_exceptions=True)
    if failed:
        raise SystemExit(1)


def serve(config: _config.Config) -> None:
    """Runs the scheduler in the foreground until SIGTERM or SIGINT."""
    asyncio.run(_main(config))
