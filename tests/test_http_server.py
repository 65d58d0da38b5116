"""The connection limit every HTTP port keeps (luftpause/http_server.py), in order: a connection
waiting for a request head goes first, then the one whose request body has been arriving longest;
only when every open connection's request is whole and being answered is a new one refused.

A guarded uvicorn server in a thread of this process, serving an application that answers
`GET /status` at once, reads a POST's body and answers it, and holds `GET /hold` until its client
goes: what each connection is doing is then up to the test.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support import free_port, wait_until

from luftpause import http_server
from luftpause.config import HttpPortSettings

LIMIT = 6
# Long enough that no deadline closes a connection while a test looks at it.
BOUNDS = HttpPortSettings(header_timeout_s=60, body_timeout_s=60, max_connections=LIMIT)
HEAD = b"host: 127.0.0.1\r\n"
# The requests to /hold the application is answering now (it appends on entry, removes on exit).
holding: list[object] = []


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/hold":
        token = object()
        holding.append(token)
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            holding.remove(token)
        return
    while (message := await receive())["type"] == "http.request" and message.get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port() -> Iterator[int]:
    port = free_port()
    config = http_server.uvicorn_config(
        _app,
        BOUNDS,
        "dataplane",
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
    )
    server = http_server.Server(config, BOUNDS, "dataplane")
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the server to start")
    yield port
    server.should_exit = True
    thread.join(10)


def _open(port: int, request: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def _body_arriving(port: int) -> socket.socket:
    """A connection whose head is in and whose body the server awaits (its 100 Continue says so)."""
    sock = _open(
        port, b"POST /upload HTTP/1.1\r\n" + HEAD + b"content-length: 100\r\nexpect: 100-continue\r\n\r\n"
    )
    sock.settimeout(10)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
    return sock


def _answer(sock: socket.socket, within_s: float = 10.0) -> bytes:
    """What the server sent until it closed `sock` (b"" when it is still open after `within_s`)."""
    got, until = bytearray(), time.monotonic() + within_s
    while time.monotonic() < until:
        ready, _, _ = select.select([sock], [], [], 0.1)
        if ready:
            piece = sock.recv(65536)
            if not piece:
                return bytes(got)
            got += piece
    return b""


def _status(port: int) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}/status", headers={"connection": "close"}, timeout=10)


def _hold(port: int, n: int) -> list[socket.socket]:
    """`n` connections whose requests are whole and being answered (the application holds them)."""
    before = len(holding)
    held = [_open(port, b"GET /hold HTTP/1.1\r\n" + HEAD + b"\r\n") for _ in range(n)]
    wait_until(lambda: len(holding) == before + n, what="the held requests to reach the application")
    return held


def test_a_slow_body_is_closed_for_a_new_request_and_the_one_arriving_longest_first(port: int):
    bodies = [_body_arriving(port) for _ in range(LIMIT)]
    try:
        # Past the limit the operator is served: the oldest body goes, with a 503 naming the limit.
        r = _status(port)
        assert r.status_code == 200 and r.text == "ok"
        oldest = _answer(bodies[0])
        assert oldest.startswith(b"HTTP/1.1 503 ") and b"[dataplane] max_connections" in oldest
        assert b"request body was still arriving" in oldest
        # The others keep their place, and a body then sent whole is answered.
        bodies[1].sendall(b"x" * 100)
        assert bodies[1].recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in bodies:
            sock.close()


def test_with_every_request_being_answered_a_new_connection_is_refused_at_once(port: int):
    held = _hold(port, LIMIT)
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        answer = _answer(extra, within_s=5)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503 ") and b"each with a request being answered" in answer
        assert all(_answer(sock, within_s=0.2) == b"" for sock in held), "a request being answered was closed"
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _status(port).status_code == 200, what="room again")


def test_a_request_being_answered_is_never_closed_for_a_slow_body(port: int):
    held = _hold(port, LIMIT - 1)
    body = _body_arriving(port)
    try:
        r = _status(port)
        assert r.status_code == 200
        assert _answer(body).startswith(b"HTTP/1.1 503 ")
        assert all(_answer(sock, within_s=0.2) == b"" for sock in held), "a request being answered was closed"
    finally:
        body.close()
        for sock in held:
            sock.close()
