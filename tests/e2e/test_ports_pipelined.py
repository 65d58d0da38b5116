"""A pipelined request is held to the port's deadlines from when it is served, not before.

HTTP/1.1 lets a client send its next request before the last response has ended; uvicorn serves
them in turn, reading nothing more of the connection until the response before ends. Real
processes on loopback: luftpause's HTTP port (luftpause/http_server.py, 1 s for a head and for a
body) in front of an app whose `/slow` streams for 2.5 s and whose `/echo` answers its body. What
a client pipelining must see: every response whole, in order, with no 408 written into the
middle of one. Before, a pipelined request's body deadline ran from its head, while the response
before it was still being written (its body, sent on time, was not read until then), and once a
response ended the connection was given a head deadline though the pipelined request's head was
already in, which cut that request's response off with a 408.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from support import free_port, tcp_open, wait_until

TIMEOUT_S = 1.0
SLOW_S = 2.5

SERVER = (
    f"""
SLOW_S, TIMEOUT_S = {SLOW_S}, {TIMEOUT_S}
"""
    + """
import asyncio, sys
from luftpause.config import HttpPortSettings
from luftpause.http_server import Server, uvicorn_config

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(5):
            await send({"type": "http.response.body", "body": b"part %d;" % i, "more_body": True})
            await asyncio.sleep(SLOW_S / 5)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"echo:" + body})

bounds = HttpPortSettings(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
config = uvicorn_config(app, bounds, "dataplane", host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
asyncio.run(Server(config, bounds, "dataplane").serve())
"""
)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        wait_until(lambda: tcp_open(port), what="the port to open")
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)


def _until_closed(sock: socket.socket, deadline_s: float) -> bytes:
    sock.settimeout(deadline_s)
    got = b""
    try:
        while piece := sock.recv(65536):
            got += piece
    except ConnectionResetError:
        pass  # closed with bytes unread: what came before is what the client saw
    return got


def test_a_pipelined_body_sent_on_time_is_read_once_the_response_before_it_ends(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        sock.settimeout(SLOW_S)
        got = b""
        while b"part 0;" not in got:  # the slow response has begun: the next request is pipelined
            got += sock.recv(65536)
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"
        )
        time.sleep(0.2)  # the body follows its head a little later, well within its deadline
        sock.sendall(b"hello")
        got += _until_closed(sock, SLOW_S + 10)
    assert b" 408 " not in got, got
    assert got.count(b"HTTP/1.1 200 ") == 2, got
    assert b"part 4;\r\n3\r\nend\r\n0\r\n\r\n" in got, "the slow response was cut off"
    assert b"\r\n\r\na\r\necho:hello\r\n0\r\n\r\n" in got, "the pipelined request was not answered"


def test_a_pipelined_request_whose_head_is_in_is_not_given_a_head_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"GET /echo HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
            b"GET /slow HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
        )
        got = _until_closed(sock, SLOW_S + 10)
    assert b" 408 " not in got, got
    assert got.count(b"HTTP/1.1 200 ") == 2, got
    assert got.endswith(b"part 4;\r\n3\r\nend\r\n0\r\n\r\n"), "the slow response was cut off"
