"""The flood watch's arithmetic: quantiles from histogram buckets, the window's growth of a
/metrics text, and the summary of /status samples; nothing is started and nothing waits."""

from __future__ import annotations

import math

import pytest

from luftpause.bench.sim.flood_watch import (
    FIRST_TOKEN,
    HELD,
    histograms,
    markdown,
    quantile,
    sample,
    summarise_samples,
    window_buckets,
    window_quantiles,
)
from luftpause.dataplane.metrics import DataplaneMetrics

INF = math.inf
# 10 observations up to 0.1 s, 20 more up to 0.5 s, 10 more up to 1 s, none beyond.
BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


def test_quantiles_interpolate_inside_the_bucket_the_rank_falls_in() -> None:
    # p50: rank 20 is the 10th of the 20 in (0.1, 0.5]: 0.1 + 0.4 * 10/20.
    assert quantile(0.5, BUCKETS) == pytest.approx(0.3)
    # p99: rank 39.6 is the 9.6th of the 10 in (0.5, 1]: 0.5 + 0.5 * 9.6/10.
    assert quantile(0.99, BUCKETS) == pytest.approx(0.98)
    # In the first bucket the lower bound is 0: rank 5 of 10 in (0, 0.1].
    assert quantile(0.125, BUCKETS) == pytest.approx(0.05)


def test_a_rank_past_the_top_bucket_answers_the_top_bound_and_nothing_observed_answers_none() -> None:
    assert quantile(0.99, [(0.1, 10.0), (1.0, 90.0), (INF, 100.0)]) == 1.0
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    with pytest.raises(ValueError):
        quantile(0.5, [(0.1, 1.0)])


def test_the_window_counts_only_what_grew_between_the_readings() -> None:
    start = [(0.1, 100.0), (0.5, 100.0), (1.0, 100.0), (INF, 100.0)]
    end = [(0.1, 110.0), (0.5, 130.0), (1.0, 140.0), (INF, 140.0)]
    assert window_buckets(start, end) == BUCKETS
    assert window_buckets(None, BUCKETS) == BUCKETS


def test_quantiles_over_a_window_from_the_dataplanes_own_metrics_text() -> None:
    # Two replicas: each class's quantiles are over both.
    metrics = DataplaneMetrics(("fake-a", "fake-b"))
    # Before the window: slow interactive turns that must not count.
    for _ in range(50):
        metrics.admitted("interactive", "fake-a", 30.0)
    start = histograms(metrics.render().decode())
    for i, seconds in enumerate((0.002,) * 99 + (2.0,)):
        replica = ("fake-a", "fake-b")[i % 2]
        metrics.admitted("interactive", replica, seconds)
        metrics.first_token("interactive", replica, 0.2)
    for _ in range(4):
        metrics.admitted("batch", "fake-b", 100.0)  # within the held histogram, whose top is 600 s
        metrics.first_token("batch", "fake-b", 90.0)  # past the first-token histogram's top bucket (60 s)
    end = histograms(metrics.render().decode())
    assert set(end) == {HELD, FIRST_TOKEN}

    q = window_quantiles(start, end)
    held = q["interactive"]["held"]
    assert held["count"] == 100
    # Rank 50 of 99 in (0.001, 0.005]: 0.001 + 0.004 * 50/99.
    assert held["p50_s"] == pytest.approx(0.001 + 0.004 * 50 / 99, abs=1e-4)
    # Rank 99 is the 99th of those 99: the bucket's top.
    assert held["p99_s"] == pytest.approx(0.005)
    first = q["interactive"]["engine_first_token"]
    # All 100 in (0.1, 0.25]: p50 at rank 50 is 0.1 + 0.15 * 50/100.
    assert first["count"] == 100 and first["p50_s"] == pytest.approx(0.175)
    batch_first = q["batch"]["engine_first_token"]
    assert batch_first["beyond_top_bucket"] == 4 and batch_first["p99_s"] == 60.0
    assert q["batch"]["held"]["p50_s"] == pytest.approx(60.0 + 60.0 * 2 / 4)

    lines = "\n".join(markdown("repeat 1", {"status": summarise_samples([]) | _reads(), "quantiles": q}))
    assert "| interactive | 100 | 0.003 s | 0.005 s | 0.175 s |" in lines
    assert ">= 60 s" in lines, "a quantile past the top bucket is shown as a lower bound"


def _reads() -> dict:
    return {"failed_reads": 0, "period_s": 2.0}


def _doc(replicas: list[dict], held_interactive: int, oldest: float | None) -> dict:
    return {
        "replicas": replicas,
        "held": {
            "count": held_interactive,
            "by_class": {
                "interactive": {"count": held_interactive, "oldest_wait_s": oldest},
                "batch": {"count": 0, "oldest_wait_s": None},
            },
        },
        "runs": {},
    }


def _replica(
    name: str, in_flight: int, limit: int | None, ours: int, others: int, waiting: int | None
) -> dict:
    return {
        "name": name,
        "in_flight": in_flight,
        "limit": limit,
        "lookahead": 2,
        "waiting_ours": ours,
        "others_waiting": others,
        "running": in_flight - ours,
        "waiting": waiting,
        "paused_interactive": 0,
    }


def test_the_status_summary_takes_max_and_median_per_replica_and_the_most_held() -> None:
    samples = [
        sample(_doc([_replica("a", 4, 6, 1, 0, None), _replica("b", 2, None, 0, 0, 0)], 0, None), 0.0),
        sample(_doc([_replica("a", 6, 8, 2, 1, 3), _replica("b", 3, None, 1, 0, 1)], 2, 0.4), 2.0),
        sample(_doc([_replica("a", 5, 7, 0, 3, 1), _replica("b", 4, None, 0, 0, 2)], 1, 0.1), 4.0),
    ]
    summary = summarise_samples(samples)
    assert summary["samples"] == 3
    a, b = summary["replicas"]["a"], summary["replicas"]["b"]
    assert a["in_flight"] == {"max": 6, "median": 5, "samples": 3}
    assert a["limit"] == {"max": 8, "median": 7, "samples": 3}
    assert a["waiting_ours"] == {"max": 2, "median": 1, "samples": 3}
    assert a["others_waiting"] == {"max": 3, "median": 1, "samples": 3}
    # The engine's queue was unknown at the first sample: the figures rest on the other two.
    assert a["waiting"] == {"max": 3, "median": 2.0, "samples": 2}
    # An uncapped replica has no limit to summarise.
    assert b["limit"] == {"max": None, "median": None, "samples": 0}
    assert summary["held"] == {
        "interactive": {"max_count": 2, "max_oldest_wait_s": 0.4},
        "batch": {"max_count": 0, "max_oldest_wait_s": None},
    }

    lines = "\n".join(markdown("repeat 2", {"status": summary | _reads(), "quantiles": {}}))
    assert "Under the flood (luftpause arm), repeat 2" in lines
    assert "| a | 6 / 5 | 8 / 7 | 2 / 1 | 3 / 1 | 3 / 2 |" in lines
    assert "| b | 4 / 3 | - | 1 / 0 | 0 / 0 | 2 / 1 |" in lines
    assert "interactive 2 (longest wait seen 0.4 s)" in lines
