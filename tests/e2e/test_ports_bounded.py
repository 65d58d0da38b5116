"""Every HTTP port is bounded: the dataplane's, the runtime's and the scheduler's status port.

Real processes on loopback (scheduler, dataplane, runtime; no engines: none is needed to see a
port's bounds), each section with short bounds: 2 s for a request head and for its body, 30
connections. What a client must see on each port: heads trickled a byte at a time and bodies
trickled after a whole head are answered 408 naming the key, and closed, within the bound; with
the port full of idle connections, `GET /status` (the dataplane's `/health`) on a new connection
is answered before an idle one's own timeout could make room, the connection waiting longest for
a head closed with a 503 to make room, but not a connection whose request has come unread (the
operator's, accepted in a burst past the limit); with every connection's body on its way, the
one arriving longest is closed with a 503 to make room (tests/test_http_server.py has the
order, and the 503 at once when every request is whole and being answered). The runtime refuses a body over `[runtime]
max_body_bytes` with the JSON error naming the key. The scheduler's gRPC port closes connections
past `[scheduler] grpc_max_connections` at once and those that never begin HTTP/2 within
`header_timeout_s`, while /status answers. A
scheduler whose descriptor table is full logs the failing accept() once a second, not once a
failure (luftpause/http_server.py has the rules).
"""

from __future__ import annotations

import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import Ports, Service, http_ok, running, wait_until

from luftpause.bench import stack_config

TIMEOUT_S = 2.0
MAX_CONNECTIONS = 30
GRPC_MAX_CONNECTIONS = 10
# How long past a deadline the server may take to close, on a loaded test machine: the bound
# told apart from none at all (the trickling connections are watched for TIMEOUT_S + 10 s, and
# without the bound they stay open), the 408 naming the key saying which bound closed them.
SLACK_S = 5.0


class _Stack:
    def __init__(self, tmp: Path) -> None:
        self.ports = ports = Ports()
        bounds = {
            "header_timeout_s": TIMEOUT_S,
            "body_timeout_s": TIMEOUT_S,
            "max_connections": MAX_CONNECTIONS,
        }
        tables = stack_config.stack(
            grpc=ports.grpc,
            status=ports.status,
            dataplane=ports.dataplane,
            runtime=ports.runtime,
            state_dir=tmp / "state",
            tool_server={"name": "fake-mcp", "url": f"http://127.0.0.1:{ports.fake_mcp}/mcp"},
            replicas=[stack_config.replica("fake-a", ports.engines[0], ["fake-llama"])],
        )
        service_bounds = {
            "scheduler": {**bounds, "grpc_max_connections": GRPC_MAX_CONNECTIONS},
            "dataplane": bounds,
            "runtime": bounds,
        }
        config = stack_config.write(tmp, stack_config.merged(tables, service_bounds))
        self.services = (
            Service("scheduler", ["scheduler", "--config", str(config)], tmp / "scheduler.log"),
            Service("dataplane", ["dataplane", "--config", str(config)], tmp / "dataplane.log"),
            Service("runtime", ["runtime", "--config", str(config)], tmp / "runtime.log"),
        )
        # Each port: (port, the route an operator reads, a request whose body the service reads).
        self.routes = {
            "scheduler": (ports.status, "/status", b"GET /status"),
            "dataplane": (ports.dataplane, "/health", b"POST /v1/chat/completions"),
            "runtime": (ports.runtime, "/status", b"POST /mcp"),
        }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    s = _Stack(tmp_path_factory.mktemp("ports"))
    with running(*s.services):
        for service in s.services:
            service.start()
        for service, (port, route, _) in zip(s.services, s.routes.values(), strict=True):
            service.wait_http(f"http://127.0.0.1:{port}{route}")
        yield s


SECTIONS = ("scheduler", "dataplane", "runtime")
HEAD = b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\naccept: application/json\r\n"


def _watch(socks: list[socket.socket], until: float, trickle: bytes = b"") -> dict[int, tuple[float, bytes]]:
    """Sends `trickle` on every open socket about ten times a second (nothing if empty) and reads
    what comes back, until all are closed by the server or `until` passes; returns, for each one
    closed, when (monotonic) and what it had been sent."""
    got = {i: bytearray() for i in range(len(socks))}
    closed: dict[int, tuple[float, bytes]] = {}
    while len(closed) < len(socks) and time.monotonic() < until:
        open_ = [s for i, s in enumerate(socks) if i not in closed]
        if trickle:
            for s in open_:
                try:
                    s.send(trickle)
                except OSError:
                    pass  # closed: the read below sees it
        ready, _, _ = select.select(open_, [], [], 0.1)
        for s in ready:
            i = socks.index(s)
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                piece = b""
            if piece:
                got[i] += piece
            else:
                closed[i] = (time.monotonic(), bytes(got[i]))
    return closed


