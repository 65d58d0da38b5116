"""Nothing holds the dataplane's connections for ever: quiet engines, slow clients, too many clients.

Real processes on loopback: the scheduler, the dataplane with short limits (1 s for an engine's
first byte and between its bytes, 1 s for a request head, 40 connections), and a scripted engine
that takes a request and then says nothing (`silent`: not even a status line) or stops in the
middle of a stream (`hang`). What a user must see: a 504 naming the replica for the first, the
chunks so far and a connection closed without `[DONE]` for the second, the engine request closed
and the slot freed either way; a connection that trickles its head is answered 408 and closed.
(What the connection limit closes, and when it refuses a new connection, is in
tests/test_http_server.py and tests/e2e/test_ports_bounded.py.)
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from real_stack import SCRIPTED_ENGINE, ScriptProcess
from support import Ports, Service, free_port, running, wait_until

from luftpause.bench import stack_config

MODEL = "scripted-llama"
TIMEOUT_S = 1.0
MAX_CONNECTIONS = 40


class _Stack:
    def __init__(self, tmp: Path) -> None:
        ports = Ports(engines=[free_port()])
        self.ports = ports
        limits = {
            "engine_first_byte_timeout_s": TIMEOUT_S,
            "engine_idle_timeout_s": TIMEOUT_S,
            "header_timeout_s": TIMEOUT_S,
            "max_connections": MAX_CONNECTIONS,
        }
        replica = stack_config.replica("scripted", ports.engines[0], [MODEL])
        tables = stack_config.stack(
            grpc=ports.grpc, status=ports.status, dataplane=ports.dataplane, replicas=[replica]
        )
        config = stack_config.write(tmp, stack_config.merged(tables, {"dataplane": limits}))
        self.engine_url = f"http://127.0.0.1:{ports.engines[0]}"
        self.url = f"http://127.0.0.1:{ports.dataplane}"
        self.services = (
            ScriptProcess(
                "scripted", [str(SCRIPTED_ENGINE), "--port", str(ports.engines[0])], tmp / "engine.log"
            ),
            Service("scheduler", ["scheduler", "--config", str(config)], tmp / "scheduler.log"),
            Service("dataplane", ["dataplane", "--config", str(config)], tmp / "dataplane.log"),
        )

    def in_flight(self) -> int:
        doc = httpx.get(f"http://127.0.0.1:{self.ports.status}/status", timeout=5).json()
        return sum(r["in_flight"] for r in doc["replicas"])

    def engine_entry(self, tag: str) -> dict:
        return next(e for e in httpx.get(f"{self.engine_url}/_log", timeout=5).json() if e["tag"] == tag)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    s = _Stack(tmp_path_factory.mktemp("timeouts"))
    with running(*s.services):
        for service in s.services:
            service.start()
        s.services[2].wait_http(f"{s.url}/health")
        wait_until(
            lambda: httpx.get(f"{s.url}/health", timeout=2).json()["scheduler"] == "connected",
            what="the dataplane to connect",
        )
        wait_until(
            lambda: all(r["probed"] and r["healthy"] for r in
                        httpx.get(f"http://127.0.0.1:{s.ports.status}/status", timeout=2).json()["replicas"]),
            what="the scheduler to find the engine healthy",
        )  # fmt: skip
        yield s


def _body(tag: str, script: str, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"[{tag}] hi"}],
        "stream": stream,
        "script": script,
        "tag": tag,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_silent_after_taking_the_request_is_a_504_naming_the_replica(stack: _Stack, stream: bool):
    tag = uuid.uuid4().hex
    asked = time.monotonic()
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=_body(tag, "silent", stream), timeout=30)
    took = time.monotonic() - asked
    assert r.status_code == 504
    assert (
        r.json()["error"]["message"]
        == f"engine scripted: engine sent nothing within {TIMEOUT_S:g} s of the request"
    )
    assert TIMEOUT_S <= took < TIMEOUT_S + 5
    wait_until(lambda: stack.engine_entry(tag)["disconnected"], what="the engine request to be closed")
    wait_until(lambda: stack.in_flight() == 0, what="the slot to be freed")


def test_a_stream_that_stops_midway_is_cut_after_the_idle_timeout(stack: _Stack):
    tag = uuid.uuid4().hex
    received = b""
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json=_body(tag, "hang", True), timeout=30
    ) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for piece in r.iter_raw():
                received += piece
    assert b'"content":"a"' in received.replace(b" ", b"") and b"[DONE]" not in received
    wait_until(lambda: stack.engine_entry(tag)["disconnected"], what="the engine request to be closed")
    wait_until(lambda: stack.in_flight() == 0, what="the slot to be freed")


def _read_until_closed(sock: socket.socket, deadline: float, got: bytearray) -> bool:
    """Adds to `got` what the server sends until it closes the connection (True) or `deadline`
    passes with the connection still open (False)."""
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            return True  # closed with bytes of ours unread: a reset after whatever it sent
        if not piece:
            return True
        got += piece


def test_connections_trickling_their_heads_are_closed_with_a_408(stack: _Stack):
    slow = [socket.create_connection(("127.0.0.1", stack.ports.dataplane)) for _ in range(30)]
    try:
        for sock in slow:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        opened = time.monotonic()
        # Each keeps sending a byte of a header now and then, as a slowloris client does, which
        # keeps uvicorn's own keep-alive timeout from ever firing.
        answers = [bytearray() for _ in slow]
        closed: set[int] = set()
        while len(closed) < len(slow) and time.monotonic() - opened < TIMEOUT_S + 5:
            for i, sock in enumerate(slow):
                if i in closed:
                    continue
                try:
                    sock.sendall(b"x")
                except OSError:
                    closed.add(i)
                    continue
                if _read_until_closed(sock, time.monotonic() + 0.01, answers[i]):
                    closed.add(i)
        took = time.monotonic() - opened
    finally:
        for sock in slow:
            sock.close()
    assert len(closed) == len(slow), "every trickling connection was closed"
    assert took < TIMEOUT_S + 5
    answered = [bytes(a) for a in answers if a]
    assert answered and all(a.startswith(b"HTTP/1.1 408 ") and b"header_timeout_s" in a for a in answered)
    # The dataplane still serves.
    assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200


def test_the_descriptor_limit_is_raised_to_what_the_connection_limit_needs():
    # In a process of its own: the limit is the process's.
    script = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from luftpause.http_server import raise_fd_limit\n"
        "print(raise_fd_limit(1000), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    returned, soft, hard = (int(x) for x in out)
    wanted = 64 + 3 * 1000
    assert returned == soft == (wanted if hard < 0 or hard >= wanted else hard)
