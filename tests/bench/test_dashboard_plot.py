"""`luftpause bench dashboard_plot`'s pieces on synthetic scrapes: every query of the dashboard
evaluates (bench/promql.py's subset, tested in test_promql.py), a record survives its JSON, is
drawn as the dashboard's panels, and a scrape gets the labels Prometheus adds. The flood itself is
the benchmark's, not a test's."""

from __future__ import annotations

from pathlib import Path

from test_promql import scrapes

from luftpause.bench import promql
from luftpause.bench.dashboard_plot import (
    Target,
    draw,
    exposition_into,
    panels,
    read_record,
    scrapes_of,
    series_of,
    write_record,
)


def test_every_dashboard_query_is_in_the_subset_and_draws_on_a_synthetic_scrape(tmp_path: Path) -> None:
    dashboard = panels()
    names = {n for p in dashboard for q in p.queries for n in promql.metric_names(q.expr)}
    data = scrapes(
        *(
            (float(t), [(n, {"class": "batch", "replica": "a", "le": "+Inf"}, t) for n in names])
            for t in range(5)
        )
    )
    record = {"flood": {"batch": 1, "interactive": 1, "sub_agents": 1, "interactive_wave_s": [1, 2]}}
    record |= {"times": [s.t for s in data], "series": series_of(data, names)}
    write_record(tmp_path / "r.json", record)
    again = read_record(tmp_path / "r.json")
    assert [s.by_name for s in scrapes_of(again)] == [s.by_name for s in data]
    png = draw(again, tmp_path / "r.png", dashboard)
    assert png is not None and png.stat().st_size > 10_000


def test_a_scrape_gets_the_labels_prometheus_adds_and_renames_a_clash() -> None:
    text = '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m",replica="x"} 3.0\n'
    scrape = promql.Scrape(0)
    exposition_into(scrape, text, Target("engines", "fake-a:9001", (("replica", "fake-a"),), False))
    assert scrape.by_name["sglang:num_queue_reqs"] == {
        frozenset({
            ("model_name", "m"), ("exported_replica", "x"), ("replica", "fake-a"),
            ("job", "engines"), ("instance", "fake-a:9001"),
        }): 3.0
    }  # fmt: skip
    assert promql.legend(
        "waiting {{replica}} {{nope}}", next(iter(scrape.by_name["sglang:num_queue_reqs"]))
    ) == ("waiting fake-a")