def _connect(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


@pytest.mark.parametrize("section", SECTIONS)
def test_heads_trickled_a_byte_at_a_time_get_a_408_and_are_closed(stack: _Stack, section: str):
    port, route, _ = stack.routes[section]
    socks = _connect(port, 20)
    try:
        opened = time.monotonic()
        for s in socks:
            s.sendall(b"GET " + route.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
        closed = _watch(socks, opened + TIMEOUT_S + 10, trickle=b"x")
    finally:
        for s in socks:
            s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} trickling connections still open"
    assert max(at for at, _ in closed.values()) - opened < TIMEOUT_S + SLACK_S
    for _, answer in closed.values():
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert f"[{section}] header_timeout_s".encode() in answer


@pytest.mark.parametrize("section", SECTIONS)
def test_a_body_trickled_after_a_whole_head_gets_a_408_and_is_closed(stack: _Stack, section: str):
    port, _, request = stack.routes[section]
    socks = _connect(port, 10)
    try:
        for s in socks:
            s.sendall(request + HEAD + b"content-length: 100000\r\n\r\n{")
        sent = time.monotonic()
        closed = _watch(socks, sent + TIMEOUT_S + 10, trickle=b" ")
    finally:
        for s in socks:
            s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} trickling bodies still open"
    assert max(at for at, _ in closed.values()) - sent < TIMEOUT_S + SLACK_S
    for _, answer in closed.values():
        if section == "scheduler":
            # No route of the status port reads a body: GET /status is answered at once, and the
            # connection, unusable with the body unread, is closed within the bound.
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        else:
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert f"[{section}] body_timeout_s".encode() in answer


@pytest.mark.parametrize("section", SECTIONS)
def test_a_port_full_of_idle_connections_still_answers_the_operator(stack: _Stack, section: str):
    port, route, _ = stack.routes[section]
    idle = _connect(port, MAX_CONNECTIONS)
    try:
        for _ in range(5):
            asked = time.monotonic()
            r = httpx.get(f"http://127.0.0.1:{port}{route}", timeout=5)
            assert r.status_code == 200
            # Answered by making room, not by waiting for an idle connection's own header
            # timeout to free some (that it was made, the oldest's 503 below shows).
            assert time.monotonic() - asked < TIMEOUT_S
        # The first asking made room by closing the connection waiting longest, the first opened.
        closed = _watch(idle[:1], time.monotonic() + 0.5)
    finally:
        for s in idle:
            s.close()
    assert 0 in closed, "the oldest idle connection was closed to make room"
    answer = closed[0][1]
    assert answer.startswith(b"HTTP/1.1 503 ") and f"[{section}] max_connections".encode() in answer


