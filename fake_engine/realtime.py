"""The engine model driven in real time on asyncio, for the HTTP fake engine.

One task runs the model's steps back to back while there is work, sleeping each step's duration
(times `time_scale`: 0.1 runs ten times faster than the modelled engine) against a deadline, so
that a busy event loop catches up instead of drifting. Each request is a `Generation` whose
`tokens()` yields the count of tokens decoded so far after every step that advanced it; leaving
that iterator early (a client that went away) cancels the request in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator

from luftpause.fake_engine.engine import Engine, EngineLoad, ModelRequest
from luftpause.fake_engine.params import EngineParams


class EngineRejected(Exception):
    """The request can never fit this engine's KV pool."""


class Generation:
    """One request in flight: the tokens it has so far and whether it is done."""

    def __init__(self, driver: RealtimeEngine, request: ModelRequest) -> None:
        self._driver = driver
        self.request = request
        self.decoded = 0
        self.done = False
        self.rejected = False
        self._changed = asyncio.Event()

    def _update(self, decoded: int | None = None, done: bool = False, rejected: bool = False) -> None:
        if decoded is not None:
            self.decoded = decoded
        self.done = self.done or done
        self.rejected = self.rejected or rejected
        self._changed.set()

    async def tokens(self) -> AsyncGenerator[int, None]:
        """Tokens decoded so far, after each step that produced some; ends when the request is done."""
        seen = 0
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                if self.rejected:
                    raise EngineRejected(
                        f"the prompt and max_tokens ({self.request.prompt_tokens} tokens plus the reply) "
                        f"exceed this engine's KV pool of {self._driver.engine.kv.capacity} tokens"
                    )
                if self.decoded > seen:
                    seen = self.decoded
                    yield seen
                if self.done:
                    return
        finally:
            if not self.done:
                self._driver.cancel(self.request.request_id)

    async def wait(self) -> None:
        """Until the request is done (a single-pass request has no tokens to iterate)."""
        async with contextlib.aclosing(self.tokens()) as progress:
            async for _ in progress:
                pass


class RealtimeEngine:
    """An `Engine` whose clock follows the wall clock (scaled)."""

    def __init__(self, params: EngineParams | None = None, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.engine = Engine(params)
        self.time_scale = time_scale
        self._live: dict[str, Generation] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._wall0 = time.monotonic()

    @property
    def params(self) -> EngineParams:
        return self.engine.params

    def submit(self, request: ModelRequest) -> Generation:
        self._ensure_running()
        assert self._wake is not None
        if not self.engine.busy:
            # An idle engine's clock stood still; it starts this request from now.
            self.engine.idle_until(self._virtual_now())
        generation = Generation(self, request)
        self._live[request.request_id] = generation
        self.engine.submit(request)
        self._wake.set()
        return generation

    def next_id(self) -> str:
        return f"req-{next(self._ids)}"

    def cancel(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            if self._wake is not None:
                self._wake.set()  # freed room may admit a waiting request

    def load(self) -> EngineLoad:
        return self.engine.load()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _virtual_now(self) -> float:
        return (time.monotonic() - self._wall0) / self.time_scale

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="fake-engine-steps")

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            step = self.engine.step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                if not self.engine.busy:
                    continue
                self.engine.idle_until(self._virtual_now())
                continue
            # Sleep until the step's end on the scaled wall clock; if we are late, do not sleep.
            delay = step.ended * self.time_scale - (time.monotonic() - self._wall0)
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            for request_id in step.rejected:
                generation = self._live.pop(request_id, None)
                if generation is not None:
                    generation._update(rejected=True)
            finished = set(step.finished)
            for request_id, decoded in step.tokens.items():
                generation = self._live.get(request_id)
                if generation is not None:
                    generation._update(decoded, done=request_id in finished)
            for request_id in finished:
                generation = self._live.pop(request_id, None)
                if generation is not None:
                    generation._update(done=True)
