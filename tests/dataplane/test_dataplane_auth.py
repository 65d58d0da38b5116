"""LUFTPAUSE_TOKEN: every /v1 route of the dataplane needs the bearer; nothing of it goes upstream.

End to end against `real_stack.py`'s dataplane, started with the token set. The scripted
engine records the headers of every request that reaches it, which is how the tests see what
went upstream. The unit tests at the bottom pin the comparison itself.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from real_stack import ENGINE_KEY, HOSTED_KEY, TOKEN, RealStack

from luftpause.bearer import bearer_matches

V1_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/decide"),
    ("GET", "/v1/models"),
    ("DELETE", "/v1/runs/some-run"),
]


@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer"]
)
def test_every_v1_route_is_a_401_without_the_right_bearer(
    real_stack: RealStack, method: str, path: str, authorization: str | None
):
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.request(method, f"{real_stack.dataplane}{path}", headers=headers, json={}, timeout=10)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "missing or wrong bearer token (see LUFTPAUSE_TOKEN)"}}


def test_with_the_bearer_the_routes_answer(real_stack: RealStack):
    with real_stack.client() as client:
        models = client.get("/v1/models")
        ended = client.delete("/v1/runs/some-run")
        lower_case_scheme = client.get("/v1/models", headers={"authorization": f"bearer {TOKEN}"})
    assert models.status_code == 200 and "scripted-llama" in [m["id"] for m in models.json()["data"]]
    assert ended.status_code == 204
    assert lower_case_scheme.status_code == 200


def test_health_and_metrics_stay_open(real_stack: RealStack):
    assert httpx.get(f"{real_stack.dataplane}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{real_stack.dataplane}/metrics", timeout=10)
    assert metrics.status_code == 200 and "luftpause_dataplane_turns_total" in metrics.text


@pytest.mark.parametrize("stream", [False, True])
def test_the_engine_gets_its_own_key_never_the_clients_authorization(real_stack: RealStack, stream: bool):
    tag = uuid.uuid4().hex[:12]
    body = {
        "model": "scripted-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "tag": tag,
        "stream": stream,
    }
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
    ((seen,),) = [real_stack.engine_log(tag)]
    assert seen["headers"]["authorization"] == f"Bearer {ENGINE_KEY}"
    assert all(TOKEN not in value for value in seen["headers"].values())


def test_an_engine_without_a_key_gets_no_authorization_at_all(real_stack: RealStack):
    tag = uuid.uuid4().hex[:12]
    body = {"model": "plain-llama", "messages": [{"role": "user", "content": "hi"}], "tag": tag}
    with real_stack.client() as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    ((seen,),) = [real_stack.engine_log(tag)]
    assert "authorization" not in seen["headers"]
    assert all(TOKEN not in value for value in seen["headers"].values())


def test_the_bearer_comparison():
    token = b"s3cret"
    assert bearer_matches(b"Bearer s3cret", token)
    assert bearer_matches(b"BEARER s3cret", token)
    assert bearer_matches(b"Bearer  s3cret ", token)
    assert not bearer_matches(None, token)
    assert not bearer_matches(b"Bearer s3cre", token)
    assert not bearer_matches(b"Bearer s3cretX", token)
    assert not bearer_matches(b"s3cret", token)
    assert not bearer_matches(b"Token s3cret", token)


def test_a_hosted_endpoint_over_https_gets_its_key_at_its_v1_base_and_is_probed_at_its_health_path(
    real_stack: RealStack,
):
    if real_stack.ca_file is None:
        pytest.skip("no certificate could be made here: install cryptography, or openssl")
    tag = uuid.uuid4().hex[:12]
    body = {
        "model": "hosted-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "tag": tag,
        "stream": True,
    }
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-luftpause-replica"] == "hosted"
    assert "data: [DONE]" in r.text
    ((seen,),) = [real_stack.engine_log(tag, hosted=True)]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == f"Bearer {HOSTED_KEY}"
    assert all(TOKEN not in value for value in seen["headers"].values())
    probes = real_stack.hosted_gets()
    # The health path is taken from the endpoint's base URL, as the rest of its API.
    assert "/v1/ready" in probes and "/v1/health" not in probes
