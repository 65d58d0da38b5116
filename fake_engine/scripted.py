"""A scripted engine, run as its own process: the broken replica of the dataplane's end-to-end
failure tests and of the engine drill (bench/faults_engines.py).

The fake engine models a healthy engine; this one misbehaves on request. Each chat completion
says in its body (which the dataplane passes through unchanged) what the engine should do:

    "script": "reply"      a whole reply, or a stream of three chunks and [DONE] (the default)
              "tool_calls" a reply asking for tools with the ids in "call_ids"
              "refuse"     at once, the status in "status" with an error body and Retry-After
              "break"      a 200 stream of two chunks, then the connection closed mid-reply
              "hang"       a 200 stream of one chunk, then nothing until the client leaves
              "silent"     nothing at all, not even a status line, until the client leaves
              "headers"    a 200 stream's headers, then the connection closed without a byte
              "garbage"    a 200 stream of bytes that are not server-sent events, then [DONE]
    "tag":    a name the test finds its request by in the log
    "usage_raw": JSON text put verbatim as the reply's `usage` (a stream's in a last chunk with
              no choices, before [DONE]), so that a test can send numbers no encoder writes

`GET /_log` answers every chat request received so far: its tag, path, headers, body and
whether the client (the dataplane) went away before the engine was done; `GET /_gets` the paths
of the other GETs (health probes, metrics). Any path ending in `/health` or `/ready` answers 200. `GET /metrics` reports load in
SGLang's names; with `--busy` the engine reports a queue of five others' requests and nothing
running, more than the lookahead, so every turn for it is held. `--certfile/--keyfile` serve https. With `--always SCRIPT` every chat
request is answered with that script, whatever its body says (a replica broken for every turn);
`POST /_always` with a body of a script name (or nothing, for none) changes that while it runs.

    python -m luftpause.fake_engine.scripted --port 9999 [--busy] [--always S] [--certfile C --keyfile K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import uvicorn

Scope = dict[str, Any]

REFUSAL = {"error": {"message": "scripted refusal", "type": "scripted"}}
# Not events, but for the [DONE] that ends them: a reader that skips what it does not know sees
# a stream that ran to its end.
GARBAGE = b"<html>\x00\xff not an event stream\r\n\r\n%PDF-1.4 \x89PNG garbage garbage\n\ndata: [DONE]\n\n"
_USAGE = "__scripted_usage__"


def _with_usage(payload: dict[str, Any], usage_raw: str | None) -> bytes:
    """`payload` encoded, its `usage` the raw JSON text `usage_raw` when one is given."""
    if usage_raw is None:
        return json.dumps(payload).encode()
    return json.dumps({**payload, "usage": _USAGE}).replace(f'"{_USAGE}"', usage_raw).encode()


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    payload = {
        "id": "scripted-1",
        "object": "chat.completion.chunk",
        "model": "scripted",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _completion(request: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "hello"}
    finish = "stop"
    if request.get("script") == "tool_calls":
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                for i in request.get("call_ids", [])
            ],
        }
        finish = "tool_calls"
    return {
        "id": "scripted-1",
        "object": "chat.completion",
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }


class ScriptedEngine:
    def __init__(self, busy: bool, always: str | None = None) -> None:
        self.busy = busy
        self.always = always
        self.log: list[dict[str, Any]] = []
        self.gets: list[str] = []

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path not in ("/_log", "/_gets"):
            self.gets.append(path)
        if method == "GET" and path.endswith(("/health", "/ready")):
            await self._json(send, 200, {"status": "ok"})
        elif method == "GET" and path == "/metrics":
            waiting = 5 if self.busy else 0
            text = f"sglang:num_running_reqs 0\nsglang:num_queue_reqs {waiting}\n"
            await self._send(send, 200, [(b"content-type", b"text/plain")], text.encode())
        elif method == "GET" and path == "/_log":
            await self._json(send, 200, self.log)
        elif method == "GET" and path == "/_gets":
            await self._json(send, 200, self.gets)
        elif method == "POST" and path == "/_always":
            self.always = (await self._body(receive)).decode() or None
            await self._json(send, 200, {"always": self.always})
        elif method == "POST" and path == "/v1/chat/completions":
            await self._chat(scope, receive, send)
        else:
            await self._json(send, 404, {"error": {"message": f"no route {method} {path}"}})

    @staticmethod
    async def _body(receive: Any) -> bytes:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                return body

    async def _chat(self, scope: Scope, receive: Any, send: Any) -> None:
        body = await self._body(receive)
        request = json.loads(body)
        entry: dict[str, Any] = {
            "tag": request.get("tag", ""),
            "path": scope["path"],
            "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            "body": body.decode(),
            "disconnected": False,
        }
        self.log.append(entry)
        script = self.always or request.get("script", "reply")
        usage_raw = request.get("usage_raw")
        if script == "refuse":
            headers = [(b"content-type", b"application/json")]
            if "retry_after" in request:
                headers.append((b"retry-after", str(request["retry_after"]).encode()))
            await self._send(send, int(request.get("status", 500)), headers, json.dumps(REFUSAL).encode())
            return
        if script == "silent":
            while (await receive())["type"] != "http.disconnect":
                pass
            entry["disconnected"] = True
            return
        if not request.get("stream") and script in ("reply", "tool_calls"):
            headers = [(b"content-type", b"application/json")]
            await self._send(send, 200, headers, _with_usage(_completion(request), usage_raw))
            return
        if not request.get("stream") and script == "garbage":
            await self._send(send, 200, [(b"content-type", b"application/json")], GARBAGE)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        if script == "headers":
            return  # the response unfinished: uvicorn closes the connection
        if script == "garbage":
            await send({"type": "http.response.body", "body": GARBAGE, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if script == "break":
            for piece in (_chunk({"role": "assistant", "content": "a"}), _chunk({"content": "b"})):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            # Returning with the response unfinished makes uvicorn close the connection mid-reply.
            return
        if script == "hang":
            await send(
                {
                    "type": "http.response.body",
                    "body": _chunk({"role": "assistant", "content": "a"}),
                    "more_body": True,
                }
            )
            while (await receive())["type"] != "http.disconnect":
                pass
            entry["disconnected"] = True
            return
        pieces = [
            _chunk({"role": "assistant", "content": "hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "stop"),
            b"data: [DONE]\n\n",
        ]
        if usage_raw is not None:
            usage_chunk = {
                "id": "scripted-1",
                "object": "chat.completion.chunk",
                "model": "scripted",
                "choices": [],
            }
            pieces.insert(3, b"data: " + _with_usage(usage_chunk, usage_raw) + b"\n\n")
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _json(self, send: Any, status: int, payload: Any) -> None:
        await self._send(send, status, [(b"content-type", b"application/json")], json.dumps(payload).encode())

    @staticmethod
    async def _send(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--always", help="the script every chat request is answered with")
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args()
    config = uvicorn.Config(
        ScriptedEngine(args.busy, args.always),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        ssl_certfile=args.certfile,
        ssl_keyfile=args.keyfile,
    )
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
