"""The engine client: HTTP/1.1 replies read right however the bytes are cut, connections kept
alive and reused only when that is safe, and transport failures told apart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import free_port

from luftpause.dataplane.engine_client import (
    EngineBrokeOff,
    EngineClient,
    EngineRequest,
    EngineUnreachable,
    _Connection,
    _Origin,
)

CHUNKS = [b"data: one\n\n", b"data: two\n\n", b"x" * 300, b"data: [DONE]\n\n"]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"retry-after: 3\r\n\r\n"
    + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in CHUNKS)
    + b"0\r\ntrailer: yes\r\n\r\n"
)


class _FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return None


async def _read(
    reply: bytes, cuts: list[int], eof: bool = False
) -> tuple[int, dict[str, str], bytes, _Connection]:
    conn = _Connection()
    transport = _FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.send(_Origin("http://engine:8000"), "/v1/chat/completions", EngineRequest("", {"x": "1"}, b"{}"))
    assert transport.written.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine:8000\r\n")
    assert transport.written.endswith(b"x: 1\r\n\r\n{}")
    start = 0
    for cut in [*sorted(cuts), len(reply)]:
        if cut > start:
            conn.data_received(reply[start:cut])
            start = cut
    if eof:
        conn.eof_received()
    status, headers = await conn.head()
    pieces = []
    while (piece := await conn.next_piece()) is not None:
        pieces.append(piece)
    return status, headers, b"".join(pieces), conn


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(CHUNKED)), max_size=12))
def test_a_chunked_reply_reads_the_same_however_it_is_cut(cuts):
    status, headers, body, conn = asyncio.run(_read(CHUNKED, cuts))
    assert status == 200
    assert headers["content-type"] == "text/event-stream" and headers["retry-after"] == "3"
    assert body == b"".join(CHUNKS)
    assert conn.finished and conn.reusable


def test_all_chunks_of_one_read_make_one_piece():
    async def go() -> list[bytes]:
        conn = _Connection()
        conn.connection_made(_FakeTransport())  # type: ignore[arg-type]
        conn.send(_Origin("http://e"), "/", EngineRequest("", {}, b""))
        conn.data_received(CHUNKED)
        await conn.head()
        return [p async for p in _pieces(conn)]

    assert asyncio.run(go()) == [b"".join(CHUNKS)]


async def _pieces(conn: _Connection):
    while (piece := await conn.next_piece()) is not None:
        yield piece


@pytest.mark.parametrize(
    ("reply", "eof", "body", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", False, b"hello", True),
        (b"HTTP/1.1 429 Too Many\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", False, b"{}", False),
        (b"HTTP/1.1 200 OK\r\ncontent-type: a/b\r\n\r\nuntil the end", True, b"until the end", False),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", False, b"", True),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nz", False, b"z", False),
    ],
)
def test_other_framings(reply: bytes, eof: bool, body: bytes, reusable: bool):
    _, _, got, conn = asyncio.run(_read(reply, [len(reply) // 2], eof=eof))
    assert got == body
    assert conn.finished and conn.reusable == reusable


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (b"", EngineUnreachable, "before answering"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            EngineBrokeOff,
            "before the reply was complete",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
            EngineBrokeOff,
            "before the reply was complete",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", EngineBrokeOff, "bad chunk size"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n",
            EngineBrokeOff,
            "did not end",
        ),
        (b"SSH-2.0-OpenSSH\r\n\r\n", EngineBrokeOff, "no HTTP status line"),
    ],
)
def test_replies_that_break_off(reply: bytes, error: type[Exception], message: str):
    with pytest.raises(error, match=message):
        asyncio.run(_read(reply, [], eof=True))


class _RawEngine:
    """A loopback server whose answer to each request on a connection the test scripts."""

    def __init__(self, answers: Callable[[int, int], bytes | None]) -> None:
        # answers(connection number, request number on it) -> bytes to send, or None to close.
        self.answers = answers
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number, served = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append((number, head + body))
                answer = self.answers(number, served)
                served += 1
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def _with_engine(
    answers: Callable[[int, int], bytes | None], work: Callable[[str, EngineClient, _RawEngine], Any]
) -> Any:
    engine = _RawEngine(answers)
    port = free_port()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", port)
    client = EngineClient(connect_timeout_s=2.0)
    try:
        return await work(f"http://127.0.0.1:{port}/v1/chat/completions", client, engine)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def _post(client: EngineClient, url: str) -> bytes:
    response = await client.post(EngineRequest(url, {"content-type": "application/json"}, b'{"a": 1}'))
    try:
        return await response.read()
    finally:
        await response.aclose()


async def test_a_connection_is_kept_alive_and_reused():
    async def work(url: str, client: EngineClient, engine: _RawEngine) -> None:
        assert await _post(client, url) == b"ok"
        assert await _post(client, url) == b"ok"
        assert engine.connections == 1
        assert [n for n, _ in engine.requests] == [1, 1]
        assert engine.requests[0][1].endswith(b'\r\n\r\n{"a": 1}')

    await _with_engine(lambda conn, req: OK, work)


async def test_a_reply_asking_to_close_is_not_reused():
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"

    async def work(url: str, client: EngineClient, engine: _RawEngine) -> None:
        assert await _post(client, url) == b"ok"
        assert await _post(client, url) == b"ok"
        assert engine.connections == 2

    await _with_engine(lambda conn, req: closing, work)


async def test_a_reply_not_read_to_its_end_closes_its_connection():
    async def work(url: str, client: EngineClient, engine: _RawEngine) -> None:
        response = await client.post(EngineRequest(url, {}, b"{}"))
        await response.aclose()  # the client left: the engine must see its request closed
        assert await _post(client, url) == b"ok"
        assert engine.connections == 2

    long_reply = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 10
    await _with_engine(lambda conn, req: long_reply if conn == 1 else OK, work)


async def test_a_kept_alive_connection_closed_as_the_request_goes_out_is_retried_once():
    async def work(url: str, client: EngineClient, engine: _RawEngine) -> None:
        assert await _post(client, url) == b"ok"
        # The engine closes connection 1 on its second request without answering.
        assert await _post(client, url) == b"ok"
        assert [n for n, _ in engine.requests] == [1, 1, 2]

    await _with_engine(lambda conn, req: None if (conn, req) == (1, 1) else OK, work)


async def test_a_new_connection_closed_without_an_answer_is_unreachable():
    async def work(url: str, client: EngineClient, engine: _RawEngine) -> None:
        with pytest.raises(EngineUnreachable, match="closed the connection before answering"):
            await _post(client, url)
        assert engine.connections == 1

    await _with_engine(lambda conn, req: None, work)


async def test_a_refused_connection_is_unreachable_with_the_reason():
    port = free_port()
    client = EngineClient(connect_timeout_s=2.0)
    with pytest.raises(EngineUnreachable, match=f"connect to 127.0.0.1:{port} failed: Connection refused"):
        await client.post(EngineRequest(f"http://127.0.0.1:{port}/v1/chat/completions", {}, b"{}"))
