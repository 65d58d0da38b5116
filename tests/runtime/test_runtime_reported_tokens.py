"""A reply's usage as the runtime's run counters and token budgets take it (runtime/budgets.py):
only counts an engine could have spent; nonsense counts as nothing, never as a refund."""

from __future__ import annotations

import pytest

from luftpause.counts import MAX_TOKEN_COUNT
from luftpause.runtime.budgets import reported_tokens


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 12, "completion_tokens": 3}, (12, 3)),
        ({"prompt_tokens": -5, "completion_tokens": -5}, (0, 0)),
        ({"prompt_tokens": 10**30, "completion_tokens": 1e30}, (0, 0)),
        ({"prompt_tokens": float("nan"), "completion_tokens": float("inf")}, (0, 0)),
        ({"prompt_tokens": "7", "completion_tokens": True}, (0, 0)),
        ({"prompt_tokens": MAX_TOKEN_COUNT, "completion_tokens": MAX_TOKEN_COUNT + 1}, (MAX_TOKEN_COUNT, 0)),
        ({}, (0, 0)),
        (None, (0, 0)),
        ("usage", (0, 0)),
    ],
)
def test_a_replys_usage_counts_only_what_an_engine_could_have_spent(usage: object, expected: tuple[int, int]):
    assert reported_tokens(usage) == expected
