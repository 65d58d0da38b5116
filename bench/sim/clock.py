"""Virtual time for the simulator: a heap of callbacks, each run at its moment, in order.

Callbacks scheduled for the same moment run in the order they were scheduled, so a run of the
simulator is a deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + delay, callback)

    def every(self, period: float, callback: Callable[[], None], start: float = 0.0) -> None:
        """Runs `callback` at `start` and every `period` after, for as long as the clock runs."""

        def tick() -> None:
            callback()
            self.after(period, tick)

        self.at(start, tick)

    def run_until(self, end: float) -> None:
        while self._heap and self._heap[0][0] <= end:
            when, _, callback = heapq.heappop(self._heap)
            self.now = when
            callback()
        self.now = end
