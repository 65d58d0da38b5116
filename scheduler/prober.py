"""The prober: reads each replica's health, load and KV capacity, and reports them as `ReplicaProbed` events.

Every probe period (2 s by default) each replica's `health_path` is fetched, and, for engines
that report load, its Prometheus `/metrics`; each fetch gives up after the probe period too, so
a slow replica cannot stall the next round. A health answer other than 2xx, or none, makes the
replica unhealthy. Load is the engine's own count of requests it runs and requests it queues,
summed over label sets (one engine may report per data-parallel rank or per model). A router
(`load_from` set) is probed for health only.

The engine's KV capacity in tokens (what the run gate fits runs into, `gate.py`) is read where
the engine says it: vLLM's `vllm:cache_config_info` gauge on the same /metrics page, at every
probe; SGLang's `GET /get_server_info` and llama.cpp's `GET /slots` (or `/props`), which cost a
request of their own, on the first healthy probe, on the first after the replica was unhealthy,
and every `KV_READ_PERIOD_S` otherwise (`KvReadTimer`). A replica whose config sets `kv_tokens`
is not asked: the config wins. An answer that does not say it gives no reading (None), never an
error: the last reading stands.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import httpx

from luftpause import config
from luftpause.scheduler.events import ReplicaProbed

log = logging.getLogger("luftpause.scheduler.prober")

# (running, waiting) metric names per engine family, as the config's `metrics` field names them.
LOAD_METRICS: dict[str, tuple[str, str]] = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


def parse_load(text: str, metrics: str) -> tuple[int, int] | None:
    """(running, waiting) from a Prometheus text page, or None when either metric is absent.

    Lines that do not parse are skipped rather than failing the page: one odd metric from an
    engine upgrade should not blind the scheduler to the two it needs.
    """
    names = LOAD_METRICS.get(metrics)
    if names is None:
        return None
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        name = name.strip()
        if name not in names:
            continue
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
    running, waiting = names
    if running not in totals or waiting not in totals:
        return None
    return round(totals[running]), round(totals[waiting])


# How often a replica's KV capacity is read where that costs a request of its own. It changes only
# when the engine restarts, which a probe mostly sees as the replica going unhealthy and coming
# back (read again at once); the period catches a restart too quick for the probes to see it down.
KV_READ_PERIOD_S = 30.0

# vLLM's info gauge for its cache config: labels only, the value is always 1.
VLLM_CACHE_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _positive_int(value: Any) -> int | None:
    """A JSON number that is a whole count above zero (true and false are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def parse_vllm_kv_tokens(text: str) -> int | None:
    """vLLM's KV capacity from its /metrics page: num_gpu_blocks times block_size, summed over label
    sets (one per engine core under data parallelism, each with its own pool); None when absent.

    A label that is not a number (vLLM writes "None" for a value not set) gives no reading.
    """
    total = 0
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith(VLLM_CACHE_INFO + "{"):
            continue
        labels = dict(_LABEL.findall(line[len(VLLM_CACHE_INFO) + 1 : line.rfind("}")]))
        try:
            blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if blocks > 0 and block_size > 0:
            total += blocks * block_size
    return total or None


def sglang_kv_tokens(info: Any) -> int | None:
    """SGLang's KV capacity from its /get_server_info document: `max_total_num_tokens`.

    Newer SGLang puts it in `internal_states`, one per data-parallel rank, each rank with its own
    pool: those are summed. Older SGLang has it at the top level only.
    """
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list):
        ranks = [_positive_int(s.get("max_total_num_tokens")) for s in states if isinstance(s, dict)]
        if ranks and all(r is not None for r in ranks):
            return sum(r for r in ranks if r is not None)
    return _positive_int(info.get("max_total_num_tokens"))


def llamacpp_slots_kv_tokens(slots: Any) -> int | None:
    """llama.cpp's KV capacity from its /slots list: the sum of the slots' `n_ctx`.

    Each slot then has its own share of the server's context. A server with a unified KV cache
    (`--kv-unified`, which llama-server also turns on by itself when it picks the slot count)
    gives every slot the whole context instead, shared, and this sum is then that many times too
    much: such a replica should set `kv_tokens` in the config.
    """
    if not isinstance(slots, list) or not slots:
        return None
    sizes = [_positive_int(s.get("n_ctx")) if isinstance(s, dict) else None for s in slots]
    if any(size is None for size in sizes):
        return None
    return sum(size for size in sizes if size is not None)


def llamacpp_props_kv_tokens(props: Any) -> int | None:
    """llama.cpp's KV capacity from /props, for a server started without the /slots endpoint:
    `total_slots` times the per-slot `default_generation_settings.n_ctx` (as /slots would sum)."""
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    slots = _positive_int(props.get("total_slots"))
    n_ctx = _positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return slots * n_ctx if slots is not None and n_ctx is not None else None


def reads_kv_apart(replica: config.Replica) -> bool:
    """Whether the replica's KV capacity costs a request of its own (SGLang, llama.cpp) rather than
    coming with its /metrics (vLLM) or not being read at all (no metrics, a router, or set in the
    config)."""
    return replica.metrics in ("sglang", "llamacpp") and not replica.load_from and replica.kv_tokens is None


