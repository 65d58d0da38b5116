"""The fake engine's model of an inference engine: running slots, a FIFO queue, prefill and decode time.

Theory of operation. An engine runs at most `slots` requests at once. A request that finds every
slot taken waits in the engine's own FIFO queue, as it would in SGLang's waiting queue, and is
admitted when a running request finishes or is abandoned. Once admitted it prefills its prompt
(a fixed cost plus a cost per prompt token), then decodes its reply one token per decode step.
A request whose client goes away is cancelled wherever it is: taken out of the queue, or its
slot handed to the next waiting request, so generation stops at once.

This first model runs in real time on asyncio and knows nothing of KV exhaustion, prefix caching
or batch-dependent step times: `token_usage` is the running requests' tokens over a nominal pool,
and `cache_hit_rate` is always 0.0 because no prefix cache is modelled yet. The HTTP layer only
uses `Engine.admit`, `Admission.prefill`, `Admission.decode` and `Engine.load`, so a calibrated
model can replace this one behind the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class EngineTiming:
    """The numbers that drive the model; each default says why it is what it is."""

    prefill_base_s: float = 0.010
    """Fixed cost of a prefill: scheduling the batch and launching kernels takes milliseconds on a GPU."""

    prefill_per_token_s: float = 0.00002
    """50k prompt tokens a second, the order of a small model's prefill throughput on one GPU."""

    decode_per_token_s: float = 0.004
    """250 tokens a second per sequence, a small model's decode speed; slower would only slow the tests."""

    reply_tokens: int = 32
    """Length of a text answer when max_tokens allows: several stream chunks, yet a turn stays short."""

    kv_pool_tokens: int = 65536
    """Nominal KV pool that `token_usage` is a fraction of: eight slots of an 8k-token context."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine reports about itself, as SGLang's /metrics does."""

    running: int
    waiting: int
    used_tokens: int
    token_usage: float
    cache_hit_rate: float
    prompt_tokens_total: int
    generation_tokens_total: int


class Admission:
    """One request holding a running slot: it prefills once, then decodes token by token."""

    def __init__(self, engine: Engine, prompt_tokens: int) -> None:
        self._engine = engine
        self.prompt_tokens = prompt_tokens
        self.decoded = 0

    async def prefill(self) -> None:
        timing = self._engine.timing
        await asyncio.sleep(timing.prefill_base_s + timing.prefill_per_token_s * self.prompt_tokens)
        self._engine._prompt_tokens_total += self.prompt_tokens

    async def decode(self) -> None:
        """Waits one decode step; the caller emits one token after each."""
        await asyncio.sleep(self._engine.timing.decode_per_token_s)
        self.decoded += 1
        self._engine._generation_tokens_total += 1


class Engine:
    """A fixed number of running slots and a FIFO queue in front of them."""

    def __init__(self, slots: int = 8, timing: EngineTiming | None = None) -> None:
        if slots < 1:
            raise ValueError(f"an engine needs at least one slot, got {slots}")
        self.slots = slots
        self.timing = timing or EngineTiming()
        self._running: set[Admission] = set()
        # Futures of requests waiting for a slot, oldest first; a finished request hands its slot
        # to the head directly, so arrivals never overtake the queue.
        self._queue: deque[asyncio.Future[None]] = deque()
        self._handed_over = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    @contextlib.asynccontextmanager
    async def admit(self, prompt_tokens: int) -> AsyncIterator[Admission]:
        """Waits for a running slot, holds it for the body of the `async with`, then frees it.

        Cancelling the waiting task (a client that went away) removes it from the queue; leaving
        the body, normally or by cancellation, hands the slot to the next waiting request.
        """
        await self._acquire_slot()
        admission = Admission(self, prompt_tokens)
        self._running.add(admission)
        try:
            yield admission
        finally:
            self._running.discard(admission)
            self._release_slot()

    def load(self) -> EngineLoad:
        used = sum(a.prompt_tokens + a.decoded for a in self._running)
        return EngineLoad(
            running=len(self._running),
            waiting=sum(1 for f in self._queue if not f.done()),
            used_tokens=used,
            token_usage=min(1.0, used / self.timing.kv_pool_tokens),
            cache_hit_rate=0.0,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    def _slots_taken(self) -> int:
        # Counts slots handed to waiters that have not resumed yet, so no arrival can take them.
        return len(self._running) + self._handed_over

    async def _acquire_slot(self) -> None:
        if self._slots_taken() < self.slots and not any(not f.done() for f in self._queue):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot reached us just as we were cancelled: pass it on.
                self._handed_over -= 1
                self._release_slot()
            else:
                with contextlib.suppress(ValueError):
                    self._queue.remove(waiter)
            raise
        self._handed_over -= 1

    def _release_slot(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                self._handed_over += 1
                waiter.set_result(None)
                return


def timing_from_env(spec: str) -> EngineTiming:
    """Timing with overrides written `field=value,field=value` (e.g. `decode_per_token_s=0.05`).

    Tests that need a slow engine in a separate process set this through the environment.
    """
    defaults = EngineTiming()
    overrides: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not hasattr(defaults, key):
            known = ", ".join(f.name for f in fields(EngineTiming))
            raise ValueError(
                f"bad engine timing override '{item}': expected field=value with field one of {known}"
            )
        kind = type(getattr(defaults, key))
        try:
            overrides[key] = kind(value.strip())
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"bad engine timing override '{item}': {key} must be {what}") from None
    return replace(defaults, **overrides)
