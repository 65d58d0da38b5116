"""The dataplane's HTTP server: uvicorn's httptools protocol with a deadline for request heads and
a connection limit, and the file-descriptor limit raised to what the connection limit needs.

uvicorn closes a kept-alive connection that stays silent after a response, but nothing stops a
client that opens connections and sends their heads a byte at a time: each is held open for as
long as it trickles (500 such connections all stayed open). Here a connection must deliver a
whole request head within `[dataplane] header_timeout_s` of opening, or of its last response
ending; otherwise it gets a 408 and is closed. A turn's body is bounded by size
(`limits.read_body`), and a turn, once admitted, by the engine timeouts (`engine_client`).

Past `[dataplane] max_connections` open connections, a new one is answered at once with a 503
and closed, so the process never runs out of descriptors in the middle of streams it already
carries. Each stream holds about two descriptors (the client's connection and the engine's), so
the soft RLIMIT_NOFILE is raised towards the hard one at start, and the log says so when even
that is too few for the limit.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from luftpause.errors import error_json

log = logging.getLogger(__name__)

# Descriptors a stream may hold (client connection, engine connection, a little to spare), and
# those the process needs besides streams (listening socket, scheduler channel, logs).
FDS_PER_CONNECTION = 3
FDS_SPARE = 64


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = error_json(message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


# The protocol _Guard is mixed into, as its base for the type checker only: at run time the mixin
# stays a plain class in front of it (GuardedHttpToolsProtocol's bases).
if TYPE_CHECKING:
    _Protocol = HttpToolsProtocol
else:
    _Protocol = object


class _Guard(_Protocol):
    """The head deadline and the connection limit (see the module), over a uvicorn protocol
    that calls `_head_arrived` once a request's whole head is parsed."""

    header_timeout_s: float = 10.0
    max_connections: int = 0  # 0: no limit
    _head_deadline: asyncio.TimerHandle | None = None

    # asyncio's stub types the argument as any BaseTransport; a stream protocol is given a Transport,
    # which uvicorn's own override (the same ignore) relies on too.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open, the limit is %d",
                        len(self.connections) - 1, self.max_connections)  # fmt: skip
            transport.write(
                _raw_response(
                    503,
                    "Service Unavailable",
                    f"this dataplane has {self.max_connections} connections open, its limit "
                    "([dataplane] max_connections); retry shortly",
                )
            )
            transport.close()
            return
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _head_arrived(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_late)

    def _head_too_late(self) -> None:
        self._head_deadline = None
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(
            _raw_response(
                408,
                "Request Timeout",
                f"the request head did not arrive within {self.header_timeout_s:g} s "
                "([dataplane] header_timeout_s)",
            )
        )
        transport.close()


class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
    """uvicorn's httptools protocol, guarded: the head is in once httptools has parsed it."""

    def on_headers_complete(self) -> None:
        self._head_arrived()
        super().on_headers_complete()


def protocol(header_timeout_s: float, max_connections: int) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type(
        "DataplaneProtocol",
        (GuardedHttpToolsProtocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )


def raise_fd_limit(max_connections: int) -> int:
    """Raises the soft RLIMIT_NOFILE as far as the hard one allows towards what `max_connections`
    needs; returns the soft limit now in force (and warns when it is still short)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FDS_SPARE + FDS_PER_CONNECTION * max_connections
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (OSError, ValueError):
                pass  # a system cap below the hard limit (macOS): keep what there is
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "only %d file descriptors may be open (RLIMIT_NOFILE); %d connections need about %d: "
            "lower [dataplane] max_connections or raise the limit (ulimit -n)",
            soft,
            max_connections,
            want,
        )
    return soft