class KvReadTimer:
    """Says at which probes a replica's KV capacity is read (`reads_kv_apart` ones only): its first
    healthy probe, its first healthy one after an unhealthy one, and every `period_s` between."""

    def __init__(self, period_s: float = KV_READ_PERIOD_S) -> None:
        self.period_s = period_s
        self._read_at: dict[str, float] = {}
        self._healthy: set[str] = set()

    def due(self, name: str, now: float) -> bool:
        if name not in self._healthy:
            return True
        return now - self._read_at.get(name, -math.inf) >= self.period_s

    def probed(self, name: str, healthy: bool, now: float, read: bool) -> None:
        """After a probe asked with `read` = `due(...)`: a healthy replica was read then."""
        if healthy:
            if read:
                self._read_at[name] = now
            self._healthy.add(name)
        else:
            self._healthy.discard(name)


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float) -> Any:
    """The JSON a GET answers with 200; None for any other answer, none, or one that is not JSON."""
    try:
        answer = await client.get(url, headers=headers, timeout=timeout_s)
        return answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def read_kv_tokens(
    client: httpx.AsyncClient, replica: config.Replica, headers: dict[str, str], timeout_s: float
) -> int | None:
    """The KV capacity an SGLang or llama.cpp replica states, by a request of its own; None when
    it does not say (an older engine, an endpoint turned off, an answer of another shape)."""
    base = replica.url.rstrip("/")
    kv: int | None = None
    if replica.metrics == "sglang":
        kv = sglang_kv_tokens(await _get_json(client, base + "/get_server_info", headers, timeout_s))
    elif replica.metrics == "llamacpp":
        # /slots answers 501 on a server started with --no-slots; /props says as much, per slot.
        kv = llamacpp_slots_kv_tokens(await _get_json(client, base + "/slots", headers, timeout_s))
        if kv is None:
            kv = llamacpp_props_kv_tokens(await _get_json(client, base + "/props", headers, timeout_s))
    if kv is None:
        log.debug("replica %s: no KV capacity in its answer (%s)", replica.name, replica.metrics)
    return kv


def _headers(replica: config.Replica) -> dict[str, str]:
    key = replica.api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


async def probe(
    client: httpx.AsyncClient,
    replica: config.Replica,
    timeout_s: float,
    clock: Callable[[], float],
    read_kv: bool = False,
) -> ReplicaProbed:
    """One probe of one replica; never raises for anything the replica does.

    `read_kv`: also ask a healthy SGLang or llama.cpp replica for its KV capacity (a vLLM one
    says it on every /metrics page anyway).
    """
    base = replica.url.rstrip("/")
    headers = _headers(replica)
    try:
        health = await client.get(base + replica.health_path, headers=headers, timeout=timeout_s)
        healthy = 200 <= health.status_code < 300
    except httpx.HTTPError:
        healthy = False
    load: tuple[int, int] | None = None
    # A router's own /metrics says nothing about its engines' queues; the core sums the load of
    # the replicas it names in `load_from` instead.
    sent_at: float | None = None
    kv: int | None = None
    if healthy and replica.metrics != "none" and not replica.load_from:
        sent_at = clock()
        try:
            answer = await client.get(base + "/metrics", headers=headers, timeout=timeout_s)
            if answer.status_code == 200:
                load = parse_load(answer.text, replica.metrics)
                if replica.metrics == "vllm" and replica.kv_tokens is None:
                    kv = parse_vllm_kv_tokens(answer.text)
        except httpx.HTTPError:
            load = None
        if load is None:
            log.debug("replica %s: no load in its /metrics (%s names)", replica.name, replica.metrics)
    if healthy and read_kv and reads_kv_apart(replica):
        kv = await read_kv_tokens(client, replica, headers, timeout_s)
    running, waiting = load if load is not None else (None, None)
    # When the load was asked for: a turn placed after that cannot be in the reading.
    return ReplicaProbed(
        replica.name, healthy, running, waiting, clock(), sent_at if load is not None else None, kv
    )


async def run_prober(
    replicas: list[config.Replica],
    period_s: float,
    emit: Callable[[ReplicaProbed], object],
    clock: Callable[[], float],
    client: httpx.AsyncClient | None = None,
) -> None:
    """Probes every replica every `period_s` until cancelled; the first round starts at once."""
    own_client = client is None
    client = client or httpx.AsyncClient()
    kv_reads = KvReadTimer()
    try:
        while True:
            started = clock()
            due = [kv_reads.due(r.name, started) for r in replicas]
            results = await asyncio.gather(
                *(probe(client, r, period_s, clock, read) for r, read in zip(replicas, due, strict=True))
            )
            for replica, read, result in zip(replicas, due, results, strict=True):
                kv_reads.probed(replica.name, result.healthy, started, read)
                emit(result)
            await asyncio.sleep(max(0.0, started + period_s - clock()))
    finally:
        if own_client:
            await client.aclose()
