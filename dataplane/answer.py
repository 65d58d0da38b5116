"""The client's side of one turn: the response it gets, and its leaving watched for.

`Answer` is the response half of a turn's connection with the luftpause headers it carries: a
refusal of ours, the engine's reply whole, or a stream begun and finished (or left unfinished on
purpose, which is how a client learns that a reply broke off). `unless_client_leaves` races a
step of the turn against the client going; `client_disconnect` is what completes when it has.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import Coroutine, MutableMapping
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from luftpause.dataplane.engine_client import EngineResponse
from luftpause.dataplane.errors import TurnRefused, refusal_response

T = TypeVar("T")

# Engine response headers the client gets along with the engine's status and body.
PASSED_HEADERS = ("content-type", "cache-control", "retry-after")
_UNFINISHED = "ASGI callable returned without completing response"

# Set in a turn's task when its reply is cut off on purpose (the engine broke off mid-stream).
cut_off_on_purpose: contextvars.ContextVar[bool] = contextvars.ContextVar("cut_off_on_purpose", default=False)


class _QuietDeliberateCutOff(logging.Filter):
    """Drops the server's error line about an unfinished response when we left it so on purpose.

    Closing the connection before the end is how a client learns that an engine broke off
    mid-stream; the server reports any such response as an application error. The server logs
    it from the turn's own task after the endpoint returns, so the context variable the turn
    set is still visible; any other unfinished response is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (cut_off_on_purpose.get() and record.getMessage().startswith(_UNFINISHED))


_cut_off_filter = _QuietDeliberateCutOff()


def quiet_deliberate_cut_offs() -> None:
    """Installs the filter on the server's error log (once, however many apps a process makes)."""
    server_log = logging.getLogger("uvicorn.error")
    if _cut_off_filter not in server_log.filters:
        server_log.addFilter(_cut_off_filter)


class ClientLeft(Exception):
    """The client disconnected before its turn was answered."""


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
        passed = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
        return {**passed, **self.headers}


async def client_disconnect(receive: Receive) -> None:
    """Returns once the client has gone; the request body must have been read already."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Coroutine[Any, Any, T], client_left: asyncio.Future[None]) -> T:
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
