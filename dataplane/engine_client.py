"""The dataplane's HTTP/1.1 client for engine requests: a POST out, the reply's bytes back as they come.

A general-purpose client does much per request and per chunk that a proxy does not need: pool
bookkeeping that scans every connection (and polls each idle socket) per request, and one
event per HTTP chunk on the way back. This one keeps, per origin (scheme, host, port), a stack
of idle kept-alive connections: a request takes the most recently used one that has not been
closed, or opens a new one (2 s connect timeout; TLS for https, see `tls_context`). A reply
body is handed over one piece per network read, with the chunked framing taken off: all the
chunks that arrived together make one piece, which the proxy passes to its client in one write.

A connection goes back to its stack only once its reply was read to the end and neither side
asked to close it. An idle connection the engine closed is noticed by the event loop and never
taken; one it closes just as a request goes out fails before any byte of a reply, and only
then is the request sent once more, on a new connection.

An engine that takes a request and then goes quiet is given up on: after the first-byte timeout
with no reply begun (`EngineTimedOut`), or after the idle timeout with no byte in the middle of
one (`EngineBrokeOff`). One timer per connection watches for that, re-armed only when it fires
and finds the engine was heard from meanwhile, so a reply's pieces cost no timer each.

Errors are `EngineError`: `EngineUnreachable` before a reply began (connection refused, connect
timeout, closed before answering, `EngineTimedOut`), `EngineBrokeOff` when a reply ends before it
is complete.

Why not aiohttp's client (measured 2026-11-30, to be weighed before replacing this one): with
one session, a TCPConnector without limit, no decompression, no cookie jar, bodies read with
`readany` and a trace hook telling a reused connection from a new one (aiohttp retries only
idempotent requests on a stale connection; a POST needs that hook to be retried here), the same
dataplane was run side by side with each client on the canned engine (`bench/proxy_canned_engine`),
arms alternating, 2000 turns per arm, 10 repeats, on 2 busy shared cores. Medians of the per-repeat
ratio aiohttp / this client, with the range:

    1 stream    added latency to first byte 1.12 (0.96-1.52), to last byte 1.20 (1.06-1.64),
                dataplane CPU per turn 1.14 (1.08-1.27), turns/s 0.85 (0.69-0.96)
    64 streams  turns/s 0.93 (0.69-1.12), dataplane CPU per turn 1.09 (0.89-1.72)

In absolute terms (medians of two runs of 5 repeats): at 1 stream the dataplane added 2.37 and
1.74 ms to the last byte with this client, 2.91 and 2.11 ms with aiohttp; at 64 streams it passed
584 and 731 turns/s with this client, 498 and 642 with aiohttp. The client alone, 64 streams of
streamed requests in one process: 0.24 ms of CPU per request for this one, 0.28 for aiohttp (0.28
and 0.32 at 1 stream). aiohttp added more latency at 1 stream in all 10 repeats, 20% more at the
median, beyond the 10% a library must come within to replace code of our own: this client stays.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import certifi

# Response heads bigger than this are not an engine's.
_MAX_HEAD = 64 * 1024
# Unread body bytes above which reading from the engine pauses until the client catches up.
_HIGH_WATER = 1024 * 1024


class EngineError(Exception):
    """An engine request failed in transport; the message says how."""


class EngineUnreachable(EngineError):
    """No reply began: the engine could not be reached, or closed the connection without answering."""


class EngineBrokeOff(EngineError):
    """The reply began but ended before it was complete."""


class EngineTimedOut(EngineUnreachable):
    """The engine took the request but sent nothing back within the first-byte timeout."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    url: str
    headers: Mapping[str, str]
    body: bytes


