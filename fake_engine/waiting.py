"""The engine's waiting queue: requests that arrived but found no slot or no KV memory.

First come, first served, like SGLang's default; with priority scheduling on, a request's
`priority` (higher first) goes before its arrival. The head waits until it fits: a request
behind it is never started first, so a big request cannot be starved by small ones.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class WaitingQueue(Generic[T]):
    """Items keyed by id, ordered by (priority if enabled, arrival)."""

    def __init__(self, by_priority: bool = False) -> None:
        self._by_priority = by_priority
        self._heap: list[tuple[int, int, str]] = []
        self._items: dict[str, T] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def push(self, item_id: str, item: T, priority: int = 0) -> None:
        rank = -priority if self._by_priority else 0
        heapq.heappush(self._heap, (rank, next(self._seq), item_id))
        self._items[item_id] = item

    def peek(self) -> T | None:
        self._drop_removed()
        return self._items[self._heap[0][2]] if self._heap else None

    def pop(self) -> T:
        self._drop_removed()
        _, _, item_id = heapq.heappop(self._heap)
        return self._items.pop(item_id)

    def remove(self, item_id: str) -> bool:
        """Takes an item out wherever it is (its client left); False if it was not waiting."""
        return self._items.pop(item_id, None) is not None

    def ids(self) -> list[str]:
        """Waiting ids in the order they would be started."""
        return [item_id for _, _, item_id in sorted(self._heap) if item_id in self._items]

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] not in self._items:
            heapq.heappop(self._heap)
