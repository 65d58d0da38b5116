"""The fan-out benchmark's per-repeat line: a repeat whose engines generated nothing still prints."""

from __future__ import annotations

from luftpause.bench.fanout import _share


def test_a_share_of_no_tokens_prints_as_a_dash_not_a_crash():
    assert _share(None) == "-"
    assert _share(0.5625) == "56%"
