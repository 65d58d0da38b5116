"""The bounds every luftpause HTTP port keeps: the dataplane's, the runtime's and the scheduler's
status port all run uvicorn's httptools protocol guarded here, with the limits of their config
section (`HttpPortSettings`: `[dataplane]`, `[runtime]`, `[scheduler]`).

What one client may hold, and for how long:

- A connection must deliver a whole request head within `header_timeout_s` of opening, or of its
  last response ending; otherwise it is answered 408 and closed. uvicorn closes a kept-alive
  connection that stays silent, but not one that trickles its head a byte at a time (a slowloris
  client), which it would hold for as long as it trickles.
- Once the head is in, the body must have arrived whole within `body_timeout_s` (a 408 and the
  connection closed beyond): a body sent a byte now and then is the same attack after the head.
  A request pipelined behind a response still being written (HTTP/1.1 lets a client send it
  before that response ends) is not read until then, so its body's time starts there, and it is
  given no head deadline: its head is in.
- A kept-alive connection may stay silent `keep_alive_timeout_s` after a response (uvicorn's
  `timeout_keep_alive`), and is then closed without a word.
- At most `max_connections` are open at once. Past that, the connection that has waited longest
  for a request head (an idle or trickling one) is closed to make room for the new one: it gets a
  503 (or nothing, if it is kept alive after a response and has sent nothing since). One whose
  bytes have come but are not read yet is passed over (up to 8 such, the longest waiting): asyncio
  accepts a burst of queued connections and makes each one's protocol before reading any, so a
  client that sent its request at once, accepted early in a burst past the limit, would otherwise
  be closed with its request unread. With none waiting for a head, the connection whose request
  body has been arriving longest is closed instead, with a 503 (the application sees its client
  gone): a body sent a byte now and then holds its connection for up to `body_timeout_s`, and
  enough of them would otherwise lock every new client out for that long, again and again. Only
  when every open connection's request is whole and being answered (the application working on
  it, a response being written, a stream) is the new connection answered 503 at once and closed.
  So a flood of idle, trickling or slow-bodied connections never keeps the operator from `GET
  /status`: a new connection that sends its request at once is served, however many such
  connections are open. The process never runs
  out of descriptors in the middle of requests it already carries. (asyncio accepts a burst of
  up to uvicorn's backlog, 2048, in one go before any of them is looked at, so for a moment the
  descriptors may exceed the limit by that many; the drill, bench/faults_ports.py, saw 2,570 on
  a runtime limited to 1,024, within the 3,136 its limit raises the descriptor limit to.)

The soft RLIMIT_NOFILE is raised at start towards the hard one, as far as `max_connections`
needs (`raise_fd_limit`), with a warning when even the hard limit is too few. When accepting still
fails for want of descriptors (EMFILE: another part of the process holds them, or the hard limit
is low), asyncio logs a traceback for every failed accept(), hundreds a second; `Server` logs one
line a second instead, with the count of failures since the last.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import socket
import struct
import termios
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from luftpause.config import HttpPortSettings
from luftpause.errors import error_json

log = logging.getLogger(__name__)

# Descriptors a connection may hold (the client's, a dataplane's engine connection, a little to
# spare), and those the process needs besides connections (listening sockets, channels, logs).
FDS_PER_CONNECTION = 3
FDS_SPARE = 64
# What asyncio's event loop says when accept() fails for want of a resource (selector_events.py).
_ACCEPT_FAILED = "socket.accept() out of system resource"
# How many of the connections waiting longest for a head making room may pass over for having
# bytes not yet read (a bound on the cost of looking, in a flood of trickling connections).
UNREAD_PASSED = 8


def _unread(guard: _Guard) -> bool:
    """Whether bytes have come on the connection that the server has not read yet. asyncio accepts
    a burst of queued connections (up to the backlog) and makes each one's protocol before it
    reads from any of them: a client that sent its request at once, accepted early in a burst
    that passes the limit, is then the connection waiting longest for a head, with its request
    in the socket."""
    sock = guard.transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return False
    return struct.unpack("i", waiting)[0] > 0


class OncePer:
    """A log line's rate limit: `due()` is the number of times it was skipped since it was last
    written when it may be written now, or None while it may not."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._next_at = 0.0
        self._skipped = 0

    def due(self) -> int | None:
        now = time.monotonic()
        if now < self._next_at:
            self._skipped += 1
            return None
        skipped, self._skipped = self._skipped, 0
        self._next_at = now + self.period_s
        return skipped


