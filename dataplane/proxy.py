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

Beside it: the turn it carries (`turn.ProxiedTurn`), the client's side of the connection
(`answer`), the engine request (`outgoing`), the turn's span and metrics (`observe`), and its
reports to the scheduler and the operator together (`report`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Generic, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from luftpause import config as lp_config
from luftpause import logs
from luftpause.dataplane import headers, limits, outgoing, usage
from luftpause.dataplane.answer import (
    Answer,
    ClientLeft,
    client_disconnect,
    cut_off_on_purpose,
    unless_client_leaves,
)
from luftpause.dataplane.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    EngineResponse,
    EngineTimedOut,
)
from luftpause.dataplane.errors import (
    DataplaneStopping,
    ReplicaTooSlow,
    ReplicaUnreachable,
    ReplicaUnreadable,
    TurnRefused,
)
from luftpause.dataplane.metrics import UNKNOWN_CLASS, DataplaneMetrics
from luftpause.dataplane.observe import TurnObserver
from luftpause.dataplane.report import TurnReport
from luftpause.dataplane.run_identity import echoed_tool_call_ids, new_run_id
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.dataplane.sse import NotAnEventStream, StreamObserver, observe_completion
from luftpause.dataplane.turn import ProxiedTurn, request_object, requested_max_tokens
from luftpause.errors import error_json
from luftpause.proto import pb

log = logging.getLogger(__name__)

ENGINE_CONNECT_TIMEOUT_S = 2.0
# Of a turn without a run header, at most this many echoed tool_call_ids (the newest) go to the
# scheduler: its run is named by its latest reply's, which come first.
MAX_ECHOED_IDS = 16


P = TypeVar("P")


@dataclass(slots=True)
class Incoming(Generic[P]):
    """A turn's request once read and checked (`Proxy.read_request`): what its headers say, its
    body as it came and as its route reads it (`parsed`), and the answer that carries its run id."""

    request: Request
    # The run its header names; None: none, and `run_id` is a new one.
    named: str | None
    run_id: str
    body: bytes
    answer: Answer
    parsed: P
    service_class: pb.ServiceClass

    def turn(self, **fields: Any) -> ProxiedTurn:
        """The turn this request makes, with what the headers and the body's size say and
        `fields` (the model and what the route reads from the body)."""
        given: dict[str, Any] = {
            "service_class": self.service_class,
            "caller": headers.caller(self.request.headers.get(headers.CALLER)),
            "traceparent": self.request.headers.get(headers.TRACEPARENT, ""),
            "request_bytes": len(self.body),
        }
        return ProxiedTurn(id=uuid.uuid4().hex, run_id=self.run_id, **(given | fields))


