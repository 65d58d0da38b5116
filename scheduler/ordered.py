"""A persistent sorted set: the ordered index the scheduler keeps its held and placed turns in.

`SortedSet` is immutable; `add` and `remove` return a new set that shares all but one root-to-leaf
path with the old one. It is a B-tree of fan-out at most `FANOUT`: leaves are sorted tuples of
keys, branches hold their children and each child's largest key, and every step down is a
`bisect` in C. An update copies one node per level (at most `FANOUT` pointers each) over
log_FANOUT(n) levels, so it is O(log n); the smallest key is found in as many steps.

Keys must be mutually comparable and totally ordered (the scheduler uses ints and tuples of
numbers and strings). Nodes are never merged when they shrink; a node left empty is dropped, and
a root with a single child gives way to it, so the depth stays bounded by the largest size the
set ever reached: two levels hold sixteen thousand keys, three two million.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

# Copying 128 pointers is cheap next to the interpreter's work per level, and the sets the
# scheduler keeps per group or per caller then stay a single leaf.
FANOUT = 128

# The keys' type: ordered (the scheduler's are ints and tuples of numbers and strings).
K = TypeVar("K", bound="SupportsRichComparison")


class _Branch:
    __slots__ = ("kids", "maxes")

    def __init__(self, maxes: tuple[Any, ...], kids: tuple[Any, ...]) -> None:
        self.maxes = maxes  # the largest key under each child, ascending
        self.kids = kids  # leaves (tuples) or branches


def _last(node: Any) -> Any:
    return node[-1] if type(node) is tuple else node.maxes[-1]


def _insert(node: Any, key: Any) -> tuple[Any, ...] | None:
    """The node(s) replacing `node` once `key` is in it (two when it split), or None if it was there."""
    if type(node) is tuple:
        i = bisect_left(node, key)
        if i < len(node) and node[i] == key:
            return None
        grown = (*node[:i], key, *node[i:])
        if len(grown) > FANOUT:
            half = len(grown) // 2
            return (grown[:half], grown[half:])
        return (grown,)
    maxes, kids = node.maxes, node.kids
    i = bisect_left(maxes, key)
    if i == len(maxes):
        i -= 1  # larger than everything: it goes at the end of the last child
    parts = _insert(kids[i], key)
    if parts is None:
        return None
    if len(parts) == 1:
        # The common case: one child changed in place; its largest key moves only at the end.
        kid = parts[0]
        top = kid[-1] if type(kid) is tuple else kid.maxes[-1]
        if top != maxes[i]:
            maxes = (*maxes[:i], top, *maxes[i + 1 :])
        return (_Branch(maxes, (*kids[:i], kid, *kids[i + 1 :])),)
    maxes = (*maxes[:i], _last(parts[0]), _last(parts[1]), *maxes[i + 1 :])
    kids = (*kids[:i], *parts, *kids[i + 1 :])
    if len(kids) > FANOUT:
        half = len(kids) // 2
        return (_Branch(maxes[:half], kids[:half]), _Branch(maxes[half:], kids[half:]))
    return (_Branch(maxes, kids),)


def _delete(node: Any, key: Any) -> Any:
    """`node` without `key`: the same object when the key was absent, () when nothing is left."""
    if type(node) is tuple:
        i = bisect_left(node, key)
        if i == len(node) or node[i] != key:
            return node
        return node[:i] + node[i + 1 :]
    maxes, kids = node.maxes, node.kids
    i = bisect_left(maxes, key)
    if i == len(maxes):
        return node
    kid = kids[i]
    smaller = _delete(kid, key)
    if smaller is kid:
        return node
    if smaller == ():
        if len(kids) == 1:
            return ()
        return _Branch(maxes[:i] + maxes[i + 1 :], kids[:i] + kids[i + 1 :])
    return _Branch((*maxes[:i], _last(smaller), *maxes[i + 1 :]), (*kids[:i], smaller, *kids[i + 1 :]))


def _walk(node: Any) -> Iterator[Any]:
    if type(node) is tuple:
        yield from node
    else:
        for kid in node.kids:
            yield from _walk(kid)


class SortedSet(Generic[K]):
    """An immutable set of keys of type `K` kept in ascending order.

    The nodes hold the keys untyped (a leaf is a tuple of them, a branch holds nodes); the
    methods are what types them."""

    __slots__ = ("_len", "_root")

    def __init__(self, keys: Iterable[K] = ()) -> None:
        root: Any = ()
        size = 0
        for key in sorted(set(keys)):
            parts = _insert(root, key)
            assert parts is not None
            root = parts[0] if len(parts) == 1 else _Branch(tuple(_last(p) for p in parts), parts)
            size += 1
        self._root = root
        self._len = size

    def add(self, key: K) -> SortedSet[K]:
        parts = _insert(self._root, key)
        if parts is None:
            return self
        s: SortedSet[K] = object.__new__(SortedSet)
        s._root = parts[0] if len(parts) == 1 else _Branch(tuple(_last(p) for p in parts), parts)
        s._len = self._len + 1
        return s

    def remove(self, key: K) -> SortedSet[K]:
        """The set without `key`; the same set when it is absent."""
        root = _delete(self._root, key)
        if root is self._root:
            return self
        while type(root) is _Branch and len(root.kids) == 1:
            root = root.kids[0]
        s: SortedSet[K] = object.__new__(SortedSet)
        s._root = root
        s._len = self._len - 1
        return s

    def replace(self, old: K, new: K) -> SortedSet[K]:
        """The set with `old` (which must be in it) swapped for `new` (which must not be)."""
        root = self._root
        if type(root) is tuple:
            # One leaf: rebuild it once rather than twice.
            keys = list(root)
            del keys[bisect_left(keys, old)]
            insort(keys, new)
            s: SortedSet[K] = object.__new__(SortedSet)
            s._root = tuple(keys)
            s._len = self._len
            return s
        return self.remove(old).add(new)

    def first(self) -> K:
        """The smallest key, or None when the set is empty. Typed `K`: the scheduler asks it only
        of a set it knows holds keys (an empty set is falsy), and an optional result would make
        every such call pay for a check that cannot fail."""
        node = self._root
        while type(node) is _Branch:
            node = node.kids[0]
        return node[0] if node else None  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        node = self._root
        while type(node) is _Branch:
            i = bisect_left(node.maxes, key)
            if i == len(node.maxes):
                return False
            node = node.kids[i]
        i = bisect_left(node, key)
        return i < len(node) and node[i] == key

    def __iter__(self) -> Iterator[K]:
        return _walk(self._root)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __eq__(self, other: object) -> bool:
        # By content: two sets built by different histories may differ in shape, never in keys.
        if not isinstance(other, SortedSet):
            return NotImplemented
        return self._len == other._len and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SortedSet({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (SortedSet, (list(self),))


# The empty set, of any key type: every index starts from it.
EMPTY: SortedSet[Any] = SortedSet()
