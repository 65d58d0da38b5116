"""The host tier behind an engine's KV: prefixes evicted from the KV, kept in host memory.

llama-server keeps the prompts its slots drop in host memory (`--cache-ram`, on by default), and
SGLang's HiCache keeps the radix tree's evicted nodes there; a later request whose prompt starts
with such a prefix has it copied back instead of computing it again. Here the tier holds cache
blocks (`prefix_cache.Block`) by their chained keys, so a block in the tier stands for its whole
prefix, as in the KV's own cache. It holds at most `capacity` tokens: putting a block past that
drops the least recently used first. What a restore costs is the engine's to charge
(`EngineParams.host_restore_per_token_s`); the tier only says what it has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from luftpause.fake_engine.prefix_cache import Block


class HostTier:
    """Blocks kept in host memory, least recently used first, at most `capacity` tokens."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a host tier needs at least one token, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self.size = 0
        self.restored_total = 0
        """Tokens copied back to the KV since the tier was made."""

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, key: bytes, tokens: int) -> None:
        """Keeps one block (marking it used now), dropping the least recently used past capacity."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        if tokens > self.capacity:
            return
        self._blocks[key] = tokens
        self.size += tokens
        while self.size > self.capacity:
            _, dropped = self._blocks.popitem(last=False)
            self.size -= dropped

    def put_chain(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            self.put(block.key, block.tokens)

    def match(self, blocks: Sequence[Block], start: int = 0) -> int:
        """How many of `blocks` from `start` on the tier holds, one after another."""
        count = 0
        for block in blocks[start:]:
            if block.key not in self._blocks:
                break
            count += 1
        return count

    def restore(self, blocks: Sequence[Block]) -> int:
        """Marks these blocks used now, as they are copied back; returns their tokens."""
        tokens = 0
        for block in blocks:
            if block.key in self._blocks:
                self._blocks.move_to_end(block.key)
                tokens += block.tokens
        self.restored_total += tokens
        return tokens
