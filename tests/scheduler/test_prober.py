"""The prober: engine load read from each family's metric names, and health from the health path."""

from __future__ import annotations

import httpx
import pytest

from luftpause import config
from luftpause.scheduler.events import ReplicaProbed
from luftpause.scheduler.prober import parse_load, probe

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
