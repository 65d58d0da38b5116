"""Bearer tokens on the services' HTTP routes and gRPC calls (`LUFTPAUSE_TOKEN`).

One rule for every service: a request carries `Authorization: Bearer <token>` (the scheme in any
case), and the token is compared in constant time so that its bytes cannot be found one at a
time by timing. `BearerAuth` is the one ASGI middleware that applies it: each service says which
requests it guards and how a refusal reads (the dataplane answers the house error body, the
runtime a JSON-RPC error on /mcp), and a request it does not guard passes untouched.
`token_from_env` is how every service and command reads the token, an empty variable as none.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from luftpause.config import TOKEN_ENV

log = logging.getLogger(__name__)

_SCHEME = b"bearer "


def token_from_env(unguarded: str | None = None, name: str = TOKEN_ENV) -> str | None:
    """The token in the variable `name` (LUFTPAUSE_TOKEN), None when it is unset or empty; with
    `unguarded` (what is open without it), a service's warning that it is not set."""
    token = os.environ.get(name) or None
    if token is None and unguarded is not None:
        log.warning("%s is not set: %s", name, unguarded)
    return token


def bearer_matches(authorization: bytes | None, token: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <token>` (scheme in any case)."""
    if authorization is None or authorization[: len(_SCHEME)].lower() != _SCHEME:
        return False
    return hmac.compare_digest(authorization[len(_SCHEME) :].strip(), token)


def authorization_of(scope: Scope) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)


class Tokens:
    """The tokens a request may carry (any one of them lets it in); none at all lets everyone in."""

    def __init__(self, *tokens: str | None) -> None:
        self._tokens = [t.encode() for t in tokens if t]

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def allow(self, scope: Scope) -> bool:
        if not self._tokens:
            return True
        authorization = authorization_of(scope)
        return any(bearer_matches(authorization, token) for token in self._tokens)


# (the request's scope, its send) -> the 401 written.
Refusal = Callable[[Scope, Send], Awaitable[None]]


class BearerAuth:
    """ASGI middleware: a guarded request without one of `tokens` gets `refuse` instead of the app."""

    def __init__(
        self, app: ASGIApp, tokens: Tokens, guarded: Callable[[Scope], bool], refuse: Refusal
    ) -> None:
        self.app, self.tokens, self.guarded, self.refuse = app, tokens, guarded, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.guarded(scope) and not self.tokens.allow(scope):
            await self.refuse(scope, send)
            return
        await self.app(scope, receive, send)


async def send_401(send: Send, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A 401 with a JSON body, as the services write it below the web framework."""
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
