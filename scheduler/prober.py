"""The prober: reads each replica's health and engine load, and reports them as `ReplicaProbed` events.

Every probe period (2 s by default) each replica's `health_path` is fetched, and, for engines
that report load, its Prometheus `/metrics`; each fetch gives up after the probe period too, so
a slow replica cannot stall the next round. A health answer other than 2xx, or none, makes the
replica unhealthy. Load is the engine's own count of requests it runs and requests it queues,
summed over label sets (one engine may report per data-parallel rank or per model). A router
(`load_from` set) is probed for health only.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

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


def _headers(replica: config.Replica) -> dict[str, str]:
    key = replica.api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


async def probe(
    client: httpx.AsyncClient, replica: config.Replica, timeout_s: float, clock: Callable[[], float]
) -> ReplicaProbed:
    """One probe of one replica; never raises for anything the replica does."""
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
    if healthy and replica.metrics != "none" and not replica.load_from:
        sent_at = clock()
        try:
            answer = await client.get(base + "/metrics", headers=headers, timeout=timeout_s)
            if answer.status_code == 200:
                load = parse_load(answer.text, replica.metrics)
        except httpx.HTTPError:
            load = None
        if load is None:
            log.debug("replica %s: no load in its /metrics (%s names)", replica.name, replica.metrics)
    running, waiting = load if load is not None else (None, None)
    # When the load was asked for: a turn placed after that cannot be in the reading.
    return ReplicaProbed(
        replica.name, healthy, running, waiting, clock(), sent_at if load is not None else None
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
    try:
        while True:
            started = clock()
            results = await asyncio.gather(*(probe(client, r, period_s, clock) for r in replicas))
            for result in results:
                emit(result)
            await asyncio.sleep(max(0.0, started + period_s - clock()))
    finally:
        if own_client:
            await client.aclose()
