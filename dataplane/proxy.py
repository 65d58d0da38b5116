"""One turn through the dataplane, top to bottom: resolve the run, admit, forward, observe, report.

`Proxy` is the ASGI endpoint behind `POST /v1/chat/completions`. For each request it

1. reads the run header (or, without one, the tool_call_ids the messages echo and a new run id
   for the case that they name no run), the class and the caller;
2. asks the scheduler to admit the turn, holding the request while it waits; the scheduler says
   which run it is in (`scheduler/run_identity.py`); a client that leaves meanwhile abandons the
   turn and no engine request is made;
3. forwards the body bytes unchanged to the placed replica (`engine_client`, connections kept
   alive per engine), but for the turn's priority where the replica's engine honours one
   (`priority`) and, for a stream, a request for its usage where the client made none (`usage`);
4. passes the engine's reply back unchanged (a stream chunk by chunk, as it comes), reading it
   on the side for first token, usage, finish reason and tool-call ids, and taking out of a
   stream the usage the client did not ask for;
5. reports to the scheduler what happened: started, first token, completed or failed.

It is a plain ASGI callable rather than a FastAPI endpoint because a turn needs the connection
itself: it watches for the client leaving at every stage, and a reply that breaks off mid-stream
must reach the client as a connection closed before the end, not as a finished response.
Steps 2 to 5 are also what `decide.Decide` runs its turns with.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from luftpause import config as lp_config
from luftpause import logs, tracing
from luftpause.dataplane import headers, limits, priority, usage
from luftpause.dataplane.body import with_first_member
from luftpause.dataplane.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    EngineResponse,
    EngineTimedOut,
)
from luftpause.dataplane.errors import (
    BadTurnRequest,
    DataplaneStopping,
    ReplicaTooSlow,
    ReplicaUnreachable,
    ReplicaUnreadable,
    TurnRefused,
    refusal_response,
)
from luftpause.dataplane.metrics import UNKNOWN_CLASS, DataplaneMetrics
from luftpause.dataplane.run_identity import echoed_tool_call_ids, new_run_id
from luftpause.dataplane.runs import PRUNE_PERIOD_S, PlacedTurn, RunBook
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.dataplane.sse import NotAnEventStream, ReplyObservation, StreamObserver, observe_completion
from luftpause.errors import error_json
from luftpause.proto import pb

log = logging.getLogger(__name__)

T = TypeVar("T")

ENGINE_CONNECT_TIMEOUT_S = 2.0
# Of a turn without a run header, at most this many echoed tool_call_ids (the newest) go to the
# scheduler: its run is named by its latest reply's, which come first.
MAX_ECHOED_IDS = 16
# The most of a failed turn's error text the scheduler is told.
MAX_ERROR_CHARS = 1000
# How often a warning that a replica may cause on every turn is logged, at most (per replica).
WARN_EVERY_S = 60.0
# Engine response headers the client gets along with the engine's status and body.
_PASSED_HEADERS = ("content-type", "cache-control", "retry-after")
_UNFINISHED = "ASGI callable returned without completing response"

# Set in a turn's task when its reply is cut off on purpose (the engine broke off mid-stream).
_cut_off_on_purpose: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cut_off_on_purpose", default=False
)


class _QuietDeliberateCutOff(logging.Filter):
    """Drops the server's error line about an unfinished response when we left it so on purpose.

    Closing the connection before the end is how a client learns that an engine broke off
    mid-stream; the server reports any such response as an application error. The server logs
    it from the turn's own task after the endpoint returns, so the context variable the turn
    set is still visible; any other unfinished response is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_cut_off_on_purpose.get() and record.getMessage().startswith(_UNFINISHED))


_cut_off_filter = _QuietDeliberateCutOff()


def quiet_deliberate_cut_offs() -> None:
    """Installs the filter on the server's error log (once, however many apps a process makes)."""
    server_log = logging.getLogger("uvicorn.error")
    if _cut_off_filter not in server_log.filters:
        server_log.addFilter(_cut_off_filter)


class ClientLeft(Exception):
    """The client disconnected before its turn was answered."""


