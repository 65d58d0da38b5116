"""The engine's KV memory: a pool of tokens shared by running requests and the prefix cache.

An admitted request reserves its uncached prompt plus the longest reply it may write (its
max_tokens), as SGLang does: the engine will not start a request it might have to abort for
lack of memory. Cached prefixes hold memory too, but unlocked ones are given back (least
recently used first) whenever a reservation needs the room. A request that finds neither free
memory nor anything left to evict waits in the queue.
"""

from __future__ import annotations

from luftpause.fake_engine.prefix_cache import PrefixCache


class KvPool:
    """`capacity` tokens; `reserved` belong to running requests, the rest is cache or free."""

    def __init__(self, capacity: int, cache: PrefixCache) -> None:
        if capacity < 1:
            raise ValueError(f"a KV pool needs at least one token, got {capacity}")
        self.capacity = capacity
        self.cache = cache
        self.reserved = 0

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.cache.size

    def could_ever_hold(self, tokens: int) -> bool:
        """Whether `tokens` fit in an engine with nothing else running."""
        return tokens <= self.capacity

    def reserve(self, tokens: int) -> bool:
        """Takes `tokens` for a request, evicting unlocked cache if needed; False if they do not fit now."""
        if self.free < tokens:
            if self.free + self.cache.evictable < tokens:
                return False
            self.cache.evict(tokens - self.free)
        self.reserved += tokens
        return True

    def release(self, tokens: int) -> None:
        self.reserved -= tokens

    def trim_cache(self) -> None:
        """Evicts what a just-cached reply pushed over capacity (a reply longer than reserved)."""
        if self.free < 0:
            self.cache.evict(-self.free)
