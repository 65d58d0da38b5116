"""The persistent sorted set under the scheduler's indexes, against a plain Python set."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import ordered
from luftpause.scheduler.ordered import SortedSet

OPS = st.lists(
    st.tuples(st.sampled_from(("add", "remove", "replace")), st.integers(0, 200), st.integers(0, 200)),
    max_size=300,
)


@pytest.fixture(autouse=True)
def small_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Four keys a node: a few hundred keys then make a tree three and four levels deep.
    monkeypatch.setattr(ordered, "FANOUT", 4)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(OPS)
def test_the_set_agrees_with_a_python_set_and_old_versions_never_change(ops):
    s, ref = SortedSet(), set()
    history: list[tuple[SortedSet, list[int]]] = []
    for op, a, b in ops:
        if op == "add":
            s, _ = s.add(a), ref.add(a)
        elif op == "remove":
            s, _ = s.remove(a), ref.discard(a)
        elif ref and b not in ref:
            old = min(ref, key=lambda k: abs(k - a))
            s = s.replace(old, b)
            ref.discard(old)
            ref.add(b)
        history.append((s, sorted(ref)))
        assert list(s) == sorted(ref)
        assert len(s) == len(ref) and bool(s) == bool(ref)
        assert s.first() == (min(ref) if ref else None)
        assert all((k in s) == (k in ref) for k in (a, b, -1, 201))
    for version, keys in history:
        assert list(version) == keys, "an update changed an older version"
    assert pickle.loads(pickle.dumps(s)) == s == SortedSet(ref)


def test_tuples_order_as_the_scheduler_uses_them():
    s = SortedSet([(1, 7, "bob"), (0, 9, "carol"), (1, 3, "alice")])
    assert s.first() == (0, 9, "carol")
    s = s.replace((0, 9, "carol"), (2, 9, "carol"))
    assert list(s) == [(1, 3, "alice"), (1, 7, "bob"), (2, 9, "carol")]
    assert s.remove((5, 5, "nobody")) is s
    assert s.add((1, 3, "alice")) is s