@dataclass(slots=True)
class ProxiedTurn:
    id: str
    run_id: str
    service_class: pb.ServiceClass
    caller: str
    model: str
    traceparent: str
    # Which route it came through, for the metrics: "chat" or "decide".
    route: str = "chat"
    kind: pb.ReplicaKind = pb.GENERATIVE
    # The run the scheduler is told about; "" keeps the turn outside run state (decide).
    scheduled_run_id: str | None = None
    # With no run header: the tool_call_ids the messages echo, newest first, by which the
    # scheduler may find the run (then `run_id` becomes that run's).
    echoed: tuple[str, ...] = ()
    replica: str = ""
    # The client's body has a top-level "priority" of its own, which the engine gets unchanged.
    client_priority: bool = False
    # The client asked for a streamed reply: the engine's first token is then seen as it comes,
    # which is what tells the scheduler that the engine started the turn (admission.py).
    streamed: bool = False
    # The client's body asks for usage in its stream itself (`usage.client_asked`).
    client_usage: bool = False
    # The body's size in bytes as received, and the reply limit it sets (0: none): what the
    # scheduler's run gate sizes the turn by until its usage is known (AdmitRequest).
    request_bytes: int = 0
    max_tokens: int = 0
    # When the engine request went out (perf_counter), for the time to the first token.
    sent_at: float = 0.0
    # Placed by the scheduler, and reported completed or failed: what a stop midway must tidy up.
    placed: bool = False
    ended: bool = False
    first_token_seen: bool = False
    # Its span while tracing is on (luftpause/tracing.py); None, and never made, while it is off.
    span: Span | None = None

    @property
    def scheduler_run_id(self) -> str:
        return self.run_id if self.scheduled_run_id is None else self.scheduled_run_id


