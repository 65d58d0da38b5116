"""A canned engine for the proxy-overhead benchmark: the cheapest server that streams like one.

The fake engine is a model of an engine, with a step function, a KV pool and JSON built per
token, which costs it milliseconds of CPU a turn; on two cores that can bound a benchmark that
means to measure the proxy in front of it. This one answers every chat completion with the same
stream, built once: a role chunk, `reply_tokens` one-token chunks, a finish chunk and
`data: [DONE]`, each written to the socket as its own HTTP chunk, with a pass through the event
loop in between, as an engine producing tokens would. It also answers what the scheduler's
prober and the SGLang router ask of a worker (`/health`, `/metrics` with an empty queue,
`/server_info`, `/model_info`, `/get_load`, `/v1/models`). HTTP/1.1 with keep-alive only.

    python -m luftpause.bench.proxy_canned_engine --port 9001 [--reply-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import time

MODEL = "fake-llama"


def _sse_events(reply_tokens: int) -> list[bytes]:
    def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
        payload = {
            "id": "chatcmpl-canned",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": f" word{i}"}) for i in range(reply_tokens)]
    events += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    return events


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _whole(status: str, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class CannedEngine(asyncio.Protocol):
    def __init__(self, stream: list[bytes], completion: bytes, gets: dict[bytes, bytes]) -> None:
        self._stream, self._completion, self._gets = stream, completion, gets
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._busy: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._busy is not None:
            self._busy.cancel()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._busy is None or self._busy.done():
            self._serve_next()

    def _serve_next(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self._buffer[:end].decode("latin-1")
        request_line, *header_lines = head.split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        length = 0
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self._buffer) < end + 4 + length:
            return
        body = self._buffer[end + 4 : end + 4 + length]
        self._buffer = self._buffer[end + 4 + length :]
        self._busy = asyncio.ensure_future(self._answer(method, path.split("?")[0].encode(), body))
        self._busy.add_done_callback(lambda _: self._serve_next() if self._transport else None)

    async def _answer(self, method: str, path: bytes, body: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        if method == "POST" and path == b"/v1/chat/completions":
            if not json.loads(body).get("stream"):
                transport.write(_whole("200 OK", b"application/json", self._completion))
                return
            transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for event in self._stream:
                # One pass through the loop per token, as an engine's tokens come one by one.
                await asyncio.sleep(0)
                if self._transport is None:
                    return
                transport.write(_http_chunk(event))
            transport.write(b"0\r\n\r\n")
        elif method == "GET" and path in self._gets:
            content_type = b"text/plain" if path == b"/metrics" else b"application/json"
            transport.write(_whole("200 OK", content_type, self._gets[path]))
        else:
            transport.write(_whole("404 Not Found", b"application/json", b'{"error":{"message":"no route"}}'))


def _gets() -> dict[bytes, bytes]:
    info = json.dumps(
        {
            "model_path": MODEL,
            "served_model_name": MODEL,
            "tokenizer_path": MODEL,
            "is_generation": True,
            "max_running_requests": 1024,
            "max_total_num_tokens": 1 << 20,
            "version": "luftpause-canned-engine",
        }
    ).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "canned"}]})
    gets = {
        b"/health": b'{"status":"ok"}',
        b"/metrics": b"sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n",
        b"/get_load": b'[{"dp_rank":0,"num_tokens":0}]',
        b"/v1/models": models.encode(),
    }
    for path in (b"/server_info", b"/get_server_info", b"/model_info", b"/get_model_info"):
        gets[path] = info
    return gets


async def _serve(host: str, port: int, reply_tokens: int) -> None:
    stream = _sse_events(reply_tokens)
    completion = json.dumps(
        {
            "id": "chatcmpl-canned",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": " ".join(f"word{i}" for i in range(reply_tokens)),
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": reply_tokens,
                "total_tokens": 8 + reply_tokens,
            },
        }
    ).encode()
    gets = _gets()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: CannedEngine(stream, completion, gets), host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="proxy_canned_engine", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--reply-tokens", type=int, default=32)
    args = p.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.reply_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