def _since(skipped: int) -> str:
    return f" ({skipped} more in the last second)" if skipped else ""


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
    """The deadlines and the connection limit (see the module), over a uvicorn protocol that
    calls `_head_arrived` once a request's whole head is parsed."""

    # Set per server by `protocol()`.
    bounds: ClassVar[HttpPortSettings] = HttpPortSettings()
    section: ClassVar[str] = "dataplane"
    # The open connections waiting for a request head, the longest waiting first; and those whose
    # request body is still arriving, the one arriving longest first.
    awaiting: ClassVar[OrderedDict[_Guard, None]]
    receiving: ClassVar[OrderedDict[_Guard, None]]
    refusals: ClassVar[OncePer]
    evictions: ClassVar[OncePer]

    _head_deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None
    _served = False  # a response has ended on this connection
    _begun = False  # bytes of a request have come since the connection opened or its last response

    def _key(self, name: str) -> str:
        return f"[{self.section}] {name}"

    # asyncio's stub types the argument as any BaseTransport; a stream protocol is given a Transport,
    # which uvicorn's own override (the same ignore) relies on too.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.bounds.max_connections
        if len(self.connections) > limit and not self._make_room():
            if (skipped := self.refusals.due()) is not None:
                log.warning("refused a connection: %d open, every one's request being answered; the limit is %d (%s)%s",
                            len(self.connections) - 1, limit, self._key("max_connections"),
                            _since(skipped))  # fmt: skip
            transport.write(
                _raw_response(
                    503,
                    "Service Unavailable",
                    f"this {self.section} has {limit} connections open, its limit "
                    f"({self._key('max_connections')}), each with a request being answered; retry shortly",
                )
            )
            transport.close()
            return
        self._await_head()

    def _make_room(self) -> bool:
        """Closes the connection that has waited longest for a request head (`_longest_waiting`),
        else the one whose request body has been arriving longest; False when there is neither."""
        while self.awaiting:
            oldest = self._longest_waiting()
            del self.awaiting[oldest]
            if oldest._head_deadline is not None:
                oldest._head_deadline.cancel()
                oldest._head_deadline = None
            if oldest.transport.is_closing():
                continue
            if not (oldest._served and not oldest._begun):
                oldest.transport.write(
                    _raw_response(
                        503,
                        "Service Unavailable",
                        f"closed to make room: this {self.section} has {self.bounds.max_connections} "
                        f"connections open, its limit ({self._key('max_connections')}), and this one "
                        "had not sent a request head; retry",
                    )
                )
            oldest.transport.close()
            self._evicted("waiting longest for a request head")
            return True
        while self.receiving:
            slowest = next(iter(self.receiving))
            slowest._body_arrived()
            if slowest.transport.is_closing():
                continue
            slowest._close_mid_body(
                503,
                "Service Unavailable",
                f"closed to make room: this {self.section} has {self.bounds.max_connections} connections "
                f"open, its limit ({self._key('max_connections')}), and this one's request body was still "
                "arriving; retry",
            )
            self._evicted("whose request body had been arriving longest")
            return True
        return False

    def _evicted(self, which: str) -> None:
        if (skipped := self.evictions.due()) is not None:
            log.warning("at the connection limit (%d, %s): closed the connection %s to make room "
                        "for a new one%s", self.bounds.max_connections, self._key("max_connections"),
                        which, _since(skipped))  # fmt: skip

    def _longest_waiting(self) -> _Guard:
        """The connection waiting longest for a request head, passing over those of the longest
        waiting (up to UNREAD_PASSED) with bytes come but not yet read: the request itself,
        likely (`_unread`). Only while `awaiting` has one."""
        first = next(iter(self.awaiting))
        for passed, guard in enumerate(self.awaiting):
            if passed == UNREAD_PASSED or guard.transport.is_closing() or not _unread(guard):
                return guard
        return first

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def on_response_complete(self) -> None:
        # A request pipelined behind this response, which uvicorn starts now: its head is in.
        queued = self.pipeline[-1][0] if self.pipeline else None
        super().on_response_complete()
        self._served = True
        if self.transport.is_closing():
            return
        if queued is None:
            self._await_head()
        elif queued is self.cycle and queued.more_body:
            # Its body was not read while the response before it was written: its time starts now.
            self._await_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        self._body_arrived()
        super().connection_lost(exc)

    def _head_arrived(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        self.awaiting.pop(self, None)

    def _await_head(self) -> None:
        self._head_arrived()
        self._begun = False
        self.awaiting[self] = None
        self._head_deadline = self.loop.call_later(self.bounds.header_timeout_s, self._head_too_late)

    def _head_too_late(self) -> None:
        self._head_deadline = None
        self.awaiting.pop(self, None)
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(
            _raw_response(
                408,
                "Request Timeout",
                f"the request head did not arrive within {self.bounds.header_timeout_s:g} s "
                f"({self._key('header_timeout_s')})",
            )
        )
        transport.close()

    def _await_body(self) -> None:
        self._body_arrived()
        self.receiving[self] = None
        self._body_deadline = self.loop.call_later(self.bounds.body_timeout_s, self._body_too_late)

    def _body_arrived(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
        self.receiving.pop(self, None)

    def _body_too_late(self) -> None:
        self._body_deadline = None
        self.receiving.pop(self, None)
        if self.transport.is_closing():
            return
        self._close_mid_body(
            408,
            "Request Timeout",
            f"the request body did not arrive within {self.bounds.body_timeout_s:g} s of its head "
            f"({self._key('body_timeout_s')})",
        )

    def _close_mid_body(self, status: int, reason: str, message: str) -> None:
        """Answers a request whose body is still arriving with `status` (unless its response has
        begun) and closes its connection; the application sees its client gone."""
        transport, cycle = self.transport, self.cycle
        if cycle is not None and not cycle.response_started:
            transport.write(_raw_response(status, reason, message))
        if cycle is not None and not cycle.response_complete:
            # The application sees the client gone, and writes nothing after the answer.
            cycle.disconnected = True
            cycle.message_event.set()
        transport.close()


class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
    """uvicorn's httptools protocol, guarded: the head is in once httptools has parsed it, the
    body once httptools has parsed the whole message."""

    def on_headers_complete(self) -> None:
        self._head_arrived()
        super().on_headers_complete()
        if not (self.pipeline and self.pipeline[0][0] is self.cycle):
            self._await_body()
        # else pipelined behind a response still being written, whose end starts its body's time

    def on_message_complete(self) -> None:
        self._body_arrived()
        super().on_message_complete()


def protocol(bounds: HttpPortSettings, section: str) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http` setting, with these bounds; `section` is the config
    section they come from, which the errors name."""
    attributes: dict[str, Any] = {
        "bounds": bounds,
        "section": section,
        "awaiting": OrderedDict(),
        "receiving": OrderedDict(),
        "refusals": OncePer(),
        "evictions": OncePer(),
    }
    return type(f"{section.title()}Protocol", (GuardedHttpToolsProtocol,), attributes)


def uvicorn_config(app: Any, bounds: HttpPortSettings, section: str, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for `app` on a port with these bounds (`kwargs`: the rest of uvicorn's)."""
    return uvicorn.Config(
        app, http=protocol(bounds, section), timeout_keep_alive=bounds.keep_alive_timeout_s, **kwargs
    )


class Server(uvicorn.Server):
    """uvicorn's server, with the descriptor limit raised for the connection limit and failed
    accept() calls logged once a second (see the module)."""

    def __init__(self, config: uvicorn.Config, bounds: HttpPortSettings, section: str) -> None:
        super().__init__(config)
        self.bounds, self.section = bounds, section

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        raise_fd_limit(self.bounds.max_connections, self.section)
        quiet_accept_errors(asyncio.get_running_loop(), self.section)
        await super().serve(sockets)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, section: str) -> None:
    """Makes `loop` log accept() failing for want of descriptors once a second, with a count,
    instead of a traceback each time; everything else goes to the handler there was."""
    before = loop.get_exception_handler()
    once = OncePer()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_FAILED:
            if before is not None:
                before(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        if (skipped := once.due()) is None:
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("cannot accept connections: %s (%d descriptors may be open, RLIMIT_NOFILE); open "
                  "connections are served and accept() is tried again each second; raise the limit "
                  "(ulimit -n) or lower [%s] max_connections%s",
                  context.get("exception"), soft, section, _since(skipped))  # fmt: skip

    loop.set_exception_handler(handle)


def raise_fd_limit(max_connections: int, section: str = "dataplane") -> int:
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
            "lower [%s] max_connections or raise the limit (ulimit -n)",
            soft,
            max_connections,
            want,
            section,
        )
    return soft
