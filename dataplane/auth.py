"""Bearer-token auth for the dataplane's `/v1` routes, from `LUFTPAUSE_TOKEN`.

With the variable set, every request under `/v1` must carry `Authorization: Bearer <token>`;
anything else gets a 401 with the house error body before any of our routes runs. The token is
compared in constant time so that its bytes cannot be found one at a time by timing. Without the
variable everyone is let in, and the service says so in a warning at start. `/health` and
`/metrics` stay open: probes and scrapers carry no token.
"""

from __future__ import annotations

import hmac
import logging
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from luftpause.config import TOKEN_ENV
from luftpause.errors import error_json

log = logging.getLogger(__name__)

_SCHEME = b"bearer "
_UNAUTHORIZED = error_json(f"missing or wrong bearer token (see {TOKEN_ENV})")


def token_from_env() -> str | None:
    """The token every /v1 request must carry, or None (with a warning) when the variable is unset."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        log.warning("%s is not set: the dataplane's /v1 routes accept every client", TOKEN_ENV)
    return token


def bearer_matches(authorization: bytes | None, token: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <token>` (scheme in any case)."""
    if authorization is None or authorization[: len(_SCHEME)].lower() != _SCHEME:
        return False
    return hmac.compare_digest(authorization[len(_SCHEME) :].strip(), token)


class BearerGate:
    """Decides whether a request may pass, and answers the ones that may not."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    def allows(self, scope: Scope) -> bool:
        if self._token is None:
            return True
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return bearer_matches(authorization, self._token)

    @staticmethod
    async def refuse(send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


class BearerAuth:
    """ASGI middleware: /v1 requests without the right bearer token are answered 401 here."""

    def __init__(self, app: ASGIApp, gate: BearerGate) -> None:
        self.app = app
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and guarded(scope["path"]) and not self._gate.allows(scope):
            await self._gate.refuse(send)
            return
        await self.app(scope, receive, send)


def guarded(path: str) -> bool:
    """Whether a path is one of the /v1 routes the token guards."""
    return path == "/v1" or path.startswith("/v1/")
