"""The prober: engine load read from each family's metric names, health from the health path, and
the engine's KV capacity and host tier from where each family states them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import uvicorn
from support import free_port, until

from luftpause import config
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.server import create_app
from luftpause.scheduler.events import ReplicaProbed
from luftpause.scheduler.prober import (
    KV_READ_PERIOD_S,
    KvReadTimer,
    llamacpp_props_kv_tokens,
    llamacpp_props_slot_count,
    llamacpp_slot_count,
    llamacpp_slots_kv_tokens,
    parse_load,
    parse_prompt_cache,
    parse_vllm_host_cache,
    parse_vllm_kv_tokens,
    probe,
    run_prober,
    sglang_host_cache,
    sglang_kv_tokens,
)

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama",engine_type="unified",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="llama",engine_type="unified",dp_rank="1"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama",engine_type="unified",dp_rank="0"} 4.0
sglang:num_queue_reqs{model_name="llama",engine_type="unified",dp_rank="1"} 0.0
sglang:token_usage{model_name="llama"} 0.41
"""


def test_sglang_load_is_summed_over_label_sets():
    assert parse_load(SGLANG_PAGE, "sglang") == (5, 4)


def test_vllm_names():
    page = 'vllm:num_requests_running{model_name="m"} 7\nvllm:num_requests_waiting{model_name="m"} 1\n'
    assert parse_load(page, "vllm") == (7, 1)


def test_llamacpp_names_without_labels():
    page = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
    assert parse_load(page, "llamacpp") == (1, 0)


def test_a_page_without_the_waiting_metric_gives_no_load():
    assert parse_load('sglang:num_running_reqs{a="b"} 3\n', "sglang") is None


def test_the_other_familys_names_are_not_read():
    assert parse_load(SGLANG_PAGE, "vllm") is None


def test_lines_that_do_not_parse_are_skipped_not_fatal():
    page = 'garbage here\nsglang:num_running_reqs NaN\nsglang:num_running_reqs 2 1700000000\nsglang:num_queue_reqs{x="}"} 1\n'
    assert parse_load(page, "sglang") == (2, 1)


def _replica(**kw) -> config.Replica:
    return config.Replica(name="e", url="http://engine:1234/", models=["m"], **kw)


async def _probe(
    replica: config.Replica, handler, clock=lambda: 42.0
) -> tuple[ReplicaProbed, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
        return await probe(client, replica, 2.0, clock), seen


async def test_healthy_engine_with_load():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=SGLANG_PAGE if request.url.path == "/metrics" else "ok")

    result, seen = await _probe(_replica(), handler)
    assert result == ReplicaProbed("e", True, 5, 4, 42.0, sent_at=42.0)
    assert [r.url.path for r in seen] == ["/health", "/metrics"]


async def test_a_load_reading_says_when_it_was_asked_for():
    # The scheduler counts only turns placed before the metrics were asked for as seen by them.
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=SGLANG_PAGE if request.url.path == "/metrics" else "ok")

    times = iter([10.0, 11.5])
    result, _ = await _probe(_replica(), handler, clock=lambda: next(times))
    assert (result.sent_at, result.at) == (10.0, 11.5)


async def test_health_answer_other_than_2xx_is_unhealthy():
    result, seen = await _probe(_replica(), lambda r: httpx.Response(503))
    assert result == ReplicaProbed("e", False, None, None, 42.0)
    assert [r.url.path for r in seen] == ["/health"]


async def test_unreachable_replica_is_unhealthy():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    result, _ = await _probe(_replica(), refuse)
    assert result.healthy is False


async def test_metrics_none_reads_no_metrics_and_reports_no_load():
    result, seen = await _probe(
        _replica(metrics="none", health_path="/v1/models"), lambda r: httpx.Response(200)
    )
    assert result == ReplicaProbed("e", True, None, None, 42.0)
    assert [r.url.path for r in seen] == ["/v1/models"]


async def test_unreadable_metrics_leave_the_replica_healthy_without_a_reading():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404 if request.url.path == "/metrics" else 200)

    result, _ = await _probe(_replica(), handler)
    assert result == ReplicaProbed("e", True, None, None, 42.0)


