"""The fan-out benchmark's report: a repeat whose engines generated nothing still prints, and its
ratios are taken within each repeat, the arms side by side."""

from __future__ import annotations

from luftpause.bench.fanout import _share, started_ratios


def test_a_share_of_no_tokens_prints_as_a_dash_not_a_crash():
    assert _share(None) == "-"
    assert _share(0.5625) == "56%"


def _row(repeat: int, arm: str, seconds: float, counts: bool = True) -> dict:
    return {"repeat": repeat, "arm": arm, "seconds": seconds, "counts": counts}


def test_the_ratios_are_taken_within_each_repeat_then_their_median():
    # The times of bench/results/fanout-start-20261202T013153Z.json: luftpause against the router
    # per repeat 1.009, 0.999 and 1.080 (median 1.009), where the medians' ratio would say 1.077.
    rows = [
        _row(0, "sequential", 125.822), _row(0, "luftpause", 14.715), _row(0, "router", 14.584),
        _row(1, "luftpause", 13.406), _row(1, "router", 13.426), _row(1, "sequential", 125.779),
        _row(2, "router", 13.394), _row(2, "sequential", 125.698), _row(2, "luftpause", 14.465),
    ]  # fmt: skip
    ratios = started_ratios(rows)
    assert ratios["luftpause_over_router_time"] == 1.009
    assert (
        ratios["luftpause_over_router_time_spread"]["low"],
        ratios["luftpause_over_router_time_spread"]["high"],
    ) == (0.999, 1.08)
    assert ratios["speedup_over_sequential"] == 8.69 and ratios["speedup_met"]
    # A repeat where one arm does not count gives no ratio of that pair.
    rows[2] = _row(0, "router", 14.584, counts=False)
    assert started_ratios(rows)["luftpause_over_router_time_spread"]["n"] == 2
