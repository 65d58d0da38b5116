"""Every dataplane route fuzzed from its own OpenAPI document: no 5xx, no crash, no hang.

schemathesis reads `/openapi.json` of the real stack's dataplane (a real process; the turn and
decide routes are in the document too, dataplane/openapi.py) and generates, for each route,
bodies, headers and paths from it, valid and not; hypothesis drives them. Every answer must be
one the dataplane means: a reply or a 4xx that says what was wrong, never a server error, and
within the timeout. The engines behind it are all up, so no 502, 503 or 504 is legitimate
either. Bounded and derandomized: the same few dozen cases a route on every run, so that CI
stays quick and a failure here is a bug, not luck; raise EXAMPLES_PER_ROUTE to explore further
(a random run found the control character a path's run id could carry into a header).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from real_stack import TOKEN, RealStack
from schemathesis.checks import not_a_server_error

EXAMPLES_PER_ROUTE = 40


# Models whose engines answer whatever they are sent (the scripted engine, and the classifier):
# a turn for them goes all the way through admission and the engine and back. Others in the
# document's free-form `model` are refused 404 before admission, which the fuzzer covers too.
THROUGH = {
    "POST /v1/chat/completions": ["scripted-llama", "plain-llama"],
    "POST /v1/decide": ["fake-classifier"],
}


def _operations(real_stack: RealStack, route: str | None = None) -> list:
    document = httpx.get(f"{real_stack.dataplane}/openapi.json", timeout=10).json()
    if route in THROUGH:
        method, path = route.split(" ", 1)
        body = document["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"type": "string", "enum": THROUGH[route]}
    schema = schemathesis.openapi.from_dict(document)
    schema.config.base_url = real_stack.dataplane
    return [result.ok() for result in schema.get_all_operations()]


def test_the_document_describes_every_route(real_stack: RealStack):
    labels = {op.label for op in _operations(real_stack)}
    assert {"POST /v1/chat/completions", "POST /v1/decide", "GET /v1/models", "DELETE /v1/runs/{run_id}",
            "GET /health", "GET /metrics"} <= labels  # fmt: skip


ROUTES = [
    "POST /v1/chat/completions",
    "POST /v1/decide",
    "GET /v1/models",
    "DELETE /v1/runs/{run_id}",
    "GET /health",
    "GET /metrics",
]


@pytest.mark.parametrize("route", ROUTES)
def test_no_route_answers_a_server_error_or_hangs(real_stack: RealStack, route: str):
    (operation,) = [op for op in _operations(real_stack, route) if op.label == route]
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, derandomize=True)  # fmt: skip
    @given(case=operation.as_strategy())
    def fuzz(case) -> None:
        response = case.call(base_url=real_stack.dataplane, headers={"authorization": f"Bearer {TOKEN}"},
                             timeout=30)  # fmt: skip
        statuses.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    fuzz()
    takes_input = bool(operation.body or operation.path_parameters or operation.headers)
    assert len(statuses) >= (EXAMPLES_PER_ROUTE // 2 if takes_input else 1), f"only {len(statuses)} cases"
    if route in THROUGH:
        assert 200 in statuses, f"no case went all the way through: {sorted(set(statuses))}"