class Proxy:
    """The per-turn path, and what it shares across turns: scheduler link, HTTP client, memories."""

    def __init__(self, config: lp_config.Config, token: str | None = None, name: str = "") -> None:
        self.config = config
        self.runs = RunBook()
        # `name`: this dataplane's, where several share the scheduler (one worker of several).
        self.scheduler = SchedulerClient(config.dataplane.scheduler, self.runs, token, name)
        self.metrics = DataplaneMetrics(r.name for r in config.replicas)
        self.scheduler.on_connected = self.metrics.scheduler_connected
        # No overall read timeout on engine requests: a turn takes as long as the engine needs,
        # and admission, not a pool limit, bounds how many go to each engine; only an engine gone
        # silent (before its reply begins, or in the middle of it) is given up on.
        settings = config.dataplane
        self.engines = EngineClient(
            connect_timeout_s=ENGINE_CONNECT_TIMEOUT_S,
            first_byte_timeout_s=settings.engine_first_byte_timeout_s or None,
            idle_timeout_s=settings.engine_idle_timeout_s or None,
        )
        self._pruner: asyncio.Task[None] | None = None
        self._now_and_then = NowAndThen(WARN_EVERY_S)

    async def open(self) -> None:
        await self.scheduler.start()
        self._pruner = asyncio.create_task(self._prune_forever(), name="dataplane-prune")

    async def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
        await self.scheduler.close()
        await self.engines.close()

    def end_run(self, run_id: str) -> None:
        """The agent says the run is over: the scheduler forgets it (and its tool_call_ids) now
        rather than in 30 minutes."""
        self.scheduler.run_ended(run_id)

    async def read_request(
        self, scope: Scope, receive: Receive, send: Send, route: str
    ) -> tuple[Request, str | None, bytes] | None:
        """The request, the run its header names (None: none) and its whole body, held to the
        limits (`limits`, `headers.run_id`); None once it was refused or its client left."""
        request = Request(scope, receive)
        try:
            named = headers.run_id(request.headers.get(headers.RUN_ID))
        except TurnRefused as refusal:
            # No run id to echo: the one sent is what was wrong.
            await self.refuse(Answer(scope, receive, send, {}), route, refusal)
            return None
        try:
            body = await limits.read_body(request, self.config.dataplane.max_body_bytes)
        except ClientDisconnect:
            return None
        except TurnRefused as refusal:
            answer = Answer(
                scope, receive, send, {headers.RUN_ID: headers.on_the_wire(named or new_run_id())}
            )
            await self.refuse(answer, route, refusal)
            return None
        return request, named, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        read = await self.read_request(scope, receive, send, "chat")
        if read is None:
            return
        request, named, body = read
        payload, problem = _read_turn_body(body)

        # 1. The run, as far as the request says, and the class and caller.
        run_id = named or new_run_id()
        echoed = () if named else tuple(islice(echoed_tool_call_ids(payload.get("messages")), MAX_ECHOED_IDS))
        answer = Answer(scope, receive, send, {headers.RUN_ID: headers.on_the_wire(run_id)})
        try:
            if problem:
                raise BadTurnRequest(problem)
            service_class = headers.service_class(request.headers.get(headers.SERVICE_CLASS))
        except TurnRefused as refusal:
            await self.refuse(answer, "chat", refusal)
            return
        turn = ProxiedTurn(
            id=uuid.uuid4().hex,
            run_id=run_id,
            service_class=service_class,
            caller=headers.caller(request.headers.get(headers.CALLER)),
            model=payload["model"],
            traceparent=request.headers.get(headers.TRACEPARENT, ""),
            # The body was decoded above anyway: an exact top-level check, no byte search.
            client_priority="priority" in payload,
            streamed=payload.get("stream") is True,
            client_usage=usage.client_asked(payload),
            echoed=echoed,
            request_bytes=len(body),
            max_tokens=requested_max_tokens(payload),
        )

        async def chat(placement: pb.AdmitReply, client_left: asyncio.Future[None]) -> None:
            await self._chat(turn, placement, body, payload, answer, client_left)

        await self.run_turn(turn, answer, receive, chat)

    async def run_turn(self, turn: ProxiedTurn, answer: Answer, receive: Receive, work: TurnWork) -> None:
        """Admits `turn` (steps 2), then runs `work` (steps 3 to 5) with the client watched for leaving.

        `work` gets the scheduler's placement and the future that completes when the client
        leaves. Whatever happens, the turn leaves here answered or abandoned, reported, its slot free.
        """
        if tracing.TRACER is not None:
            _open_span(tracing.TRACER, turn)
        with logs.about(run_id=turn.run_id, turn_id=turn.id, span=turn.span):
            await self._run_turn(turn, answer, receive, work)
            log.debug("turn %s of run %s ended (%s)", turn.id, turn.run_id, turn.replica or "never placed")

    async def _run_turn(self, turn: ProxiedTurn, answer: Answer, receive: Receive, work: TurnWork) -> None:
        client_left = asyncio.ensure_future(_client_disconnect(receive))
        try:
            placement = await self.place(turn, answer, client_left)
            if placement is not None:
                await work(placement, client_left)
        except asyncio.CancelledError:
            # The server is stopping and its grace for open turns ran out. The turn ends here,
            # so the task ends normally: the client gets an error it can retry on, not a bare 500.
            if turn.placed and not turn.ended:
                self.failed(turn, "the dataplane stopped")
            if not answer.started:
                if not turn.placed:
                    self.metrics.ended(turn.route, "refused", headers.class_name(turn.service_class))
                await answer.refuse(DataplaneStopping("the dataplane is stopping; send the turn again"))
        finally:
            client_left.cancel()
            if turn.span is not None:
                turn.span.end()

    async def refuse(
        self, answer: Answer, route: str, refusal: TurnRefused, service_class: str = UNKNOWN_CLASS
    ) -> None:
        """Answers with an error of the dataplane's own, for a turn that never reached a replica
        (of `service_class`, "unknown" when refused before its class was read)."""
        self.metrics.ended(route, "refused", service_class)
        await answer.refuse(refusal)

    async def place(
        self, turn: ProxiedTurn, answer: Answer, client_left: asyncio.Future[None]
    ) -> pb.AdmitReply | None:
        """Step 2: held until the scheduler places the turn; None once it was refused or abandoned."""
        asked = time.perf_counter()
        try:
            placement = await self.scheduler.admit(
                pb.AdmitRequest(
                    turn_id=turn.id,
                    run_id=turn.scheduler_run_id,
                    service_class=turn.service_class,
                    caller=turn.caller,
                    model=turn.model,
                    kind=turn.kind,
                    traceparent=turn.traceparent,
                    echoed_tool_call_ids=turn.echoed,
                    request_bytes=turn.request_bytes,
                    max_tokens=turn.max_tokens,
                ),
                abandoned=client_left,
            )
        except TurnRefused as refusal:
            if turn.span is not None:
                turn.span.set_attribute("luftpause.outcome", "refused")
                turn.span.set_status(StatusCode.ERROR, refusal.message)
            await self.refuse(answer, turn.route, refusal, headers.class_name(turn.service_class))
            return None
        if placement is None:
            if turn.span is not None:
                turn.span.set_attribute("luftpause.outcome", "abandoned")
            log.info("turn %s of run %s abandoned: the client left while it was held", turn.id, turn.run_id)
            self.metrics.ended(turn.route, "abandoned", headers.class_name(turn.service_class))
            return None
        held_s = time.perf_counter() - asked
        self.metrics.admitted(headers.class_name(turn.service_class), placement.replica, held_s)
        if turn.span is not None:
            turn.span.set_attributes(
                {"luftpause.replica": placement.replica, "luftpause.held_ms": held_s * 1000.0}
            )
        self.metrics.in_flight.inc()
        turn.replica, turn.placed = placement.replica, True
        if turn.echoed and placement.run_id and placement.run_id != turn.run_id:
            # Its echoed tool_call_ids named the run it continues.
            turn.run_id = placement.run_id
            answer.headers[headers.RUN_ID] = headers.on_the_wire(turn.run_id)
        answer.headers[headers.REPLICA] = placement.replica
        self.scheduler.placed(
            PlacedTurn(
                turn.id,
                turn.scheduler_run_id,
                turn.replica,
                turn.service_class,
                turn.caller,
                turn.model,
                turn.kind,
            )
        )
        if client_left.done():
            # Placed at the moment the client left: the slot must be freed, not left to expire.
            self.failed(turn, "the client left as the turn was placed")
            return None
        return placement

    async def _chat(
        self,
        turn: ProxiedTurn,
        placement: pb.AdmitReply,
        body: bytes,
        payload: dict[str, Any],
        answer: Answer,
        client_left: asyncio.Future[None],
    ) -> None:
        # 3. Forward the body, unchanged but for an engine priority and a stream's usage, to the
        # placed replica. A replica this config does not name is asked, as one that says nothing is.
        replica = self.config.replica(placement.replica)
        hide_usage = turn.streamed and not turn.client_usage and (replica is None or replica.stream_usage)
        if hide_usage:
            body = usage.asking_for_usage(body, payload)
        request = self.engine_request(turn, placement, "chat/completions", body)
        upstream = await self.exchange(turn, request, answer, client_left)
        if upstream is None:
            return
        # 4. Pass the reply through, observing it on the side; 5. report how the turn ended.
        try:
            if upstream.status_code >= 400:
                await self.pass_engine_error(turn, upstream, answer, client_left)
            elif upstream.headers.get("content-type", "").startswith("text/event-stream"):
                await self._relay_stream(turn, upstream, answer, client_left, hide_usage)
            else:
                content = await self.read_whole(turn, upstream, answer, client_left)
                if content is not None and await self.end_whole(turn, content, answer):
                    await answer.respond(content, upstream)
        finally:
            await upstream.aclose()

    async def end_whole(self, turn: ProxiedTurn, content: bytes, answer: Answer) -> bool:
        """A reply read whole: how its turn ended is reported (`ended`); one that is not a JSON
        object is answered with a 502 naming the replica, never passed on. Whether it may be."""
        observation = observe_completion(content)
        self.ended(turn, observation)
        if observation.unreadable:
            await answer.refuse(ReplicaUnreadable(turn.replica, observation.unreadable))
            return False
        return True

    async def exchange(
        self, turn: ProxiedTurn, request: EngineRequest, answer: Answer, client_left: asyncio.Future[None]
    ) -> EngineResponse | None:
        """Sends the engine request; the response with its body still to read, or None when the
        turn already ended here (the client left, or the engine could not be reached: a 502)."""
        self.started(turn)
        try:
            response = await _unless_client_leaves(self.engines.post(request), client_left)
            if turn.span is not None:
                # Until the engine's response began: the time it kept the request before answering.
                turn.span.set_attribute(
                    "luftpause.engine_queue_ms", (time.perf_counter() - turn.sent_at) * 1000.0
                )
            return response
        except ClientLeft:
            self.failed(turn, "the client left before the engine answered")
        except EngineError as e:
            await self._engine_unreachable(turn, answer, e)
        return None

    async def fetch_whole(
        self, turn: ProxiedTurn, request: EngineRequest, answer: Answer, client_left: asyncio.Future[None]
    ) -> tuple[bytes, EngineResponse] | None:
        """Sends a request whose reply is read whole (not streamed): the body and the response
        (status and headers) when the engine answered below 400; None when the turn already ended
        here (the client left, the engine was unreachable, or its refusal went to the client)."""
        upstream = await self.exchange(turn, request, answer, client_left)
        if upstream is None:
            return None
        try:
            if upstream.status_code >= 400:
                await self.pass_engine_error(turn, upstream, answer, client_left)
                return None
            content = await self.read_whole(turn, upstream, answer, client_left)
            return None if content is None else (content, upstream)
        finally:
            await upstream.aclose()

    async def read_whole(
        self, turn: ProxiedTurn, upstream: EngineResponse, answer: Answer, client_left: asyncio.Future[None]
    ) -> bytes | None:
        """The whole body of a reply that is not streamed; None when the turn ended while reading."""
        try:
            return await _unless_client_leaves(upstream.read(), client_left)
        except ClientLeft:
            self.failed(
                turn, f"engine answered {upstream.status_code}; the client left before the reply was read"
            )
        except EngineError as e:
            await self._engine_unreachable(turn, answer, e)
        return None

    async def pass_engine_error(
        self, turn: ProxiedTurn, upstream: EngineResponse, answer: Answer, client_left: asyncio.Future[None]
    ) -> None:
        """The engine refused (429, 5xx, 4xx): its status, body and Retry-After go back unchanged."""
        content = await self.read_whole(turn, upstream, answer, client_left)
        if content is None:
            return
        server_error = upstream.status_code >= 500
        self.metrics.engine_error("http_5xx" if server_error else "http_4xx", turn.replica)
        self.failed(
            turn,
            f"engine answered {upstream.status_code}: {content[:200].decode(errors='replace')}",
            replica_fault=server_error,
        )
        await answer.respond(content, upstream)

    async def _relay_stream(
        self,
        turn: ProxiedTurn,
        upstream: EngineResponse,
        answer: Answer,
        client_left: asyncio.Future[None],
        hide_usage: bool,
    ) -> None:
        """Passes a stream on as it comes; with `hide_usage`, as the observer says (`sse`).

        The client's response begins with the first bytes worth passing on, not with the
        engine's headers: an engine that breaks off (or garbles its stream) before any is a 502
        naming the replica, as one that cannot be reached is. Once the response has begun, a
        stream that breaks off is cut off (the connection closes without the final chunk, which
        is how the client learns the reply is lost), and one that turns out not to be server-sent
        events of JSON (`sse.NotAnEventStream`) gets an error event naming the replica before it
        is cut off; what was not valid is not passed on.
        """
        observer = StreamObserver(hide_usage)
        send_chunk = answer.send_chunk

        async def pump() -> None:
            async for chunk in upstream.iter_body():
                if observer.feed(chunk):
                    self.first_token(turn)
                if hide_usage:
                    chunk = observer.take()
                    if not chunk:
                        continue
                if not answer.started:
                    await answer.start(upstream)
                await send_chunk(chunk)

        try:
            await _unless_client_leaves(pump(), client_left)
            observation = observer.close()
        except ClientLeft:
            # Closing the engine request (on the way out of _chat) stops its generation.
            self.failed(turn, "the client left mid-stream")
            return
        except NotAnEventStream as error:
            log.warning(
                "engine %s sent turn %s a stream that is not server-sent events: %s",
                turn.replica,
                turn.id,
                error,
            )
            self.metrics.engine_error("unreadable", turn.replica)
            refusal = ReplicaUnreadable(
                turn.replica, f"its stream is not server-sent events of JSON: {error}"
            )
            self.failed(turn, refusal.message, replica_fault=True)
            if not answer.started:
                await answer.refuse(refusal)
                return
            await send_chunk(b"data: " + error_json(refusal.message) + b"\n\n")
            _cut_off_on_purpose.set(True)
            return
        except Exception as error:
            log.warning("engine %s broke off turn %s mid-stream: %r", turn.replica, turn.id, error)
            self.metrics.engine_error("broke_off", turn.replica)
            self.failed(turn, f"engine {turn.replica}: stream broke off: {error!r}", replica_fault=True)
            if not answer.started:
                await answer.refuse(ReplicaUnreachable(turn.replica, error))
                return
            # The response is left unfinished: the connection closes without the final chunk,
            # which is how the client learns the reply is lost.
            _cut_off_on_purpose.set(True)
            return
        if not observation.ran_to_its_end:
            self.metrics.engine_error("broke_off", turn.replica)
            refusal = ReplicaUnreadable(turn.replica, "stream ended before the reply finished")
            self.failed(turn, refusal.message, replica_fault=True)
            if not answer.started:
                await answer.refuse(refusal)
                return
            _cut_off_on_purpose.set(True)
            return
        if not answer.started:
            await answer.start(upstream)
        if hide_usage and (tail := observer.take()):
            # The last line, had it no line break.
            await send_chunk(tail)
        await answer.finish()
        self.ended(turn, observation)

    async def _engine_unreachable(self, turn: ProxiedTurn, answer: Answer, error: EngineError) -> None:
        """The engine could not be reached or broke off before its reply began: a 502; or it
        never began its reply within the first-byte timeout: a 504."""
        timed_out = isinstance(error, EngineTimedOut)
        self.metrics.engine_error("timeout" if timed_out else "unreachable", turn.replica)
        refusal = (ReplicaTooSlow if timed_out else ReplicaUnreachable)(turn.replica, error)
        self.failed(turn, refusal.message, replica_fault=True)
        await answer.refuse(refusal)

    # -- reporting: what happened to a turn, told to the scheduler and counted in the metrics --

    def started(self, turn: ProxiedTurn) -> None:
        """The engine request goes out now."""
        self.scheduler.started(turn.id, turn.scheduler_run_id, turn.streamed)
        turn.sent_at = time.perf_counter()

    def first_token(self, turn: ProxiedTurn) -> None:
        """The engine's first token reached us (once a turn, streamed or not)."""
        if turn.first_token_seen:
            return
        turn.first_token_seen = True
        to_first_s = time.perf_counter() - turn.sent_at
        self.metrics.first_token(headers.class_name(turn.service_class), turn.replica, to_first_s)
        if turn.span is not None:
            turn.span.set_attribute("luftpause.time_to_first_token_ms", to_first_s * 1000.0)
        self.scheduler.first_token(turn.id, turn.scheduler_run_id)

    def failed(self, turn: ProxiedTurn, error: str, replica_fault: bool = False) -> None:
        """The turn ended in `error`; `replica_fault`: the replica's doing (it could not be reached,
        broke off, sent what is not a reply, or answered 5xx), which counts toward ejecting it
        (scheduler/outliers.py), unlike a client that left or a request the engine refused."""
        if self._end(turn, "failed"):
            # The error may quote the engine: any text, any length; the report carries it readable and bounded.
            error = error[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
            if turn.span is not None:
                turn.span.set_status(StatusCode.ERROR, error)
            self.scheduler.failed(turn.id, turn.scheduler_run_id, error, replica_fault)

    def ended(self, turn: ProxiedTurn, observation: ReplyObservation) -> None:
        """A reply that came back whole: completed (its first token first, if not told yet), or
        failed when the engine said it failed.

        A usage out of range (`luftpause.counts`) is reported as none (the scheduler then sizes
        the run as before its usage was known) and logged once a minute per replica. A report
        that cannot be made for any other reason (something in the reply no message can carry)
        ends the turn failed instead, so that its slot is freed now and not at the turn timeout.
        """
        if observation.error:
            self.metrics.engine_error("reply_error", turn.replica)
            self.failed(turn, f"engine {turn.replica}: {observation.error}")
            return
        if observation.unreadable:
            self.metrics.engine_error("unreadable", turn.replica)
            self.failed(turn, f"engine {turn.replica}: {observation.unreadable}", replica_fault=True)
            return
        if observation.bad_usage and self._now_and_then.due(("usage", turn.replica)):
            log.warning(
                "engine %s sent a usage out of range (%s); counted as no usage (logged once a minute per replica)",
                turn.replica,
                observation.bad_usage,
            )
        if turn.ended:
            return
        try:
            if observation.first_token:
                self.first_token(turn)
            self.scheduler.completed(
                turn.id,
                turn.scheduler_run_id,
                observation.finish_reason,
                observation.prompt_tokens,
                observation.completion_tokens,
                observation.tool_call_ids,
            )
        except Exception as error:
            if self._now_and_then.due(("report", turn.replica)):
                log.warning(
                    "turn %s on %s: its completion could not be reported (%r); reported failed instead "
                    "(logged once a minute per replica)",
                    turn.id,
                    turn.replica,
                    error,
                )
            self.failed(
                turn, f"engine {turn.replica}: its reply could not be reported: {type(error).__name__}"
            )
            return
        if self._end(turn, "completed") and turn.span is not None:
            turn.span.set_attributes(
                {
                    "gen_ai.response.finish_reasons": [observation.finish_reason],
                    "gen_ai.usage.input_tokens": observation.prompt_tokens,
                    "gen_ai.usage.output_tokens": observation.completion_tokens,
                }
            )

    def _end(self, turn: ProxiedTurn, outcome: str) -> bool:
        """Counts the turn's outcome once; False when it had already ended (nothing to report)."""
        if turn.ended:
            return False
        turn.ended = True
        service_class = headers.class_name(turn.service_class)
        if turn.span is not None:
            turn.span.set_attribute("luftpause.outcome", outcome)
        self.metrics.in_flight.dec()
        self.metrics.ended(turn.route, outcome, service_class)
        if turn.sent_at:
            self.metrics.turn_ended(service_class, turn.replica, time.perf_counter() - turn.sent_at)
        return True

    # -- helpers --

    def engine_request(
        self, turn: ProxiedTurn, placement: pb.AdmitReply, endpoint: str, body: bytes
    ) -> EngineRequest:
        """A POST of `body` to the placed replica's `endpoint` (as `engine_url` reads it).

        A generative turn to a replica whose engine honours priorities carries its class's
        priority in the body. Single-pass requests (vLLM's /classify) are left alone: that
        request shape's priority handling is not one we have checked.
        """
        replica = self.config.replica(placement.replica)
        if replica is not None and replica.engine_priority != "none" and turn.kind == pb.GENERATIVE:
            body = priority.engine_body(
                body, replica.engine_priority, turn.service_class, turn.client_priority
            )
        if placement.HasField("slot") and turn.kind == pb.GENERATIVE:
            # The slot its run's KV stays in (scheduler/core/place.py `_slot_for`); a client's own
            # `id_slot` comes later in the body and wins.
            body = with_first_member(body, b'"id_slot":%d' % placement.slot)
        base = placement.url or (replica.url if replica else "")
        outgoing = {
            "content-type": "application/json",
            # The bytes are passed through as they come and read on the side: they must not be compressed.
            "accept-encoding": "identity",
        }
        # The client's own Authorization never goes upstream; an engine gets the key configured for it.
        api_key = replica.api_key() if replica else None
        if api_key:
            outgoing["authorization"] = f"Bearer {api_key}"
        if turn.traceparent:
            outgoing[headers.TRACEPARENT] = turn.traceparent
        return EngineRequest(engine_url(base, endpoint), outgoing, body)

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_PERIOD_S)
            self.runs.prune()


