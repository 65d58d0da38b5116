"""Who is asking: the caller of an MCP request, and which runs it may see, await and cancel.

A run's `caller` is the identity its turns carry to the scheduler (`x-luftpause-caller`), which
keeps one caller from starving another:

- on the legacy wire (initialize, then `mcp-session-id`) it is the session id, so two instances
  of one client are two callers;
- on the sessionless 2026-07-28 wire there is no session, so it is the client's declared name
  (`name/version` from its clientInfo) followed by `@` and the `x-luftpause-caller` header the
  client sends, or else the identity of its bearer token (`token:` and the first 8 hex digits of
  the token's SHA-256). Two sessionless instances of one client that send neither are one caller.

A run's `owner` is the same name and header or bearer without the session (on the sessionless
wire, its caller). A request may see, await, cancel and approve a run it spawned (the same
caller), a run restored from the journal whose owner it is (a legacy session does not survive a
restart, so its client comes back on a new one), or any run when it carries the operator token
(`LUFTPAUSE_OPERATOR_TOKEN`, luftpause/config.py). Runs journaled before owners were recorded are everyone's.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from luftpause.lifecycle import CALLER_HEADER
from luftpause.runtime.run import UnknownRun

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Who:
    """The identity of one MCP request."""

    caller: str
    owner: str
    operator: bool = False

    def may_see(self, run: Any) -> bool:
        """Whether this request may see and act on `run` (see the module's docstring)."""
        if self.operator or run.owner is None or run.caller == self.caller:
            return True
        return run.restored and run.owner == self.owner


def _headers(ctx: Any) -> Any:
    # The tools' Context has .headers; a ServerRequestContext (the Tasks extension) has .request.
    headers = getattr(ctx, "headers", None)
    if headers is None:
        headers = getattr(getattr(ctx, "request", None), "headers", None)
    return headers if headers is not None else {}


def _client_name(ctx: Any) -> str | None:
    params = ctx.session.client_params
    info = params.client_info if params is not None else None
    if info is None or not info.name:
        return None
    return f"{info.name}/{info.version}" if info.version else info.name


def _bearer(headers: Any) -> str | None:
    scheme, _, value = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def token_identity(token: str) -> str:
    """A bearer token as an identity that does not reveal it."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]


def who_of(ctx: Any, operator_token: str | None) -> Who:
    """The identity of the request `ctx` belongs to; `operator_token` is the runtime's, if any."""
    headers = _headers(ctx)
    bearer = _bearer(headers)
    operator = bool(
        operator_token and bearer and hmac.compare_digest(bearer.encode(), operator_token.encode())
    )
    declared = (headers.get(CALLER_HEADER) or "").strip() or None
    tag = declared or ("operator" if operator else token_identity(bearer) if bearer else None)
    name = _client_name(ctx) or ANONYMOUS
    owner = f"{name}@{tag}" if tag else name
    session = headers.get("mcp-session-id")
    return Who(caller=session or owner, owner=owner, operator=operator)


class NotYours(UnknownRun):
    """The run exists, but the request may not see it."""

    def __init__(self, handle: str) -> None:
        LookupError.__init__(
            self,
            f"run {handle} was spawned by another caller: only that caller (or the operator token) "
            "can see it, await it or cancel it",
        )
