"""The fake engine's /metrics: the model's load under SGLang's or vLLM's names, read at scrape time.

The scheduler's prober reads these exactly as it reads a real engine's, so the names, the
`model_name` label and the metric types follow the engine being imitated, chosen per instance:

- sglang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
  `sglang:cache_hit_rate` (gauges), `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`;
- vllm: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (gauges), `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
  `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, and the info gauge
  `vllm:cache_config_info`, whose `num_gpu_blocks` times `block_size` is the KV pool's size and
  whose `kv_offloading_size` says its host tier in GiB ("None" without one).

(SGLang states its pool's size and whether it keeps a host tier, `enable_hierarchical_cache`,
in `GET /get_server_info` instead: `server.py`.)

Each app gets its own registry so that several engines can live in one process (as in tests).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from luftpause.fake_engine.realtime import RealtimeEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FLAVOURS = ("sglang", "vllm")
# vLLM's default KV block: the pool is stated in blocks of this many tokens.
VLLM_BLOCK_SIZE = 16
# KV bytes a token, to state a host tier of `host_cache_tokens` in GiB as vLLM does: Llama-3.2-1B's
# 32 KiB in BF16, the model the engine's calibration stands for (params.py).
VLLM_KV_BYTES_PER_TOKEN = 32 * 1024


class EngineCollector:
    """Reads the engine's load whenever Prometheus (or the prober) scrapes."""

    def __init__(self, engine: RealtimeEngine, model: str, flavour: str) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"metrics flavour must be one of {', '.join(FLAVOURS)}, got '{flavour}'")
        self._engine = engine
        self._model = model
        self._flavour = flavour

    def collect(self) -> Iterable[Metric]:
        load = self._engine.load()
        if self._flavour == "sglang":
            gauges: tuple[tuple[str, str, float], ...] = (
                ("sglang:num_running_reqs", "The number of running requests.", load.running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", load.waiting),
                ("sglang:token_usage", "The token usage, a fraction of the KV pool.", load.token_usage),
                ("sglang:cache_hit_rate", "The prefix cache hit rate.", load.cache_hit_rate),
            )
            counters: tuple[tuple[str, str, float], ...] = (
                ("sglang:prompt_tokens", "Number of prefill tokens processed.", load.prompt_tokens_total),
                (
                    "sglang:generation_tokens",
                    "Number of generation tokens processed.",
                    load.generation_tokens_total,
                ),
            )
        else:
            gauges = (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", load.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", load.token_usage),
            )
            counters = (
                (
                    "vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    load.prefix_queries_total,
                ),
                (
                    "vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    load.prefix_hits_total,
                ),
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", load.prompt_tokens_total),
                (
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    load.generation_tokens_total,
                ),
            )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self._model], value)
            yield counter
        if self._flavour == "vllm":
            yield self._vllm_cache_config()

    def _vllm_cache_config(self) -> Metric:
        """vLLM's cache config as it states it: an info gauge of value 1 whose labels say it (the
        pool rounded down to whole blocks, as vLLM allocates it)."""
        labels = {
            "block_size": str(VLLM_BLOCK_SIZE),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(self._engine.params.kv_pool_tokens // VLLM_BLOCK_SIZE),
            "kv_offloading_size": _gib(self._engine.params.host_cache_tokens * VLLM_KV_BYTES_PER_TOKEN),
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
        )
        info.add_metric(list(labels.values()), 1.0)
        return info


def _gib(size_bytes: int) -> str:
    """A size as vLLM's config writes it, in GiB: "None" for none."""
    return str(size_bytes / 2**30) if size_bytes > 0 else "None"


def metrics_registry(engine: RealtimeEngine, model: str, flavour: str = "sglang") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model, flavour))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
