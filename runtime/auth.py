"""The runtime's bearer token (`LUFTPAUSE_TOKEN`, checked as luftpause/bearer.py says) and the CORS
headers of its status document.

With a token, `/mcp`, `GET /status` and `GET /metrics` answer 401 unless the request carries
`Authorization: Bearer <token>` (or the operator token, `LUFTPAUSE_OPERATOR_TOKEN`, which
callers.py lets see every run); the comparison takes constant time. On `/mcp` the 401's body is
a JSON-RPC error, so that an MCP client raises it with its message; on `/status` and `/metrics`
it is the house error body (a Prometheus scrape without the token reads why in its target's
error). CORS preflights (OPTIONS)
pass without the token, since browsers send them without credentials.
"""

from __future__ import annotations

import json

from starlette.types import Scope, Send

from luftpause.bearer import BearerAuth, authorization_of, send_401
from luftpause.config import TOKEN_ENV
from luftpause.errors import error_json

__all__ = ["BearerAuth", "cors_headers", "guarded", "refuse"]

GUARDED_PREFIXES = ("/mcp", "/status", "/metrics")
# The JSON-RPC error code of a 401 on /mcp (in the range JSON-RPC leaves to servers).
UNAUTHORIZED = -32001


def cors_headers(origin: str | None) -> dict[str, str]:
    """What lets the page of `origin` read the status document (the scheduler's status page
    fetches it): only origins the host guard let through (luftpause/hosts.py) get this far, and
    each is named back rather than allowing every page with "*"."""
    if not origin:
        return {}
    return {
        "access-control-allow-origin": origin,
        "vary": "origin",
        "access-control-allow-methods": "GET, OPTIONS",
        "access-control-allow-headers": "authorization, content-type",
        "access-control-max-age": "600",
    }


def origin_of(scope: Scope) -> str | None:
    value = next((v for k, v in scope.get("headers", []) if k == b"origin"), None)
    return value.decode("latin-1") if value is not None else None


def guarded(scope: Scope) -> bool:
    """/mcp, /status and /metrics need the token; CORS preflights pass without it."""
    if scope.get("method") == "OPTIONS":
        return False
    path = scope.get("path", "")
    return any(path == p or path.startswith(p + "/") for p in GUARDED_PREFIXES)


async def refuse(scope: Scope, send: Send) -> None:
    """The 401: a JSON-RPC error on /mcp (MCP clients raise it with its message), the house
    error body on /status (with the CORS headers that let the status page read it) and /metrics."""
    problem = "missing bearer token" if authorization_of(scope) is None else "invalid bearer token"
    message = f"{problem}: send Authorization: Bearer <{TOKEN_ENV}>"
    path = scope.get("path", "")
    if path == "/metrics":
        await send_401(send, error_json(message))
    elif path == "/status" or path.startswith("/status/"):
        cors = [(k.encode(), v.encode("latin-1")) for k, v in cors_headers(origin_of(scope)).items()]
        await send_401(send, error_json(message), cors)
    else:
        body = {"jsonrpc": "2.0", "id": None, "error": {"code": UNAUTHORIZED, "message": message}}
        await send_401(send, json.dumps(body).encode())
