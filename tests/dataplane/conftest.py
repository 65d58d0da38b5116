"""In-process doubles for the dataplane's neighbours, to drive the failure cases exactly.

`FakeScheduler` is a gRPC server speaking the real contract whose admissions a test can hold,
refuse, or let through, and which records every admission and event; it puts a turn without a
run header in its run as the scheduler does (the scheduler's own `RunIdentity`). `ScriptedEngine` is an ASGI app
that answers chat completions the way a test tells it to: a whole reply, a stream that ends,
breaks off or waits, or an error status. The dataplane itself runs under uvicorn on a loopback
port in the test's own event loop, so the client, the dataplane and both doubles share one loop
and every wait is on a condition, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
import uvicorn

# The whole stack as real processes, for the tests that need every piece real.
from real_stack import real_stack  # noqa: F401
from support import free_port, until

from luftpause import config as lp_config
from luftpause.dataplane.app import create_app
from luftpause.proto import pb, rpc
from luftpause.scheduler.run_identity import RunIdentity

MODEL = "fake-llama"


class FakeScheduler(rpc.SchedulerServicer):
    """Places every known-model turn on `replica`, unless told to hold admissions."""

    def __init__(self, replica: str, url: str) -> None:
        self.replica, self.url = replica, url
        self.admits: list[pb.AdmitRequest] = []
        self.abandoned: list[str] = []
        self.events: list[pb.TurnEvent] = []
        self.resyncs: list[pb.ResyncRequest] = []
        # Everything in the order it arrived, as ("admit"|"resync"|event kind, turn id).
        self.log: list[tuple[str, str]] = []
        # What each message on the Turns stream carried, as those same pairs.
        self.messages: list[list[tuple[str, str]]] = []
        self.hold = False
        # The engine slot every placement names (the real scheduler's, on a slot engine), or none.
        self.slot: int | None = None
        self.identity = RunIdentity()
        self._release = asyncio.Event()
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def release(self) -> None:
        self.hold = False
        self._release.set()

    def kinds(self, turn_id: str) -> list[str]:
        return [e.WhichOneof("event") for e in self.events if e.turn_id == turn_id]

    async def start(self, port: int = 0) -> FakeScheduler:
        self._server = grpc.aio.server()
        rpc.add_SchedulerServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    async def Turns(self, request_iterator: AsyncIterator[pb.DataplaneBatch], context: Any):  # noqa: ANN201
        """Answers admissions on the stream (held ones once released), records every item."""
        answers: asyncio.Queue[pb.Placement] = asyncio.Queue()
        held: dict[str, asyncio.Task[None]] = {}

        async def place_when_released(request: pb.AdmitRequest) -> None:
            while self.hold:
                self._release.clear()
                await self._release.wait()
            held.pop(request.turn_id, None)
            run_id = self.identity.run_of(request.echoed_tool_call_ids) or request.run_id
            reply = pb.AdmitReply(
                outcome=pb.AdmitReply.PLACED, replica=self.replica, url=self.url, run_id=run_id
            )
            if self.slot is not None:
                reply.slot = self.slot
            answers.put_nowait(pb.Placement(turn_id=request.turn_id, reply=reply))

        async def read() -> None:
            async for batch in request_iterator:
                # It grants no reservations, as a scheduler that knows nothing of them would not:
                # a dataplane's request for them goes unanswered and unrecorded.
                items = [i for i in batch.items if i.WhichOneof("item") != "want_reservations"]
                if not items:
                    continue
                self.messages.append(
                    [
                        ("admit", i.admit.turn_id) if i.WhichOneof("item") == "admit" else
                        (i.event.WhichOneof("event"), i.event.turn_id)
                        for i in items
                    ]
                )  # fmt: skip
                for item in items:
                    if item.WhichOneof("item") == "admit":
                        request = item.admit
                        self.admits.append(request)
                        self.log.append(("admit", request.turn_id))
                        if request.model != MODEL:
                            reply = pb.AdmitReply(
                                outcome=pb.AdmitReply.UNKNOWN_MODEL,
                                message=f"no Generative replica serves model '{request.model}'",
                            )
                            answers.put_nowait(pb.Placement(turn_id=request.turn_id, reply=reply))
                        else:
                            held[request.turn_id] = asyncio.ensure_future(place_when_released(request))
                        continue
                    event = item.event
                    self.events.append(event)
                    self.log.append((event.WhichOneof("event"), event.turn_id))
                    if event.WhichOneof("event") == "completed":
                        self.identity.remember(event.run_id, event.completed.tool_call_ids)
                    elif event.WhichOneof("event") == "run_ended":
                        self.identity.forget(event.run_id)
                    if event.WhichOneof("event") == "abandoned" and event.turn_id in held:
                        # Abandoned while held: it leaves the queue unanswered.
                        held.pop(event.turn_id).cancel()
                        self.abandoned.append(event.turn_id)

        reader = asyncio.ensure_future(read())
        try:
            while not reader.done() or not answers.empty():
                getting = asyncio.ensure_future(answers.get())
                await asyncio.wait({getting, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getting.done():
                    await context.write(pb.SchedulerBatch(placements=[getting.result()]))
                else:
                    getting.cancel()
        finally:
            reader.cancel()
            for task in held.values():
                task.cancel()

    async def Resync(self, request_iterator: Any, context: Any) -> pb.ResyncReply:
        request = pb.ResyncRequest()
        async for chunk in request_iterator:
            request.MergeFrom(chunk)
        self.resyncs.append(request)
        self.log.append(("resync", ""))
        return pb.ResyncReply(runs=len(request.runs), turns=len(request.turns))


Behaviour = Callable[["ScriptedEngine", Callable[..., Awaitable[None]]], Awaitable[None]]


@dataclass
class ScriptedEngine:
    """An engine whose every answer is `behaviour`; records what it was sent."""

    behaviour: Behaviour | None = None
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    # Set when a streaming answer saw its client (the dataplane) go away.
    saw_disconnect: asyncio.Event = field(default_factory=asyncio.Event)
    # A streaming answer that waits, waits for this.
    go_on: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append(({k.decode(): v.decode() for k, v in scope["headers"]}, body))
        assert self.behaviour is not None, "tell the engine how to answer first"
        self._receive = receive
        await self.behaviour(self, send)

    async def wait_for_disconnect(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.saw_disconnect.set()


def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "system_fingerprint": "scripted",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def completion(content: str | None = "hello", tool_call_ids: tuple[str, ...] = ()) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_call_ids:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            for i in tool_call_ids
        ]
    return {
        "id": "c1",
        "object": "chat.completion",
        "system_fingerprint": "scripted",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_call_ids else "stop"}
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def answers_json(payload: dict, status: int = 200, headers: dict[str, str] | None = None) -> Behaviour:
    async def behaviour(engine: ScriptedEngine, send: Callable) -> None:
        raw = [(b"content-type", b"application/json")] + [
            (k.encode(), v.encode()) for k, v in (headers or {}).items()
        ]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    return behaviour


def streams(chunks: list[bytes], then: str = "end") -> Behaviour:
    """Sends `chunks`, then: "end" (finish the response), "abort" (close the connection before
    the end) or "wait" (send nothing more until `go_on`, watching for the client to leave)."""

    async def behaviour(engine: ScriptedEngine, send: Callable) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for piece in chunks:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        if then == "end":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif then == "wait":
            watcher = asyncio.ensure_future(engine.wait_for_disconnect())
            go_on = asyncio.ensure_future(engine.go_on.wait())
            await asyncio.wait({watcher, go_on}, return_when=asyncio.FIRST_COMPLETED)
            if go_on.done():
                watcher.cancel()
                await send({"type": "http.response.body", "body": chunk({}, "stop") + b"data: [DONE]\n\n"})
            else:
                go_on.cancel()
        # "abort": return with the response unfinished; uvicorn closes the connection.

    return behaviour


async def serve_asgi(app: Any, port: int) -> tuple[uvicorn.Server, asyncio.Task]:
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            lifespan="auto",
            # Long enough for tests that stop a server mid-turn to see the turn cut off, short
            # enough not to slow them.
            timeout_graceful_shutdown=1,
        )
    )
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started or task.done(), 10.0, "uvicorn to start")
    if task.done():
        task.result()
    return server, task


async def stop_asgi(server: uvicorn.Server, task: asyncio.Task) -> None:
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10.0)


@dataclass
class Stack:
    scheduler: FakeScheduler
    engine: ScriptedEngine
    engine_port: int
    dataplane_port: int
    config: lp_config.Config
    dataplane_server: tuple[uvicorn.Server, asyncio.Task]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.dataplane_port}"


@contextlib.asynccontextmanager
async def open_stack(engine: Any = None, **replica: Any) -> AsyncIterator[Stack]:
    """Fake scheduler + an engine "fake-a" (API key from FAKE_A_KEY) + an in-process dataplane.

    `engine` is the ASGI app serving fake-a (a new `ScriptedEngine` by default; `Stack.engine`
    is it either way); `replica` sets further fields of fake-a's config (`engine_priority`).
    """
    engine = ScriptedEngine() if engine is None else engine
    engine_port = free_port()
    engine_server = await serve_asgi(engine, engine_port)
    scheduler = await FakeScheduler("fake-a", f"http://127.0.0.1:{engine_port}").start()
    config = lp_config.Config(
        dataplane=lp_config.DataplaneSettings(port=free_port(), scheduler=f"127.0.0.1:{scheduler.port}"),
        replicas=[
            lp_config.Replica(
                name="fake-a",
                url=f"http://127.0.0.1:{engine_port}",
                models=[MODEL],
                api_key_env="FAKE_A_KEY",
                **replica,
            )
        ],
    )
    dataplane_server = await serve_asgi(create_app(config), config.dataplane.port)
    stack = Stack(scheduler, engine, engine_port, config.dataplane.port, config, dataplane_server)
    try:
        await until(lambda: scheduler.resyncs, what="the dataplane's first resync")
        yield stack
    finally:
        await stop_asgi(*dataplane_server)
        await scheduler.stop()
        await stop_asgi(*engine_server)


@pytest.fixture
async def stack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    """`open_stack()`: a scripted engine behind a replica that declares nothing more."""
    monkeypatch.setenv("FAKE_A_KEY", "engine-secret")
    async with open_stack() as stack:
        yield stack
