"""Waiting on runs: until all (or any) of them have ended, a timeout passes, or an approval waits.

The registry (runs.py) pulses `Changes` whenever a run's state changes in a way a waiter may
care about (an approval asked or answered, a run ended); every waiter then checks its condition
again. A timeout is clamped to [0, MAX_AWAIT_TIMEOUT_S].
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from luftpause.runtime.approvals import Approval
from luftpause.runtime.run import Run

AwaitMode = Literal["all", "any"]

DEFAULT_AWAIT_TIMEOUT_S = 60.0
MAX_AWAIT_TIMEOUT_S = 600.0


def clamped(timeout_s: float) -> float:
    """A waiter's timeout within [0, MAX_AWAIT_TIMEOUT_S]."""
    return min(max(timeout_s, 0.0), MAX_AWAIT_TIMEOUT_S)


def ended(runs: list[Run], mode: AwaitMode) -> bool:
    """Whether the runs are done: every one has ended (all), or one has (any)."""
    over = [not r.running for r in runs]
    return any(over) if mode == "any" else all(over)


def waited_enough(
    runs: list[Run], mode: AwaitMode, stop_on_approval: Callable[[Run, Approval], bool] | None
) -> bool:
    """Whether a wait on the runs is over: they are done, or (with `stop_on_approval`) one of them
    has a pending approval for which it answers True, so that the caller can ask the user."""
    if ended(runs, mode):
        return True
    if stop_on_approval is not None:
        return any(stop_on_approval(r, a) for r in runs for a in list(r.approvals.values()))
    return False


class Changes:
    """What waiters on runs wait for: a pulse whenever a run's state changes."""

    def __init__(self, in_background: Callable[[Awaitable[Any]], None]) -> None:
        self._condition = asyncio.Condition()
        self._in_background = in_background

    def pulse(self) -> None:
        """Wakes every waiter to check its condition again (callable from synchronous code)."""

        async def notify() -> None:
            async with self._condition:
                self._condition.notify_all()

        self._in_background(notify())

    async def until(self, satisfied: Callable[[], bool], timeout_s: float) -> bool:
        """Waits until `satisfied()` holds, checked at every pulse, or the (clamped) timeout;
        True when it timed out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + clamped(timeout_s)
        async with self._condition:
            while not satisfied():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return True
                try:
                    await asyncio.wait_for(self._condition.wait(), remaining)
                except TimeoutError:
                    return not satisfied()
        return False
