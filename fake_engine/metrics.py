"""The fake engine's /metrics: its load under SGLang's metric names, read from the model at scrape time.

The scheduler's prober reads these exactly as it reads a real SGLang server's, so the names,
the `model_name` label and the gauge types follow SGLang. Each app gets its own registry so that
several engines can live in one process (as they do in tests).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from luftpause.fake_engine.model import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """Reads `Engine.load()` whenever Prometheus (or the prober) scrapes."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterable[Metric]:
        load = self._engine.load()
        gauges = (
            ("sglang:num_running_reqs", "The number of running requests.", load.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", load.waiting),
            ("sglang:token_usage", "The token usage, a fraction of the KV pool.", load.token_usage),
            (
                "sglang:cache_hit_rate",
                "The prefix cache hit rate (no cache is modelled yet).",
                load.cache_hit_rate,
            ),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        counters = (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", load.prompt_tokens_total),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                load.generation_tokens_total,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self._model], value)
            yield counter


def metrics_registry(engine: Engine, model: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
