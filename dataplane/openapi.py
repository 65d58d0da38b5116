"""The OpenAPI description of the turn routes, which FastAPI does not see.

`POST /v1/chat/completions` and `POST /v1/decide` are served by the proxy itself, beside FastAPI
(app.py says why), so FastAPI's generated document lacks them. `describe_turn_routes` adds both,
with the luftpause headers and every status the dataplane answers with itself, so that clients
and fuzzers (the schemathesis test) see the whole API in `/openapi.json`.
"""

from __future__ import annotations

from typing import Any

from luftpause.dataplane import headers
from luftpause.dataplane.decide import MAX_LABELS, MIN_LABELS
from luftpause.lifecycle import BATCH, CALLER_MAX_BYTES, CLASSES, INTERACTIVE

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}
    },
}

_LUFTPAUSE_HEADERS = [
    {
        "name": headers.RUN_ID,
        "in": "header",
        "required": False,
        "description": f"the run this turn belongs to: UTF-8, at most {headers.RUN_ID_MAX_BYTES} bytes",
        "schema": {"type": "string"},
    },
    {
        "name": headers.SERVICE_CLASS,
        "in": "header",
        "required": False,
        "description": f"{INTERACTIVE} (the default) or {BATCH}",
        "schema": {"type": "string", "enum": list(CLASSES)},
    },
    {
        "name": headers.CALLER,
        "in": "header",
        "required": False,
        "description": f"who is asking, for fairness; cut at {CALLER_MAX_BYTES} bytes",
        "schema": {"type": "string"},
    },
]

_REFUSALS = {
    "400": "the body or a luftpause header is malformed",
    "401": "LUFTPAUSE_TOKEN is set and the bearer is missing or wrong",
    "403": "the Host or Origin is not one this dataplane answers to",
    "404": "no replica of the pool serves the model",
    "413": "the body is longer than [dataplane] max_body_bytes",
    "502": "the placed replica's engine could not be reached or broke off",
    "503": "the scheduler failed the admission, or the dataplane is stopping",
    "504": "the engine took the request and sent nothing within its first-byte timeout",
}


def _responses(ok: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    for status, why in _REFUSALS.items():
        out[status] = {"description": why, "content": {"application/json": {"schema": _ERROR}}}
    return out


def _turn_route(summary: str, operation_id: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
    """A POST route a turn comes through: the luftpause headers, a JSON `body` (its schema),
    `ok` as its 200 and the dataplane's own refusals beside it."""
    return {
        "post": {
            "summary": summary,
            "operationId": operation_id,
            "parameters": _LUFTPAUSE_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses(ok),
        }
    }


_CHAT = _turn_route(
    "One turn of a run: the engine's chat completion, streamed or whole",
    "chat_completions",
    {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer", "minimum": 0},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
    },
    {
        "description": "the engine's reply, passed through (an engine's own error status too)",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    },
)

_DECIDE = _turn_route(
    "One quick classification: a single-pass classifier, or a generative model's pick",
    "decide",
    {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "labels": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": MIN_LABELS,
                "maxItems": MAX_LABELS,
            },
        },
    },
    {"description": "the classification (vLLM's /classify shape)", "content": {"application/json": {}}},
)


def describe_turn_routes(document: dict[str, Any], turn_path: str, decide_path: str) -> dict[str, Any]:
    """`document` (FastAPI's) with the two turn routes added."""
    document.setdefault("paths", {})[turn_path] = _CHAT
    document["paths"][decide_path] = _DECIDE
    return document