class Proxy:
    """The per-turn path, and what it shares across turns: scheduler link, HTTP client, memories."""

    def __init__(self, config: lp_config.Config, token: str | None = None, name: str = "") -> None:
        self.config = config
        # `name`: what this dataplane calls itself to the scheduler, which scopes its resync and
        # its reports to its own turns (`scheduler_client.dataplane_name`).
        self.scheduler = SchedulerClient(config.dataplane.scheduler, token, name)
        self.metrics = DataplaneMetrics(r.name for r in config.replicas)
        self.scheduler.on_connected = self.metrics.scheduler_connected
        self.observe = TurnObserver(self.metrics)
        self.report = TurnReport(self.scheduler, self.observe)
        # No overall read timeout on engine requests: a turn takes as long as the engine needs,
        # and admission, not a pool limit, bounds how many go to each engine; only an engine gone
        # silent (before its reply begins, or in the middle of it) is given up on.
        settings = config.dataplane
        self.engines = EngineClient(
            connect_timeout_s=ENGINE_CONNECT_TIMEOUT_S,
            first_byte_timeout_s=settings.engine_first_byte_timeout_s or None,
            idle_timeout_s=settings.engine_idle_timeout_s or None,
        )

    async def open(self) -> None:
        await self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.engines.close()

    def end_run(self, run_id: str) -> None:
        """The agent says the run is over: the scheduler forgets it (and its tool_call_ids) now
        rather than in 30 minutes."""
        self.scheduler.run_ended(run_id)

    async def read_request(
        self, scope: Scope, receive: Receive, send: Send, route: str, parse: Callable[[bytes], P]
    ) -> Incoming[P] | None:
        """The request read whole and checked: its run header, its body (held to the limits:
        `limits`, `headers.run_id`) as `parse` reads it, and its class; None once it was
        refused (answered here) or its client left."""
        request = Request(scope, receive)
        try:
            named = headers.run_id(request.headers.get(headers.RUN_ID))
        except TurnRefused as refusal:
            # No run id to echo: the one sent is what was wrong.
            await self.refuse(Answer(scope, receive, send, {}), route, refusal)
            return None
        run_id = named or new_run_id()
        answer = Answer(scope, receive, send, {headers.RUN_ID: headers.on_the_wire(run_id)})
        try:
            body = await limits.read_body(request, self.config.dataplane.max_body_bytes)
            parsed = parse(body)
            service_class = headers.service_class(request.headers.get(headers.SERVICE_CLASS))
        except ClientDisconnect:
            return None
        except TurnRefused as refusal:
            await self.refuse(answer, route, refusal)
            return None
        return Incoming(request, named, run_id, body, answer, parsed, service_class)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # 1. The run, as far as the request says, and the class and caller.
        incoming = await self.read_request(scope, receive, send, "chat", request_object)
        if incoming is None:
            return
        payload, body, answer, named = incoming.parsed, incoming.body, incoming.answer, incoming.named
        echoed = () if named else tuple(islice(echoed_tool_call_ids(payload.get("messages")), MAX_ECHOED_IDS))
        turn = incoming.turn(
            model=payload["model"],
            # The body was decoded above anyway: an exact top-level check, no byte search.
            client_priority="priority" in payload,
            streamed=payload.get("stream") is True,
            client_usage=usage.client_asked(payload),
            echoed=echoed,
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
        self.observe.opened(turn)
        with logs.about(run_id=turn.run_id, turn_id=turn.id, span=turn.span):
            await self._run_turn(turn, answer, receive, work)
            log.debug("turn %s of run %s ended (%s)", turn.id, turn.run_id, turn.replica or "never placed")

    async def _run_turn(self, turn: ProxiedTurn, answer: Answer, receive: Receive, work: TurnWork) -> None:
        client_left = asyncio.ensure_future(client_disconnect(receive))
        try:
            placement = await self.place(turn, answer, client_left)
            if placement is not None:
                await work(placement, client_left)
        except asyncio.CancelledError:
            # The server is stopping and its grace for open turns ran out. The turn ends here,
            # so the task ends normally: the client gets an error it can retry on, not a bare 500.
            if turn.placed and not turn.ended:
                self.report.failed(turn, "the dataplane stopped")
            if not answer.started:
                stopping = DataplaneStopping("the dataplane is stopping; send the turn again")
                if not turn.placed:
                    self.observe.refused(turn, stopping.message)
                await answer.refuse(stopping)
        finally:
            client_left.cancel()
            self.observe.closed(turn)

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
            placement = await self.scheduler.admit(turn.admit_request(), abandoned=client_left)
        except TurnRefused as refusal:
            self.observe.refused(turn, refusal.message)
            await answer.refuse(refusal)
            return None
        if placement is None:
            log.info("turn %s of run %s abandoned: the client left while it was held", turn.id, turn.run_id)
            self.observe.abandoned(turn)
            return None
        turn.replica, turn.placed = placement.replica, True
        self.observe.admitted(turn, time.perf_counter() - asked)
        if turn.echoed and placement.run_id and placement.run_id != turn.run_id:
            # Its echoed tool_call_ids named the run it continues.
            turn.run_id = placement.run_id
            answer.headers[headers.RUN_ID] = headers.on_the_wire(turn.run_id)
        answer.headers[headers.REPLICA] = placement.replica
        self.scheduler.placed(turn.booked())
        if client_left.done():
            # Placed at the moment the client left: the slot must be freed, not left to expire.
            self.report.failed(turn, "the client left as the turn was placed")
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
        self.report.ended(turn, observation)
        if observation.unreadable:
            await answer.refuse(ReplicaUnreadable(turn.replica, observation.unreadable))
            return False
        return True

    async def exchange(
        self, turn: ProxiedTurn, request: EngineRequest, answer: Answer, client_left: asyncio.Future[None]
    ) -> EngineResponse | None:
        """Sends the engine request; the response with its body still to read, or None when the
        turn already ended here (the client left, or the engine could not be reached: a 502)."""
        self.report.started(turn)
        try:
            response = await unless_client_leaves(self.engines.post(request), client_left)
            self.observe.engine_answered(turn)
            return response
        except ClientLeft:
            self.report.failed(turn, "the client left before the engine answered")
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
            return await unless_client_leaves(upstream.read(), client_left)
        except ClientLeft:
            self.report.failed(
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
        self.observe.engine_error(turn, "http_5xx" if server_error else "http_4xx")
        self.report.failed(
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
        try:
            await unless_client_leaves(self._pump(turn, upstream, answer, observer, hide_usage), client_left)
            observation = observer.close()
        except ClientLeft:
            # Closing the engine request (on the way out of _chat) stops its generation.
            self.report.failed(turn, "the client left mid-stream")
            return
        except NotAnEventStream as error:
            log.warning(
                "engine %s sent turn %s a stream that is not server-sent events: %s",
                turn.replica,
                turn.id,
                error,
            )
            refusal = ReplicaUnreadable(
                turn.replica, f"its stream is not server-sent events of JSON: {error}"
            )
            await self._stream_lost(turn, answer, "unreadable", refusal, error_event=True)
            return
        except Exception as error:
            log.warning("engine %s broke off turn %s mid-stream: %r", turn.replica, turn.id, error)
            lost = f"engine {turn.replica}: stream broke off: {error!r}"
            await self._stream_lost(turn, answer, "broke_off", ReplicaUnreachable(turn.replica, error), lost)
            return
        if not observation.ran_to_its_end:
            refusal = ReplicaUnreadable(turn.replica, "stream ended before the reply finished")
            await self._stream_lost(turn, answer, "broke_off", refusal)
            return
        if not answer.started:
            await answer.start(upstream)
        if hide_usage and (tail := observer.take()):
            # The last line, had it no line break.
            await answer.send_chunk(tail)
        await answer.finish()
        self.report.ended(turn, observation)

    async def _pump(
        self,
        turn: ProxiedTurn,
        upstream: EngineResponse,
        answer: Answer,
        observer: StreamObserver,
        hide_usage: bool,
    ) -> None:
        """The engine's stream on to the client as it comes, read on the side by `observer`."""
        async for chunk in upstream.iter_body():
            if observer.feed(chunk):
                self.report.first_token(turn)
            if hide_usage:
                chunk = observer.take()
                if not chunk:
                    continue
            if not answer.started:
                await answer.start(upstream)
            await answer.send_chunk(chunk)

    async def _stream_lost(
        self,
        turn: ProxiedTurn,
        answer: Answer,
        kind: str,
        refusal: TurnRefused,
        error: str = "",
        error_event: bool = False,
    ) -> None:
        """The engine's stream failed the turn (`kind`, an engine error of the metrics), the
        replica's fault: before the response began, `refusal` answers it; after, the response is
        left unfinished (with an error event first, `error_event`), so that the connection closes
        without the final chunk, which is how the client learns the reply is lost."""
        self.observe.engine_error(turn, kind)
        self.report.failed(turn, error or refusal.message, replica_fault=True)
        if not answer.started:
            await answer.refuse(refusal)
            return
        if error_event:
            await answer.send_chunk(b"data: " + error_json(refusal.message) + b"\n\n")
        cut_off_on_purpose.set(True)

    async def _engine_unreachable(self, turn: ProxiedTurn, answer: Answer, error: EngineError) -> None:
        """The engine could not be reached or broke off before its reply began: a 502; or it
        never began its reply within the first-byte timeout: a 504."""
        timed_out = isinstance(error, EngineTimedOut)
        self.observe.engine_error(turn, "timeout" if timed_out else "unreachable")
        refusal = (ReplicaTooSlow if timed_out else ReplicaUnreachable)(turn.replica, error)
        self.report.failed(turn, refusal.message, replica_fault=True)
        await answer.refuse(refusal)

    # -- helpers --

    def engine_request(
        self, turn: ProxiedTurn, placement: pb.AdmitReply, endpoint: str, body: bytes
    ) -> EngineRequest:
        return outgoing.engine_request(self.config, turn, placement, endpoint, body)


TurnWork = Callable[[pb.AdmitReply, "asyncio.Future[None]"], Awaitable[None]]