async def test_hosted_endpoint_gets_its_api_key_as_a_bearer(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POD_KEY", "sekrit")
    _, seen = await _probe(_replica(metrics="none", api_key_env="POD_KEY"), lambda r: httpx.Response(200))
    assert seen[0].headers["authorization"] == "Bearer sekrit"


# -- KV capacity --


@contextlib.asynccontextmanager
async def _fake_engine(flavour: str, kv_pool_tokens: int, host_cache_tokens: int = 0) -> AsyncIterator[str]:
    """The project's fake engine on a loopback port, in this test's loop; yields its URL."""
    params = EngineParams(kv_pool_tokens=kv_pool_tokens, host_cache_tokens=host_cache_tokens)
    app = create_app(name="fake-kv", params=params, metrics_flavour=flavour)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), 10.0, "the fake engine to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)


async def _probe_url(url: str, read_kv: bool, **kw: Any) -> ReplicaProbed:
    replica = config.Replica(name="e", url=url, models=["m"], **kw)
    async with httpx.AsyncClient() as client:
        return await probe(client, replica, 2.0, lambda: 42.0, read_kv=read_kv)


async def test_an_sglang_engine_states_its_kv_pool_in_its_server_info():
    async with _fake_engine("sglang", kv_pool_tokens=12345) as url:
        read = await _probe_url(url, read_kv=True, metrics="sglang")
        not_due = await _probe_url(url, read_kv=False, metrics="sglang")
    assert (read.healthy, read.running, read.waiting, read.kv_tokens) == (True, 0, 0, 12345)
    # Between reads the probe asks for health and load only: no reading, the last one stands.
    assert (not_due.running, not_due.kv_tokens) == (0, None)


async def test_a_vllm_engine_states_its_kv_pool_on_every_metrics_page():
    async with _fake_engine("vllm", kv_pool_tokens=20000) as url:
        result = await _probe_url(url, read_kv=False, metrics="vllm")
    # 1250 blocks of 16 tokens.
    assert (result.running, result.waiting, result.kv_tokens) == (0, 0, 20000)


async def test_a_replica_whose_config_sets_kv_tokens_is_not_asked():
    async with _fake_engine("sglang", kv_pool_tokens=12345) as url:
        sglang = await _probe_url(url, read_kv=True, metrics="sglang", kv_tokens=5000)
    async with _fake_engine("vllm", kv_pool_tokens=20000) as url:
        vllm = await _probe_url(url, read_kv=True, metrics="vllm", kv_tokens=5000)
    # The core takes the config's figure (ReplicaSpec.kv_tokens); the probe has none to add.
    assert sglang.kv_tokens is None and vllm.kv_tokens is None
    assert sglang.running == vllm.running == 0


@pytest.mark.parametrize("flavour", ["sglang", "vllm"])
async def test_an_engine_says_whether_it_keeps_a_host_tier(flavour: str):
    async with _fake_engine(flavour, kv_pool_tokens=12345, host_cache_tokens=24690) as url:
        tiered = await _probe_url(url, read_kv=True, metrics=flavour)
    async with _fake_engine(flavour, kv_pool_tokens=12345) as url:
        plain = await _probe_url(url, read_kv=True, metrics=flavour)
        # The config's word is the only one: the engine is not asked, even where its KV pool is.
        configured = await _probe_url(url, read_kv=True, metrics=flavour, host_cache=True)
    assert (tiered.host_cache, tiered.kv_tokens) == (True, 12345 if flavour == "sglang" else 12336)
    assert (plain.host_cache, configured.host_cache, configured.kv_tokens) == (False, None, plain.kv_tokens)


async def test_an_sglang_replica_whose_config_sets_its_pool_is_still_asked_for_its_host_tier():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"max_total_num_tokens": 999, "enable_hierarchical_cache": True})
        return httpx.Response(200, text=SGLANG_PAGE if request.url.path == "/metrics" else "ok")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        result = await probe(client, _replica(kv_tokens=5000), 2.0, lambda: 42.0, read_kv=True)
        assert (result.kv_tokens, result.host_cache) == (None, True)
        # With both in the config there is nothing to ask.
        seen.clear()
        both = await probe(
            client, _replica(kv_tokens=5000, host_cache=False), 2.0, lambda: 42.0, read_kv=True
        )
    assert (both.host_cache, "/get_server_info" in seen) == (None, False)


