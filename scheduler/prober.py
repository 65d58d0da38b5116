"""The prober: reads each replica's health, load and KV capacity, and reports them as `ReplicaProbed` events.

Every probe period (2 s by default) each replica's `health_path` is fetched, and, for engines
that report load, its Prometheus `/metrics`; each fetch gives up after the probe period too, so
a slow replica cannot stall the next round. A health answer other than 2xx, or none, makes the
replica unhealthy. Load is the engine's own count of requests it runs and requests it queues,
summed over label sets (one engine may report per data-parallel rank or per model). A router
(`load_from` set) is probed for health only.

The same /metrics page gives the engine's prompt-cache counters where it has them
(`CACHE_METRICS`): the prompt tokens it took since it started and, of those, the ones it reused
from its prefix cache. The scheduler only shows them (/status, its /metrics); no decision reads
them.

The engine's KV capacity in tokens (what the run gate fits runs into, `gate.py`) is read where
the engine says it: vLLM's `vllm:cache_config_info` gauge on the same /metrics page, at every
probe; SGLang's `GET /get_server_info` and llama.cpp's `GET /slots` (or `/props`), which cost a
request of their own, on the first healthy probe, on the first after the replica was unhealthy,
and every `KV_READ_PERIOD_S` otherwise (`KvReadTimer`). The same llama.cpp answers give its
slots, one a request it keeps KV for (the length of the /slots list, or /props' `total_slots`
where /slots is off). A replica whose config sets `kv_tokens`, or `kv_slots`, is not asked for
that one: the config wins (`reads_kv_tokens`, `reads_kv_slots`). An answer that does not say it
gives no reading (None), never an error: the last reading stands.

Whether the engine keeps prefixes evicted from its KV in host memory (a host tier: the gate then
holds no runs there, gate.py) is read from the same answers where the engine says it: SGLang's
/get_server_info carries its server arguments, `enable_hierarchical_cache` (HiCache) among them;
vLLM's cache config gauge has a `kv_offloading_size` label, "None" unless its native CPU offload
or LMCache backend is on (`--kv-offloading-size`). A replica whose config sets `host_cache` is
not asked (`reads_host_cache`). llama.cpp says nothing of its `--cache-ram`, and an offload that
vLLM is given through `--kv-transfer-config` alone is not in its cache config: for those, the
config's `host_cache` is the only word.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

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


def _totals(text: str, names: Collection[str]) -> dict[str, float]:
    """Each of `names` that the Prometheus text page has, summed over its label sets.

    Lines that do not parse are skipped rather than failing the page: one odd metric from an
    engine upgrade should not blind the scheduler to the ones it needs. A counter the page
    declares (`# TYPE name counter`) without a sample counts as 0: a labelled counter has no
    sample until it is first counted (SGLang's cached tokens before the first cache hit).
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            fields = line.split()
            if len(fields) == 4 and fields[1] == "TYPE" and fields[3] == "counter" and fields[2] in names:
                totals.setdefault(fields[2], 0.0)
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
    return totals


def parse_load(text: str, metrics: str) -> tuple[int, int] | None:
    """(running, waiting) from a Prometheus text page, or None when either metric is absent."""
    names = LOAD_METRICS.get(metrics)
    if names is None:
        return None
    totals = _totals(text, names)
    running, waiting = names
    if running not in totals or waiting not in totals:
        return None
    return round(totals[running]), round(totals[waiting])


# The engine's prompt-cache counters, cumulative since it started, per engine family: (a counter of
# prompt tokens, the counter of those taken from its prefix cache, whether the first counts the
# cached ones too). llama.cpp counts the tokens it computed and the ones it reused apart
# (server-task.cpp: "Number of prompt tokens processed, excluding cached tokens"); SGLang's
# prompt tokens are whole prompts and its cached ones are summed over `cache_source` (device,
# host, storage); vLLM counts the tokens its prefix cache was asked for and found.
CACHE_METRICS: dict[str, tuple[str, str, bool]] = {
    "llamacpp": ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", False),
    "sglang": ("sglang:prompt_tokens_total", "sglang:cached_tokens_total", True),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", True),
}


def parse_prompt_cache(text: str, metrics: str) -> tuple[int, int] | None:
    """(prompt tokens, of those cached) since the engine started, from its Prometheus text page:
    every prompt token it took, cached ones included, and those it reused from its prefix cache
    instead of computing them. None when the page lacks either counter."""
    names = CACHE_METRICS.get(metrics)
    if names is None:
        return None
    prompt_name, cached_name, includes_cached = names
    totals = _totals(text, (prompt_name, cached_name))
    if prompt_name not in totals or cached_name not in totals:
        return None
    prompt, cached = round(totals[prompt_name]), round(totals[cached_name])
    return (prompt if includes_cached else prompt + cached), cached


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


def _vllm_cache_configs(text: str) -> list[dict[str, str]]:
    """The labels of each `vllm:cache_config_info` sample on a /metrics page: one label set per
    engine core (several under data parallelism)."""
    configs = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(VLLM_CACHE_INFO + "{"):
            configs.append(dict(_LABEL.findall(line[len(VLLM_CACHE_INFO) + 1 : line.rfind("}")])))
    return configs


def parse_vllm_kv_tokens(text: str) -> int | None:
    """vLLM's KV capacity from its /metrics page: num_gpu_blocks times block_size, summed over label
    sets (one per engine core under data parallelism, each with its own pool); None when absent.

    A label that is not a number (vLLM writes "None" for a value not set) gives no reading.
    """
    total = 0
    for labels in _vllm_cache_configs(text):
        try:
            blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if blocks > 0 and block_size > 0:
            total += blocks * block_size
    return total or None


def parse_vllm_host_cache(text: str) -> bool | None:
    """Whether vLLM offloads its KV to host memory, from its /metrics page: the cache config
    gauge's `kv_offloading_size` label, which says "None" while offloading is off and the buffer's
    size in GiB when it is on; None where no label says it (a vLLM older than the option)."""
    sizes = [c["kv_offloading_size"] for c in _vllm_cache_configs(text) if "kv_offloading_size" in c]
    return any(_gib(size) > 0 for size in sizes) if sizes else None


def _gib(size: str) -> float:
    """A size vLLM's config writes in GiB; 0 for "None" (not set) or anything not a number."""
    try:
        return float(size)
    except ValueError:
        return 0.0


def sglang_host_cache(info: Any) -> bool | None:
    """Whether SGLang keeps a host tier (HiCache), from its /get_server_info document: the server
    argument `enable_hierarchical_cache`; None where the document does not carry it."""
    if not isinstance(info, dict):
        return None
    on = info.get("enable_hierarchical_cache")
    return on if isinstance(on, bool) else None


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


def llamacpp_slot_count(slots: Any) -> int | None:
    """llama.cpp's slots (`--parallel`) from its /slots list: one entry a slot."""
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        return None
    return len(slots)


def llamacpp_props_slot_count(props: Any) -> int | None:
    """llama.cpp's slots from /props, for a server started without the /slots endpoint:
    `total_slots`."""
    return _positive_int(props.get("total_slots")) if isinstance(props, dict) else None


def reads_kv_tokens(replica: config.Replica) -> bool:
    """Whether the probes read the replica's KV capacity in tokens: an engine that states it
    (vLLM on its /metrics, SGLang and llama.cpp by a request of their own), not a router, and
    not set in the config (the config wins)."""
    return (
        replica.metrics in ("vllm", "sglang", "llamacpp")
        and not replica.load_from
        and replica.kv_tokens is None
    )


def reads_kv_slots(replica: config.Replica) -> bool:
    """Whether the probes read the replica's KV slots: a llama.cpp engine (each request's KV in a
    slot of its own), not a router, and not set in the config (`kv_slots`: the config wins)."""
    return replica.metrics == "llamacpp" and not replica.load_from and replica.kv_slots is None


def reads_host_cache(replica: config.Replica) -> bool:
    """Whether the probes read if the replica's engine keeps a host tier: an engine that states it
    (SGLang in its server info, vLLM on its /metrics), not a router, and not set in the config
    (`host_cache`: the config wins)."""
    return replica.metrics in ("sglang", "vllm") and not replica.load_from and replica.host_cache is None


def reads_kv_apart(replica: config.Replica) -> bool:
    """Whether reading the replica's KV (capacity, slots, host tier) costs a request of its own
    (SGLang, llama.cpp) rather than coming with its /metrics (vLLM) or not being read at all."""
    if replica.metrics == "vllm":
        return False
    return reads_kv_tokens(replica) or reads_kv_slots(replica) or reads_host_cache(replica)


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


async def read_kv_apart(
    client: httpx.AsyncClient, replica: config.Replica, headers: dict[str, str], timeout_s: float
) -> tuple[int | None, int | None, bool | None]:
    """(KV capacity in tokens, KV slots, host tier) that an SGLang or llama.cpp replica states, by
    requests of their own, each only where the probes read it (`reads_kv_tokens`,
    `reads_kv_slots`, `reads_host_cache`); None for one not read or not said (an older engine, an
    endpoint turned off, an answer of another shape)."""
    base = replica.url.rstrip("/")
    want_kv, want_slots, want_host = (
        reads_kv_tokens(replica),
        reads_kv_slots(replica),
        reads_host_cache(replica),
    )
    kv: int | None = None
    slots: int | None = None
    host: bool | None = None
    if replica.metrics == "sglang" and (want_kv or want_host):
        info = await _get_json(client, base + "/get_server_info", headers, timeout_s)
        kv = sglang_kv_tokens(info) if want_kv else None
        host = sglang_host_cache(info) if want_host else None
    elif replica.metrics == "llamacpp" and (want_kv or want_slots):
        # /slots answers 501 on a server started with --no-slots; /props says as much, per slot.
        listed = await _get_json(client, base + "/slots", headers, timeout_s)
        kv = llamacpp_slots_kv_tokens(listed) if want_kv else None
        slots = llamacpp_slot_count(listed) if want_slots else None
        if (want_kv and kv is None) or (want_slots and slots is None):
            props = await _get_json(client, base + "/props", headers, timeout_s)
            if want_kv and kv is None:
                kv = llamacpp_props_kv_tokens(props)
            if want_slots and slots is None:
                slots = llamacpp_props_slot_count(props)
    if (want_kv and kv is None) or (want_slots and slots is None):
        log.debug("replica %s: no KV capacity or slots in its answer (%s)", replica.name, replica.metrics)
    return kv, slots, host


def _headers(replica: config.Replica) -> dict[str, str]:
    key = replica.api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


class _Page(NamedTuple):
    """What an engine's /metrics page said: (running, waiting), (prompt tokens, cached ones), and
    for vLLM its KV capacity and whether it offloads; None for each it did not say."""

    load: tuple[int, int] | None = None
    cache: tuple[int, int] | None = None
    kv_tokens: int | None = None
    host_cache: bool | None = None


async def _read_metrics(
    client: httpx.AsyncClient, replica: config.Replica, headers: dict[str, str], timeout_s: float
) -> _Page:
    """The replica's /metrics page, read; nothing for an answer other than 200, or none."""
    page = _Page()
    try:
        answer = await client.get(replica.url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
        if answer.status_code == 200:
            text, vllm = answer.text, replica.metrics == "vllm"
            page = _Page(
                parse_load(text, replica.metrics),
                parse_prompt_cache(text, replica.metrics),
                parse_vllm_kv_tokens(text) if vllm and reads_kv_tokens(replica) else None,
                parse_vllm_host_cache(text) if vllm and reads_host_cache(replica) else None,
            )
    except httpx.HTTPError:
        pass
    if page.load is None:
        log.debug("replica %s: no load in its /metrics (%s names)", replica.name, replica.metrics)
    return page


async def probe(
    client: httpx.AsyncClient,
    replica: config.Replica,
    timeout_s: float,
    clock: Callable[[], float],
    read_kv: bool = False,
) -> ReplicaProbed:
    """One probe of one replica; never raises for anything the replica does.

    `read_kv`: also ask a healthy SGLang or llama.cpp replica for its KV capacity, an SGLang one
    whether it keeps a host tier, and a llama.cpp one for its slots (a vLLM one says its capacity
    and its offloading on every /metrics page anyway).
    """
    base = replica.url.rstrip("/")
    headers = _headers(replica)
    try:
        health = await client.get(base + replica.health_path, headers=headers, timeout=timeout_s)
        healthy = 200 <= health.status_code < 300
    except httpx.HTTPError:
        healthy = False
    # A router's own /metrics says nothing about its engines' queues; the core sums the load of
    # the replicas it names in `load_from` instead.
    sent_at: float | None = None
    page = _Page()
    slots: int | None = None
    if healthy and replica.metrics != "none" and not replica.load_from:
        sent_at = clock()
        page = await _read_metrics(client, replica, headers, timeout_s)
    load, cache, kv, host = page
    if healthy and read_kv and reads_kv_apart(replica):
        kv, slots, host = await read_kv_apart(client, replica, headers, timeout_s)
    running, waiting = load if load is not None else (None, None)
    prompt, cached = cache if cache is not None else (None, None)
    # When the load was asked for: a turn placed after that cannot be in the reading.
    return ReplicaProbed(
        replica.name,
        healthy,
        running,
        waiting,
        clock(),
        sent_at if load is not None else None,
        kv_tokens=kv,
        kv_slots=slots,
        host_cache=host,
        prompt_tokens=prompt,
        cached_tokens=cached,
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