class _Origin:
    __slots__ = ("scheme", "host", "port", "key", "authority")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EngineUnreachable(f"not an http(s) URL: {url!r}")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.key = (self.scheme, self.host, self.port)
        default = (self.scheme, self.port) in (("http", 80), ("https", 443))
        self.authority = self.host if default else f"{self.host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, reading one reply at a time."""

    def __init__(
        self, first_byte_timeout_s: float | None = None, idle_timeout_s: float | None = None
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._loop = asyncio.get_running_loop()
        # How long an engine may stay silent: before its reply's head, and between its pieces.
        self._first_byte_s, self._idle_s = first_byte_timeout_s, idle_timeout_s
        self._last_heard = 0.0
        self._watch: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self._buffer = bytearray()
        self._state = "idle"
        self._head: asyncio.Future[tuple[int, dict[str, str]]] = self._loop.create_future()
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: EngineError | None = None
        self._done = False
        self._remaining = 0
        self.reusable = False
        self.got_bytes = False
        self._paused = False

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, only alike.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each write is a whole request or nothing to wait for: never hold it back (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._state == "idle":
            # Bytes nobody asked for: the connection is not in a state to be trusted.
            self._fail(EngineBrokeOff("engine sent bytes with no request outstanding"))
            return
        self.got_bytes = True
        self._last_heard = self._loop.time()
        self._buffer += data
        try:
            self._parse()
        except EngineError as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self._ended_by_peer()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._ended_by_peer(exc)

    # -- the request and its reply --

    def send(self, origin: _Origin, path: str, request: EngineRequest) -> None:
        assert self.transport is not None
        self._reset()
        self._state = "head"
        self._last_heard = self._loop.time()
        self._watch_silence()
        lines = [f"POST {path} HTTP/1.1", f"host: {origin.authority}", f"content-length: {len(request.body)}"]
        lines += [f"{name}: {value}" for name, value in request.headers.items()]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.body)

    async def head(self) -> tuple[int, dict[str, str]]:
        return await self._head

    async def next_piece(self) -> bytes | None:
        """The body's bytes that arrived since the last piece was taken (all of them, in one piece:
        a relay that fell behind catches up in one write instead of one per read), None at its
        end; EngineBrokeOff if it broke off."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        if len(pieces) == 1:
            piece = pieces.popleft()
        else:
            piece = b"".join(pieces)
            pieces.clear()
        self._buffered -= len(piece)
        if self._paused and self._buffered < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    @property
    def finished(self) -> bool:
        return self._done and self._error is None

    def close(self) -> None:
        self.closed = True
        self._stop_watching()
        if self.transport is not None:
            self.transport.close()

    # -- silence --

    def _watch_silence(self) -> None:
        """Arms the check for an engine gone quiet: one timer per silence window, not per piece."""
        self._stop_watching()
        limit = self._first_byte_s if self._state == "head" else self._idle_s
        if limit is not None and self._state not in ("idle", "done"):
            self._watch = self._loop.call_at(self._last_heard + limit, self._check_silence)

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _check_silence(self) -> None:
        self._watch = None
        if self._state in ("idle", "done"):
            return
        limit = self._first_byte_s if self._state == "head" else self._idle_s
        assert limit is not None
        if self._loop.time() - self._last_heard < limit:
            self._watch_silence()  # heard from since the timer was set
        elif self._state == "head":
            self._fail(EngineTimedOut(f"engine sent nothing within {limit:g} s of the request"))
        else:
            self._fail(EngineBrokeOff(f"engine sent nothing for {limit:g} s in the middle of its reply"))

    # -- parsing --

    def _parse(self) -> None:
        """Takes what the engine sent through the response's states (head, then a body of a
        length, chunked, or up to the close) as far as it goes, and delivers the body's bytes."""
        pieces: list[bytes] = []
        buffer = self._buffer
        while True:
            state = self._state
            if state == "head":
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > _MAX_HEAD:
                        raise EngineBrokeOff("engine's response head is too large")
                    break
                head = bytes(buffer[:end])
                del buffer[: end + 4]
                self._read_head(head)
            elif state == "length":
                if not buffer:
                    break
                self._take_body(buffer, pieces, then="done")
            elif state == "close":
                if buffer:
                    pieces.append(bytes(buffer))
                    buffer.clear()
                break
            elif state == "size":
                if not self._read_chunk_size(buffer):
                    break
            elif state == "chunk":
                if not buffer:
                    break
                self._take_body(buffer, pieces, then="chunk-end")
            elif state == "chunk-end":
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise EngineBrokeOff("engine's chunk did not end where its size said")
                del buffer[:2]
                self._state = "size"
            elif state == "trailer":
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                del buffer[: end + 2]
                if end == 0:
                    self._state = "done"
            else:  # done
                if buffer:
                    # More than the reply: do not trust the connection with another request.
                    self.reusable = False
                    buffer.clear()
                break
        if self._state == "done" and not self._done:
            self._done = True
        self._deliver(pieces)

    def _read_chunk_size(self, buffer: bytearray) -> bool:
        """Reads a chunk's size line off `buffer` (its extensions ignored), and the parser goes on to
        the chunk, or to the trailer after the last one; False while the line is not all there."""
        end = buffer.find(b"\r\n")
        if end < 0:
            if len(buffer) > 1024:
                raise EngineBrokeOff("engine's chunk size line is too long")
            return False
        size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
        del buffer[: end + 2]
        try:
            self._remaining = int(size_text, 16)
        except ValueError:
            raise EngineBrokeOff(f"engine sent a bad chunk size {size_text[:20]!r}") from None
        self._state = "chunk" if self._remaining else "trailer"
        return True

    def _deliver(self, pieces: list[bytes]) -> None:
        """Hands the body's new `pieces` to the reader, and wakes it for them or for the end; past
        the high-water mark of what it has not taken, the engine's socket is read no more until
        it takes some."""
        if pieces:
            piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            self._pieces.append(piece)
            self._buffered += len(piece)
            if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        if (pieces or self._done) and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take_body(self, buffer: bytearray, pieces: list[bytes], then: str) -> None:
        """Moves up to the rest of the current body (or chunk) from `buffer` to `pieces`; once it
        is all there, the parser goes on to state `then`."""
        take = min(len(buffer), self._remaining)
        pieces.append(bytes(buffer[:take]))
        del buffer[:take]
        self._remaining -= take
        if not self._remaining:
            self._state = then

    def _read_head(self, head: bytes) -> None:
        status_line, _, rest = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise EngineBrokeOff(f"engine answered with no HTTP status line: {status_line[:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim response; the real one follows
        headers: dict[str, str] = {}
        for line in rest.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        connection = headers.get("connection", "").lower()
        self.reusable = parts[0] == b"HTTP/1.1" and "close" not in connection
        if status in (204, 304):
            self._state = "done"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "size"
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise EngineBrokeOff("engine sent a bad content-length") from None
            self._state = "length" if self._remaining else "done"
        else:
            self._state = "close"
            self.reusable = False
        if not self._head.done():
            self._head.set_result((status, headers))
        self._watch_silence()

    def _ended_by_peer(self, exc: Exception | None = None) -> None:
        self.reusable = False
        if self._state in ("idle", "done"):
            return
        if self._state == "close":
            self._state = "done"
            self._done = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            return
        reason = f": {exc}" if exc else ""
        if self._state == "head":
            self._fail(EngineUnreachable(f"engine closed the connection before answering{reason}"))
        else:
            self._fail(EngineBrokeOff(f"engine closed the connection before the reply was complete{reason}"))

    def _fail(self, error: EngineError) -> None:
        self.reusable = False
        if self._error is None:
            self._error = error
        self._state = "idle"
        if not self._head.done():
            self._head.set_exception(error)
            # Nobody may be waiting for the head any more (the request was given up).
            self._head.exception()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.transport is not None:
            self.transport.close()


class EngineResponse:
    """An engine's reply: status and headers at once, the body to read piece by piece or whole."""

    def __init__(
        self, client: EngineClient, origin: _Origin, conn: _Connection, status: int, headers: dict[str, str]
    ) -> None:
        self._client, self._origin, self._conn = client, origin, conn
        self.status_code = status
        self.headers = headers
        self._closed = False

    async def iter_body(self) -> AsyncIterator[bytes]:
        while (piece := await self._conn.next_piece()) is not None:
            yield piece

    async def read(self) -> bytes:
        pieces = [piece async for piece in self.iter_body()]
        return b"".join(pieces)

    async def aclose(self) -> None:
        """Gives the connection back when the reply was read whole; closes it otherwise (which
        tells the engine to stop generating)."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.finished and conn.reusable and not conn.closed:
            conn._state = "idle"
            self._client._idle.setdefault(self._origin.key, []).append(conn)
        else:
            conn.close()


def tls_context() -> ssl.SSLContext:
    """Certificates are checked against `SSL_CERT_FILE` or `SSL_CERT_DIR` when set, else against
    certifi's CA bundle, as the scheduler's prober (httpx) checks them: both sides of a hosted
    endpoint agree on whether it can be trusted, also in images without system CAs."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    return ssl.create_default_context(cafile=certifi.where())


class EngineClient:
    """Engine requests over kept-alive HTTP/1.1 connections, a stack of idle ones per origin."""

    def __init__(
        self,
        connect_timeout_s: float,
        first_byte_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        """`first_byte_timeout_s`: how long an engine may take before its reply begins (for a
        reply read whole, the whole generation); `idle_timeout_s`: how long a reply may then go
        without a byte. None: no limit. A request over either fails with an EngineError."""
        self._connect_timeout_s = connect_timeout_s
        self._new_connection = lambda: _Connection(first_byte_timeout_s, idle_timeout_s)
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, request: EngineRequest) -> EngineResponse:
        """Sends `request`; returns once the reply's status and headers are in."""
        origin = _Origin(request.url)
        parts = urlsplit(request.url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (1, 2):
            conn, reused = await self._connection(origin)
            conn.send(origin, path, request)
            try:
                status, headers = await conn.head()
            except EngineUnreachable:
                conn.close()
                # A kept-alive connection the engine closed as the request went out: once more,
                # on a new connection. Anything else is the engine's answer.
                if reused and attempt == 1 and not conn.got_bytes:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            return EngineResponse(self, origin, conn, status, headers)
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()

    async def _connection(self, origin: _Origin) -> tuple[_Connection, bool]:
        stack = self._idle.get(origin.key)
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        tls = None
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = tls_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, conn = await loop.create_connection(
                    self._new_connection,
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise EngineUnreachable(
                f"connect to {origin.authority} timed out after {self._connect_timeout_s:g} s"
            ) from None
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise EngineUnreachable(f"connect to {origin.authority} failed: {reason}") from None
        # Some event loops (uvloop) call connection_made only after create_connection returned.
        if conn.transport is None:
            conn.transport = transport
        return conn, False