class NowAndThen:
    """Says when a warning of some kind is due again: the first time, then once per period."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._last: dict[tuple[str, str], float] = {}

    def due(self, key: tuple[str, str]) -> bool:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._period_s:
            return False
        self._last[key] = now
        return True


TurnWork = Callable[[pb.AdmitReply, "asyncio.Future[None]"], Awaitable[None]]


def _open_span(tracer: Tracer, turn: ProxiedTurn) -> None:
    """Starts the turn's span, a child of the client's `traceparent`; the scheduler and the engine
    are then sent this span's own, so that their spans are its children."""
    attributes = {
        "gen_ai.request.model": turn.model,
        "luftpause.route": turn.route,
        "luftpause.turn_id": turn.id,
        "luftpause.run_id": turn.run_id,
        "luftpause.service_class": headers.class_name(turn.service_class),
    }
    if turn.route == "chat":
        attributes["gen_ai.operation.name"] = "chat"
    span = tracer.start_span(
        f"{turn.route} {turn.model}",
        context=tracing.parent(turn.traceparent),
        kind=SpanKind.SERVER,
        attributes=attributes,
    )
    turn.span = span
    turn.traceparent = tracing.traceparent_of(span)


def engine_url(base: str, endpoint: str) -> str:
    """The URL of `endpoint` under a replica's base URL: "chat/completions" under /v1, "/classify" at the root.

    Engines are configured by their root (`http://host:30000`); hosted APIs are often given with
    their `/v1` already on (`https://api.example.com/v1`), which must not be doubled.
    """
    base = base.rstrip("/")
    root = base.removesuffix("/v1")
    return f"{root}{endpoint}" if endpoint.startswith("/") else f"{root}/v1/{endpoint}"