def test_sglang_states_its_host_tier_among_its_server_arguments():
    assert sglang_host_cache({"enable_hierarchical_cache": True, "hicache_ratio": 2.0}) is True
    assert sglang_host_cache({"enable_hierarchical_cache": False}) is False
    # An SGLang older than HiCache, or an answer of another shape, does not say.
    for answer in ({"max_total_num_tokens": 1}, {"enable_hierarchical_cache": "true"}, [True], None):
        assert sglang_host_cache(answer) is None


def test_vllm_states_its_kv_offloading_in_its_cache_config_labels():
    def page(*sizes: str) -> str:
        return "".join(
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="100",kv_offloading_size="{size}"}} 1.0\n'
            for size in sizes
        )

    assert parse_vllm_host_cache(page("None")) is False
    assert parse_vllm_host_cache(page("64.0")) is True
    # One engine core per data-parallel rank: any with offloading on says it.
    assert parse_vllm_host_cache(page("None", "8")) is True
    # A vLLM older than the option writes no such label: it does not say.
    assert parse_vllm_host_cache('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n') is None
    assert parse_vllm_host_cache(SGLANG_PAGE) is None


@contextlib.contextmanager
def _llamacpp(answers: dict[str, tuple[int, Any]], seen: list[str] | None = None) -> Iterator[str]:
    """A llama-server stand-in on loopback answering GETs of `answers`' paths with (status, JSON);
    the paths asked for go to `seen`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if seen is not None:
                seen.append(self.path)
            status, payload = answers.get(self.path, (404, {"error": "not found"}))
            body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _llamacpp_page(counters: dict[str, float], gauges: dict[str, float]) -> str:
    """A /metrics page as llama-server writes it (server-task.cpp, `to_metrics`): counters, then
    gauges, each `# HELP`, `# TYPE` and one sample without labels, the value as a C++ stream
    writes a double (six significant digits: 12345678 is 1.23457e+07)."""
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, value in items.items():
            lines += [f"# HELP llamacpp:{name} {name.replace('_', ' ')}", f"# TYPE llamacpp:{name} {kind}"]
            lines.append(f"llamacpp:{name} {value:.6g}")
    return "\n".join(lines) + "\n"


# A server that computed 3,000 prompt tokens and took 9,000 more from its cache, running one
# request: three quarters of its prompts came from the cache.
LLAMACPP_PAGE = _llamacpp_page(
    {
        "prompt_tokens_total": 3000,
        "prompt_tokens_cached_total": 9000,
        "prompt_seconds_total": 1.25,
        "tokens_predicted_total": 420,
        "tokens_predicted_seconds_total": 8.5,
        "n_decode_total": 431,
        "n_tokens_max": 2210,
    },
    {
        "prompt_tokens_seconds": 2400.0,
        "predicted_tokens_seconds": 49.4118,
        "requests_processing": 1,
        "requests_deferred": 0,
        "n_busy_slots_per_decode": 1,
    },
)
LLAMACPP_METRICS = (200, LLAMACPP_PAGE)
# What llama-server -c 8192 -np 4 answers: each slot its quarter of the context.
LLAMACPP_SLOTS = [{"id": i, "n_ctx": 2048, "is_processing": i == 0, "params": {}} for i in range(4)]
LLAMACPP_PROPS = {"default_generation_settings": {"n_ctx": 2048, "params": {}}, "total_slots": 4}
# What it answers with --no-slots.
NO_SLOTS = (501, {"error": {"code": 501, "message": "This server does not support slots endpoint."}})


async def test_a_llamacpp_server_states_its_kv_as_its_slots_contexts_and_its_slots_as_their_number():
    answers = {
        "/health": (200, {"status": "ok"}),
        "/metrics": LLAMACPP_METRICS,
        "/slots": (200, LLAMACPP_SLOTS),
    }
    seen: list[str] = []
    with _llamacpp(answers, seen) as url:
        result = await _probe_url(url, read_kv=True, metrics="llamacpp")
    assert (result.running, result.waiting, result.kv_tokens, result.kv_slots) == (1, 0, 8192, 4)
    assert seen == ["/health", "/metrics", "/slots"]  # /slots says both: /props is not asked


async def test_a_llamacpp_server_without_its_slots_endpoint_is_read_from_its_props():
    answers = {"/health": (200, {"status": "ok"}), "/metrics": LLAMACPP_METRICS, "/slots": NO_SLOTS}
    with _llamacpp({**answers, "/props": (200, LLAMACPP_PROPS)}) as url:
        result = await _probe_url(url, read_kv=True, metrics="llamacpp")
    assert (result.kv_tokens, result.kv_slots) == (8192, 4)
    with _llamacpp(answers) as url:
        neither = await _probe_url(url, read_kv=True, metrics="llamacpp")
    assert (neither.healthy, neither.running, neither.kv_tokens, neither.kv_slots) == (True, 1, None, None)


async def test_a_llamacpp_replica_is_asked_only_for_what_its_config_does_not_set():
    answers = {
        "/health": (200, {"status": "ok"}),
        "/metrics": LLAMACPP_METRICS,
        "/slots": (200, LLAMACPP_SLOTS),
        "/props": (200, LLAMACPP_PROPS),
    }
    seen: list[str] = []
    with _llamacpp(answers, seen) as url:
        slots_set = await _probe_url(url, read_kv=True, metrics="llamacpp", kv_slots=2)
        kv_set = await _probe_url(url, read_kv=True, metrics="llamacpp", kv_tokens=5000)
        both_set = await _probe_url(url, read_kv=True, metrics="llamacpp", kv_tokens=5000, kv_slots=2)
    # The core takes the config's figures (ReplicaSpec); the probe has none to add for those.
    assert (slots_set.kv_tokens, slots_set.kv_slots) == (8192, None)
    assert (kv_set.kv_tokens, kv_set.kv_slots) == (None, 4)
    assert (both_set.kv_tokens, both_set.kv_slots, both_set.running) == (None, None, 1)
    assert seen == ["/health", "/metrics", "/slots"] * 2 + ["/health", "/metrics"]


async def test_a_llamacpp_slot_count_missing_from_slots_is_read_from_props():
    # A /slots answer whose entries lack n_ctx still counts slots; with kv_tokens set, /props is
    # asked only where /slots does not give the count.
    odd = [{"id": 0}, {"id": 1}]
    answers = {"/health": (200, {"status": "ok"}), "/metrics": LLAMACPP_METRICS, "/slots": (200, odd)}
    seen: list[str] = []
    with _llamacpp({**answers, "/props": (200, LLAMACPP_PROPS)}, seen) as url:
        both = await _probe_url(url, read_kv=True, metrics="llamacpp")
        slots_only = await _probe_url(url, read_kv=True, metrics="llamacpp", kv_tokens=5000)
    assert (both.kv_tokens, both.kv_slots) == (8192, 2)
    assert (slots_only.kv_tokens, slots_only.kv_slots) == (None, 2)
    assert seen == ["/health", "/metrics", "/slots", "/props", "/health", "/metrics", "/slots"]


async def test_between_kv_reads_a_llamacpp_probe_reads_its_metrics_page_only():
    answers = {
        "/health": (200, {"status": "ok"}),
        "/metrics": LLAMACPP_METRICS,
        "/slots": (200, LLAMACPP_SLOTS),
    }
    seen: list[str] = []
    with _llamacpp(answers, seen) as url:
        result = await _probe_url(url, read_kv=False, metrics="llamacpp")
    assert (result.running, result.kv_tokens, result.kv_slots) == (1, None, None)
    # The cache counters come with the load, on every probe.
    assert (result.prompt_tokens, result.cached_tokens) == (12000, 9000)
    assert seen == ["/health", "/metrics"]


def test_llamacpp_prompt_cache_counters_are_read_as_it_writes_them():
    # llama.cpp counts the tokens it computed and the ones its cache gave apart: all its prompt
    # tokens are their sum.
    assert parse_prompt_cache(LLAMACPP_PAGE, "llamacpp") == (12000, 9000)
    # Six significant digits, as llama-server writes a large double.
    big = _llamacpp_page({"prompt_tokens_total": 12345678, "prompt_tokens_cached_total": 87654321}, {})
    assert "llamacpp:prompt_tokens_total 1.23457e+07\n" in big
    assert parse_prompt_cache(big, "llamacpp") == (12345700 + 87654300, 87654300)
    # An older server without the cached counter gives no reading; neither does another family's page.
    older = "".join(line + "\n" for line in LLAMACPP_PAGE.splitlines() if "cached" not in line)
    assert parse_prompt_cache(older, "llamacpp") is None
    assert parse_prompt_cache(LLAMACPP_PAGE, "sglang") is None
    assert parse_prompt_cache(LLAMACPP_PAGE, "none") is None


def test_sglang_and_vllm_prompt_cache_counters():
    # SGLang: whole prompts, and the cached tokens by where the cache kept them (summed); its
    # cached counter has no sample before the first hit, only its declaration: 0 then.
    sglang = (
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE sglang:prompt_tokens_total counter\n"
        'sglang:prompt_tokens_total{model_name="llama"} 8000.0\n'
        "# HELP sglang:cached_tokens_total Number of cached prompt tokens.\n"
        "# TYPE sglang:cached_tokens_total counter\n"
    )
    assert parse_prompt_cache(sglang, "sglang") == (8000, 0)
    hits = (
        'sglang:cached_tokens_total{model_name="llama",cache_source="device"} 5000.0\n'
        'sglang:cached_tokens_total{model_name="llama",cache_source="host"} 1000.0\n'
    )
    assert parse_prompt_cache(sglang + hits, "sglang") == (8000, 6000)
    assert parse_prompt_cache(SGLANG_PAGE, "sglang") is None  # neither counter
    # vLLM: the prompt tokens its prefix cache was asked for, and found, per engine core.
    vllm = (
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1024.0\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3072.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0\n'
    )
    assert parse_prompt_cache(vllm, "vllm") == (5120, 3072)


def test_llamacpp_slot_counts_of_another_shape_give_no_reading():
    assert llamacpp_slot_count(LLAMACPP_SLOTS) == 4
    assert llamacpp_slot_count([]) is None
    assert llamacpp_slot_count([{"id": 0}, "?"]) is None
    assert llamacpp_slot_count({"total_slots": 4}) is None
    assert llamacpp_props_slot_count(LLAMACPP_PROPS) == 4
    assert llamacpp_props_slot_count({"total_slots": 0}) is None
    assert llamacpp_props_slot_count({"total_slots": "4"}) is None
    assert llamacpp_props_slot_count([4]) is None


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>not json</html>"),
        httpx.Response(200, json={"max_total_num_tokens": "32768"}),
        httpx.Response(200, json={"max_total_num_tokens": 0}),
        httpx.Response(200, json={"max_total_num_tokens": True}),
        httpx.Response(200, json=[1, 2, 3]),
        httpx.Response(404, json={"max_total_num_tokens": 32768}),
    ],
    ids=["not-json", "a-string", "zero", "a-bool", "a-list", "not-200"],
)
async def test_a_malformed_server_info_gives_no_reading_and_leaves_the_probe_whole(answer: httpx.Response):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return answer
        return httpx.Response(200, text=SGLANG_PAGE if request.url.path == "/metrics" else "ok")

    replica = _replica()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        result = await probe(client, replica, 2.0, lambda: 42.0, read_kv=True)
    assert result == ReplicaProbed("e", True, 5, 4, 42.0, sent_at=42.0, kv_tokens=None)


async def test_a_server_info_read_that_fails_gives_no_reading():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            raise httpx.ReadTimeout("took too long", request=request)
        return httpx.Response(200, text=SGLANG_PAGE if request.url.path == "/metrics" else "ok")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        result = await probe(client, _replica(), 2.0, lambda: 42.0, read_kv=True)
    assert (result.healthy, result.running, result.kv_tokens) == (True, 5, None)


async def test_routers_and_engines_without_metrics_are_not_asked_for_their_kv():
    for replica in (
        _replica(metrics="none", health_path="/v1/models"),
        _replica(load_from=["a", "b"]),
        _replica(metrics="llamacpp", load_from=["a"]),
    ):
        result, seen = await _probe(replica, lambda r: httpx.Response(200, json={"max_total_num_tokens": 1}))
        assert result.kv_tokens is None
        assert {r.url.path for r in seen} <= {"/health", "/v1/models"}


def test_sglang_kv_at_the_top_or_summed_over_its_ranks_internal_states():
    assert sglang_kv_tokens({"max_total_num_tokens": 65536, "max_running_requests": 48}) == 65536
    nested = {"internal_states": [{"max_total_num_tokens": 40000}, {"max_total_num_tokens": 40000}]}
    assert sglang_kv_tokens(nested) == 80000
    # Internal states that do not say it leave the top level's figure.
    assert sglang_kv_tokens({"max_total_num_tokens": 100, "internal_states": [{"load": 3}]}) == 100
    assert sglang_kv_tokens({"internal_states": []}) is None
    assert sglang_kv_tokens({"internal_states": "?"}) is None


def test_vllm_kv_is_blocks_times_block_size_summed_over_engines():
    one = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0\n'
    assert parse_vllm_kv_tokens("# HELP x\n" + one) == 32768
    two = one + one.replace("{", '{engine="1",')
    assert parse_vllm_kv_tokens(two) == 65536
    assert parse_vllm_kv_tokens(one.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="None"')) is None
    assert parse_vllm_kv_tokens(one.replace('block_size="16",', "")) is None
    assert parse_vllm_kv_tokens('vllm:num_requests_running{model_name="m"} 7\n') is None


def test_llamacpp_answers_of_another_shape_give_no_reading():
    assert llamacpp_slots_kv_tokens([]) is None
    assert llamacpp_slots_kv_tokens([{"id": 0, "n_ctx": 2048}, {"id": 1}]) is None
    assert llamacpp_slots_kv_tokens({"n_ctx": 2048}) is None
    assert llamacpp_props_kv_tokens({"total_slots": 4}) is None
    assert (
        llamacpp_props_kv_tokens({"total_slots": 0, "default_generation_settings": {"n_ctx": 2048}}) is None
    )


def test_kv_is_read_at_the_first_healthy_probe_then_every_period_and_when_it_comes_back():
    timer = KvReadTimer()
    assert timer.due("a", 0.0)
    timer.probed("a", healthy=False, now=0.0, read=True)  # down: nothing read
    assert timer.due("a", 2.0)
    timer.probed("a", healthy=True, now=2.0, read=True)
    assert not timer.due("a", 4.0)
    timer.probed("a", healthy=True, now=4.0, read=False)
    assert not timer.due("a", 2.0 + KV_READ_PERIOD_S - 0.1)
    assert timer.due("a", 2.0 + KV_READ_PERIOD_S)
    timer.probed("a", healthy=False, now=10.0, read=False)
    assert timer.due("a", 12.0)  # back from unhealthy: read at once


class _Stop(Exception):
    pass


async def test_the_prober_asks_an_sglang_engine_for_its_kv_only_every_so_often():
    # Rounds every 10 s on a clock the test moves: reads at 0 s, 30 s and 60 s, and at 80 s, the
    # first round after the replica was down at 70 s.
    now = [0.0]
    down_at = {70.0}
    info_reads: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(503 if now[0] in down_at else 200)
        if request.url.path == "/get_server_info":
            info_reads.append(now[0])
            return httpx.Response(200, json={"max_total_num_tokens": 4096})
        return httpx.Response(200, text=SGLANG_PAGE)

    seen: list[tuple[float, bool, int | None]] = []

    def emit(result: ReplicaProbed) -> None:
        seen.append((now[0], result.healthy, result.kv_tokens))
        if now[0] >= 90.0:
            raise _Stop
        now[0] += 10.0

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(_Stop):
            await run_prober([_replica()], 10.0, emit, lambda: now[0], client)
    assert info_reads == [0.0, 30.0, 60.0, 80.0]
    assert [t for t, _, kv in seen if kv == 4096] == info_reads
    assert (70.0, False, None) in seen
