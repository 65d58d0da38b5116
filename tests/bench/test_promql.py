"""The PromQL subset `luftpause bench dashboard_plot` evaluates the Grafana dashboard's queries with
(bench/promql.py), on synthetic scrapes: rates across a counter restart, sums by label, `or`, a
filter, quantiles from histogram buckets as Prometheus computes them, and the metric names a query
selects (what tests/deploy/test_dashboard.py checks against a running stack)."""

from __future__ import annotations

import math

import pytest

from luftpause.bench import promql


def scrapes(*points: tuple[float, list[tuple[str, dict[str, str], float]]]) -> list[promql.Scrape]:
    out = []
    for t, samples in points:
        s = promql.Scrape(t)
        for name, labels, value in samples:
            s.add(name, labels, value)
        out.append(s)
    return out


def at_end(expr: str, data: list[promql.Scrape]) -> dict[str, float]:
    vector = promql.evaluate(promql.parse(expr), data, len(data) - 1)
    return {promql.legend("", k): v for k, v in vector.items()}


def test_rate_counts_a_counter_that_restarted_from_zero_and_sum_groups_by_label() -> None:
    c = "luftpause_runtime_tool_calls_total"
    data = scrapes(
        (0, [(c, {"outcome": "ok", "server": "a"}, 10), (c, {"outcome": "ok", "server": "b"}, 0)]),
        (10, [(c, {"outcome": "ok", "server": "a"}, 30), (c, {"outcome": "ok", "server": "b"}, 5)]),
        # server a restarted: 30 -> 0 -> 4 is 4 more, not -26
        (20, [(c, {"outcome": "ok", "server": "a"}, 4), (c, {"outcome": "ok", "server": "b"}, 15)]),
    )
    assert at_end(f"rate({c}[1m])", data) == {
        '{outcome="ok", server="a"}': pytest.approx(24 / 20),
        '{outcome="ok", server="b"}': pytest.approx(15 / 20),
    }
    assert at_end(f"sum by (outcome) (rate({c}[1m]))", data) == {'{outcome="ok"}': pytest.approx(39 / 20)}
    assert at_end(f"sum by (outcome) (increase({c}[15s]))", data) == {'{outcome="ok"}': pytest.approx(14)}
    # One sample in the window: no rate at all, as in Prometheus.
    assert at_end(f"rate({c}[5s])", data) == {}


def test_a_selector_keeps_the_name_or_matches_without_it_and_a_filter_drops_an_uncapped_limit() -> None:
    data = scrapes(
        (0, [
            ("sglang:num_queue_reqs", {"replica": "a"}, 2),
            ("vllm:num_requests_waiting", {"replica": "a"}, 9),
            ("vllm:num_requests_waiting", {"replica": "b"}, 3),
            ("luftpause_scheduler_admission_limit", {"replica": "a"}, 12),
            ("luftpause_scheduler_admission_limit", {"replica": "b"}, math.inf),
        ]),
    )  # fmt: skip
    assert at_end("sum by (replica) (sglang:num_queue_reqs or vllm:num_requests_waiting)", data) == {
        '{replica="a"}': 2,
        '{replica="b"}': 3,
    }
    assert at_end("luftpause_scheduler_admission_limit < Inf", data) == {
        'luftpause_scheduler_admission_limit{replica="a"}': 12
    }
    assert at_end('vllm:num_requests_waiting{replica=~"a|c"}', data) == {
        'vllm:num_requests_waiting{replica="a"}': 9
    }
    assert at_end('max without (replica) (vllm:num_requests_waiting{replica!="a"})', data) == {"{}": 3}


def test_histogram_quantile_interpolates_in_the_bucket_of_the_rank_as_prometheus_does() -> None:
    name = "luftpause_dataplane_engine_first_token_seconds_bucket"

    def buckets(t: float, counts: tuple[float, float, float], replica: str) -> list:
        return [
            (name, {"class": "interactive", "replica": replica, "le": le}, n)
            for le, n in zip(("0.1", "0.5", "+Inf"), counts, strict=True)
        ]

    data = scrapes(
        (0, buckets(0, (0, 0, 0), "a") + buckets(0, (0, 0, 0), "b")),
        (10, buckets(10, (5, 15, 20), "a") + buckets(10, (5, 15, 20), "b")),
    )
    query = "histogram_quantile({q}, sum by (class, le) (rate(" + name + "[1m])))"
    # 40 observations: 10 up to 0.1 s, 20 more up to 0.5 s, 10 above.
    assert at_end(query.format(q=0.5), data) == {'{class="interactive"}': pytest.approx(0.1 + 0.4 * 10 / 20)}
    assert at_end(query.format(q=0.25), data) == {'{class="interactive"}': pytest.approx(0.1)}
    # A rank in the +Inf bucket: the highest finite bound.
    assert at_end(query.format(q=0.95), data) == {'{class="interactive"}': pytest.approx(0.5)}
    # No observations in the window: no quantile, not 0.
    idle = scrapes((0, buckets(0, (5, 15, 20), "a")), (10, buckets(10, (5, 15, 20), "a")))
    assert at_end(query.format(q=0.5), idle) == {}


def test_metric_names_are_the_selectors_not_functions_labels_keywords_or_strings() -> None:
    query = (
        'histogram_quantile(0.95, sum by (class, le) (rate(x_seconds_bucket{class="rate", job=~"sum|by"}[5m])))'
        ' or max without (replica) (sglang:num_queue_reqs) or {__name__="y_total"} < Inf'
    )
    assert promql.metric_names(query) == {"x_seconds_bucket", "sglang:num_queue_reqs", "y_total"}
    for bad in ("label_replace(x, 'a', 'b', 'c', 'd')", "sum by (class (x)", "x[1m]1", "rate(x)"):
        with pytest.raises(promql.PromQLError):
            promql.metric_names(bad)
