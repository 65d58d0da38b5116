"""The runtime's bearer token (`LUFTPAUSE_TOKEN`) and the CORS headers of its status document.

With a token, `/mcp` and `GET /status` answer 401 unless the request carries
`Authorization: Bearer <token>` (or the operator token, `LUFTPAUSE_OPERATOR_TOKEN`, which
callers.py lets see every run); the comparison takes constant time. On `/mcp` the 401's body is
a JSON-RPC error, so that an MCP client raises it with its message; on `/status` it is the house
error body. CORS preflights (OPTIONS)
pass without the token, since browsers send them without credentials.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from luftpause.config import TOKEN_ENV

GUARDED_PREFIXES = ("/mcp", "/status")
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


def token_matches(header: str | None, token: str) -> bool:
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


class BearerAuth:
    """ASGI middleware: the token on the guarded paths, or 401."""

    def __init__(self, app: ASGIApp, token: str, operator_token: str | None = None) -> None:
        self.app = app
        self.tokens = [token, *([operator_token] if operator_token else [])]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if not any(path == p or path.startswith(p + "/") for p in GUARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        header = next(
            (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None
        )
        if any(token_matches(header, t) for t in self.tokens):
            await self.app(scope, receive, send)
            return
        message = "missing bearer token" if not header else "invalid bearer token"
        error: dict[str, object] = {"message": f"{message}: send Authorization: Bearer <{TOKEN_ENV}>"}
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        if path == "/status" or path.startswith("/status/"):
            headers.extend(
                (k.encode(), v.encode("latin-1")) for k, v in cors_headers(origin_of(scope)).items()
            )
            body = json.dumps({"error": error})
        else:
            # A JSON-RPC error, which MCP clients raise as this message instead of a bare 401.
            body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": UNAUTHORIZED, **error}})
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})
