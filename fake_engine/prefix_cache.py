"""The engine's prefix cache: the KV of message sequences it has seen, kept until memory is needed.

A prompt is a chain of blocks, one per message (the tool definitions, when offered, are a block
of their own in front, as a chat template puts them into the system prompt). A block's key is a
digest of its parent's key and its own content, so two prompts share a cached block exactly
when they agree on every message up to and including it: the same rule as SGLang's radix tree,
at message rather than token granularity.

Cached blocks form a tree. A running request locks the blocks it matched so they cannot be
evicted under it. When the KV pool needs room, the least recently used unlocked leaf goes first,
then its parent if that became a leaf; a chain is therefore shortened from its end, never cut in
the middle, and what is left is always a valid prefix.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from luftpause.fake_engine.tokens import content_text, message_tokens, tools_tokens

ROOT = b""


@dataclass(frozen=True, slots=True)
class Block:
    """One message of a prompt: its chained key and the tokens it takes."""

    key: bytes
    tokens: int


def _chain(parent: bytes, content: str) -> bytes:
    return hashlib.blake2b(parent + content.encode(), digest_size=16).digest()


def message_identity(message: Mapping[str, Any]) -> str:
    """What makes two messages the same to the cache: role, text, tool calls and the call answered.

    Clients echo an assistant message back with small differences (content null or "", extra
    fields), which a real engine would not see after templating either, so only these count.
    """
    calls = [
        [str((c.get("function") or {}).get("name", "")), str((c.get("function") or {}).get("arguments", ""))]
        for c in message.get("tool_calls") or ()
    ]
    return json.dumps(
        [message.get("role"), content_text(message.get("content")), calls, message.get("tool_call_id") or ""],
        separators=(",", ":"),
    )


def prompt_blocks(
    messages: Sequence[Mapping[str, Any]], tools: Iterable[Mapping[str, Any]] | None = None
) -> tuple[Block, ...]:
    """The prompt of a chat request as cache blocks; their tokens add up to `prompt_tokens`."""
    blocks: list[Block] = []
    key = ROOT
    tool_list = list(tools or ())
    if tool_list:
        key = _chain(key, json.dumps(tool_list, sort_keys=True, separators=(",", ":")))
        blocks.append(Block(key, tools_tokens(tool_list)))
    for message in messages:
        key = _chain(key, message_identity(message))
        blocks.append(Block(key, message_tokens(message)))
    return tuple(blocks)


def reply_block(prompt: Sequence[Block], reply_message: Mapping[str, Any]) -> Block:
    """The block the engine's own reply becomes, keyed as the next turn's prompt will key it."""
    parent = prompt[-1].key if prompt else ROOT
    return Block(_chain(parent, message_identity(reply_message)), message_tokens(reply_message))


class _Node:
    __slots__ = ("children", "locks", "parent", "tokens")

    def __init__(self, parent: bytes, tokens: int) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children = 0
        self.locks = 0


class PrefixCache:
    """Cached blocks with their tokens; `size` is the KV memory they hold."""

    def __init__(self) -> None:
        # Least recently used first.
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self.size = 0
        self.locked = 0
        self.evicted_total = 0
        """Tokens evicted since the cache was made (what the simulator reports as churn)."""
        self.on_evict: Callable[[bytes, int], None] | None = None
        """Told of each evicted block (its key and tokens): a host tier behind the KV keeps it."""

    def __contains__(self, key: bytes) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def evictable(self) -> int:
        """Tokens that eviction could free now (every unlocked block, leaves first)."""
        return self.size - self.locked

    def match(self, blocks: Sequence[Block]) -> int:
        """How many leading `blocks` are cached (without touching anything)."""
        matched = 0
        for block in blocks:
            if block.key not in self._nodes:
                break
            matched += 1
        return matched

    def lock(self, blocks: Sequence[Block]) -> None:
        """Pins these cached blocks for a running request and marks them used now."""
        for block in blocks:
            node = self._nodes[block.key]
            if node.locks == 0:
                self.locked += node.tokens
            node.locks += 1
            self._nodes.move_to_end(block.key)

    def unlock(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            node = self._nodes.get(block.key)
            if node is None:
                continue
            node.locks -= 1
            if node.locks == 0:
                self.locked -= node.tokens

    def locked_after(self, released: Iterable[Sequence[Block]], held: Sequence[Block]) -> int:
        """The tokens `locked` would be if each of `released` were unlocked and `held` locked."""
        delta: dict[bytes, int] = {}
        for blocks in released:
            for block in blocks:
                delta[block.key] = delta.get(block.key, 0) - 1
        for block in held:
            delta[block.key] = delta.get(block.key, 0) + 1
        locked = self.locked
        for key, change in delta.items():
            node = self._nodes.get(key)
            if node is None:
                continue
            if node.locks > 0 >= node.locks + change:
                locked -= node.tokens
            elif node.locks + change > 0 >= node.locks:
                locked += node.tokens
        return locked

    def insert(self, blocks: Sequence[Block]) -> None:
        """Caches a whole chain (a finished request's prompt and reply), marking it used now."""
        parent = ROOT
        for block in blocks:
            node = self._nodes.get(block.key)
            if node is None:
                if parent != ROOT and parent not in self._nodes:
                    return  # its parent was evicted meanwhile: a chain is never cached with a hole
                self._nodes[block.key] = _Node(parent, block.tokens)
                self.size += block.tokens
                if parent != ROOT:
                    self._nodes[parent].children += 1
            else:
                self._nodes.move_to_end(block.key)
            parent = block.key

    def evict(self, tokens: int) -> int:
        """Frees at least `tokens` if it can, least recently used leaves first; returns what it freed."""
        freed = 0
        for key in list(self._nodes):
            if freed >= tokens:
                break
            node = self._nodes.get(key)
            while node is not None and node.locks == 0 and node.children == 0 and freed < tokens:
                del self._nodes[key]
                self.size -= node.tokens
                freed += node.tokens
                self.evicted_total += node.tokens
                if self.on_evict is not None:
                    self.on_evict(key, node.tokens)
                key = node.parent
                node = self._nodes.get(key)
                if node is not None:
                    node.children -= 1
        return freed

    def keys(self) -> list[bytes]:
        """Cached keys, least recently used first (for tests and the status of the model)."""
        return list(self._nodes)
