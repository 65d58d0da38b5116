"""Bearer-token auth for the dataplane's `/v1` routes, from `LUFTPAUSE_TOKEN` (luftpause/bearer.py).

With the variable set, every request under `/v1` must carry `Authorization: Bearer <token>`;
anything else gets a 401 with the house error body before any of our routes runs. Without the
variable everyone is let in, and the service says so in a warning at start. `/health` and
`/metrics` stay open: probes and scrapers carry no token. The turn path checks the same tokens
itself (`app.DataplaneApp`), ahead of the middleware that guards the other routes.
"""

from __future__ import annotations

import logging

from starlette.types import Scope, Send

from luftpause import bearer
from luftpause.bearer import BearerAuth, send_401

__all__ = ["BearerAuth", "guarded", "refuse", "token_from_env"]
from luftpause.config import TOKEN_ENV
from luftpause.errors import error_json

log = logging.getLogger(__name__)

_UNAUTHORIZED = error_json(f"missing or wrong bearer token (see {TOKEN_ENV})")


def token_from_env() -> str | None:
    """The token every /v1 request must carry, or None (with a warning) when the variable is unset."""
    return bearer.token_from_env("the dataplane's /v1 routes accept every client")


async def refuse(scope: Scope, send: Send) -> None:
    await send_401(send, _UNAUTHORIZED)


def guarded(scope: Scope) -> bool:
    """Whether a request is for one of the /v1 routes the token guards."""
    path: str = scope["path"]
    return path == "/v1" or path.startswith("/v1/")