@pytest.mark.parametrize("section", SECTIONS)
def test_a_request_not_yet_read_is_not_closed_to_make_room(stack: _Stack, section: str):
    """A burst of connections accepted at once (the service busy, here stopped, while they
    queue): the operator's, first in the queue with its request sent, is answered, though the
    burst passes the limit before the service reads any of them; an idle one is closed instead."""
    port, route, _ = stack.routes[section]
    service = stack.services[SECTIONS.index(section)]
    service.send_signal(signal.SIGSTOP)
    try:
        operator = socket.create_connection(("127.0.0.1", port))
        operator.sendall(f"GET {route} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
        idle = _connect(port, MAX_CONNECTIONS + 5)
    finally:
        service.send_signal(signal.SIGCONT)
    try:
        (closed,) = _watch([operator], time.monotonic() + 5).values()
    finally:
        operator.close()
        for s in idle:
            s.close()
    assert closed[1].startswith(b"HTTP/1.1 200 "), closed[1][:200]


@pytest.mark.parametrize("section", ["dataplane", "runtime"])
def test_a_port_full_of_slow_bodies_still_answers_the_operator(stack: _Stack, section: str):
    port, route, request = stack.routes[section]
    busy = _connect(port, MAX_CONNECTIONS)
    try:
        for s in busy:
            s.sendall(request + HEAD + b"content-length: 100\r\nexpect: 100-continue\r\n\r\n")
        for s in busy:  # the 100 Continue says the head is in and the body awaited
            s.settimeout(TIMEOUT_S)
            assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        # Every connection is in a request whose body is on its way: the operator is served, and
        # the connection whose body has been arriving longest is closed to make room.
        r = httpx.get(
            f"http://127.0.0.1:{port}{route}", headers={"connection": "close"}, timeout=TIMEOUT_S + 5
        )
        assert r.status_code == 200
        closed = _watch(busy[:1], time.monotonic() + TIMEOUT_S / 2)
    finally:
        for s in busy:
            s.close()
    assert 0 in closed, "the body arriving longest was not closed"
    answer = closed[0][1]
    assert answer.startswith(b"HTTP/1.1 503 ") and f"[{section}] max_connections".encode() in answer


def test_the_grpc_port_holds_its_limit_and_closes_connections_that_never_begin(stack: _Stack):
    """Past `[scheduler] grpc_max_connections` a connection is closed at once; one that never
    begins HTTP/2 is closed within `header_timeout_s`; /status answers throughout and the
    dataplane's own connection to the port stays up."""
    idle = _connect(stack.ports.grpc, 4 * GRPC_MAX_CONNECTIONS)
    opened = time.monotonic()
    try:
        at_once = _watch(idle, opened + 0.5)
        r = httpx.get(f"http://127.0.0.1:{stack.ports.status}/status", timeout=5)
        assert r.status_code == 200 and time.monotonic() - opened < 1.5
        rest = [s for i, s in enumerate(idle) if i not in at_once]
        later = _watch(rest, opened + TIMEOUT_S + 10)
    finally:
        for s in idle:
            s.close()
    # The dataplane holds one of the port's connections.
    assert len(at_once) >= len(idle) - GRPC_MAX_CONNECTIONS, f"{len(idle) - len(at_once)} held past the limit"
    assert len(later) == len(rest), f"{len(rest) - len(later)} connections that never began are still open"
    assert max(at for at, _ in later.values()) - opened < TIMEOUT_S + SLACK_S
    health = httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/health", timeout=5).json()
    assert health["scheduler"] == "connected", health


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_the_runtimes_413_is_the_json_error_naming_its_limit(stack: _Stack, declared: bool):
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "' + b"x" * (5 << 20) + b'"}}'
    content = body if declared else iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    r = httpx.post(
        f"http://127.0.0.1:{stack.ports.runtime}/mcp",
        content=content,
        headers={"content-type": "application/json", "accept": "application/json, text/event-stream"},
        timeout=30,
    )
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert "[runtime] max_body_bytes" in message and "4,194,304 bytes" in message


def test_accept_failing_for_want_of_descriptors_is_logged_once_a_second(tmp_path: Path):
    ports = Ports()
    config = tmp_path / "luftpause.toml"
    config.write_text(f"[scheduler]\ngrpc_port = {ports.grpc}\nstatus_port = {ports.status}\n")
    log = tmp_path / "scheduler.log"
    limit = 96  # the scheduler starts within it; a few dozen connections fill the rest

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "scheduler", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=low_limit,
        )
    socks: list[socket.socket] = []
    try:
        status = f"http://127.0.0.1:{ports.status}/status"
        wait_until(lambda: http_ok(status), what="the scheduler's status port")
        for _ in range(2 * limit):
            socks.append(socket.socket())
            socks[-1].setblocking(False)
            socks[-1].connect_ex(("127.0.0.1", ports.status))
        wait_until(lambda: "cannot accept connections" in log.read_text(), timeout_s=10,
                   what="the first failed accept() in the log")  # fmt: skip
        # A window of three seconds with the table full: at most one line a second in it.
        window_ends = time.monotonic() + 3.0
        while time.monotonic() < window_ends:
            select.select([], [], [], window_ends - time.monotonic())
        text = log.read_text()
        for s in socks:
            s.close()
        socks.clear()
        wait_until(lambda: http_ok(status), timeout_s=15, what="the status port answering again")
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=10)
    lines = re.findall(r"cannot accept connections", text)
    assert "socket.accept() out of system resource" not in text
    assert 1 <= len(lines) <= 5, f"{len(lines)} accept() lines in a 3 s window"
    assert "ulimit -n" in text and "[scheduler] max_connections" in text