class Answer:
    """The response side of one turn's connection, with the luftpause headers it carries."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, luftpause_headers: dict[str, str]) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self.headers: MutableMapping[str, str] = luftpause_headers
        self.started = False

    async def refuse(self, refusal: TurnRefused) -> None:
        self.started = True
        await refusal_response(refusal, self.headers)(self._scope, self._receive, self._send)

    async def respond(self, content: bytes, upstream: EngineResponse) -> None:
        """The engine's whole reply: its status, body and passed headers, unchanged."""
        response = Response(content, status_code=upstream.status_code, headers=self._headers_for(upstream))
        self.started = True
        await response(self._scope, self._receive, self._send)

    async def respond_json(self, payload: Any) -> None:
        """A 200 reply the dataplane made itself (decide's scores)."""
        content = json.dumps(payload, separators=(",", ":")).encode()
        response = Response(content, media_type="application/json", headers=dict(self.headers))
        self.started = True
        await response(self._scope, self._receive, self._send)

    async def start(self, upstream: EngineResponse) -> None:
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self._headers_for(upstream).items()]
        self.started = True
        await self._send({"type": "http.response.start", "status": upstream.status_code, "headers": raw})

    async def send_chunk(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def finish(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    def _headers_for(self, upstream: EngineResponse) -> dict[str, str]:
        passed = {name: upstream.headers[name] for name in _PASSED_HEADERS if name in upstream.headers}
        return {**passed, **self.headers}


# The most an int64 field of the scheduler's messages holds.
_INT64_MAX = 2**63 - 1


def requested_max_tokens(payload: dict[str, Any]) -> int:
    """The reply limit a chat body sets: `max_completion_tokens` (OpenAI's newer name, which
    engines take over `max_tokens` when both are sent) or `max_tokens`; 0 when neither is a whole
    number above zero. The engine still gets the body as sent: this only tells the scheduler."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, _INT64_MAX)
    return 0


def _read_turn_body(body: bytes) -> tuple[dict[str, Any], str]:
    """The request's JSON object and "" when it can be a turn, else {} and what is wrong with it."""
    try:
        payload = json.loads(body)
    except ValueError as e:
        return {}, f"request body must be JSON: {e}"
    if not isinstance(payload, dict):
        return {}, "request body must be a JSON object"
    if not isinstance(payload.get("model"), str) or not payload["model"]:
        return payload, 'request body must name the model as a string in "model"'
    return payload, ""


async def _client_disconnect(receive: Receive) -> None:
    """Returns once the client has gone; the request body must have been read already."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(work: Coroutine[Any, Any, T], client_left: asyncio.Future[None]) -> T:
    """The result of `work`, or ClientLeft (with `work` cancelled) when the client goes first.

    `work` runs in the calling task, which the client's leaving cancels (as `asyncio.timeout`
    cancels on its deadline): no task of its own and no `asyncio.wait`, which cost each race two
    passes of the event loop. A cancellation from outside (the server stopping) goes on as it
    came. Work that finishes in spite of the cancel (it caught it) keeps its result."""
    if client_left.done():
        work.close()
        raise ClientLeft
    task = asyncio.current_task()
    assert task is not None
    racing, left = True, False

    def leave(_: asyncio.Future[None]) -> None:
        nonlocal left
        # A callback already on its way when the race ended must not cancel what comes after.
        if racing:
            left = True
            task.cancel()

    client_left.add_done_callback(leave)
    try:
        result = await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:
            raise ClientLeft from None
        raise
    finally:
        racing = False
        client_left.remove_done_callback(leave)
    if left:
        task.uncancel()
    return result
