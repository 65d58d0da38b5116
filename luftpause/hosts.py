"""Which Host and Origin the services' HTTP routes answer: no DNS rebinding, no cross-site calls.

A browser on the operator's machine will send requests to 127.0.0.1 for any page that asks: a
page whose own name resolves to 127.0.0.1 (DNS rebinding) arrives with a foreign `Host`, and a
page on another site calling `http://localhost:7000/mcp` arrives with a foreign `Origin`. Either
could spawn runs, read statuses or spend engine time. So every HTTP route of the dataplane, the
runtime and the scheduler's status server answers 403 to a request whose `Host`, or whose
`Origin` when it has one, names a host not allowed, whatever address the service binds.

Allowed are the loopback names, this machine's own name, every host the config itself names
(the services' bind hosts unless they are wildcards, the dataplane URL the runtime calls, the
scheduler address the dataplane dials: in a container those are the service names), and the
config's `allowed_hosts`, which is where a name or address the services are reached by from
elsewhere goes. `allowed_hosts = ["*"]` turns the check off. Requests without an `Origin` (the
agents, the MCP clients, curl) are judged by their `Host` alone.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from luftpause import config as lp_config
from luftpause.errors import error_json

LOOPBACK = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = ("", "0.0.0.0", "::")


def allowed_hosts(config: lp_config.Config) -> frozenset[str]:
    """The host names (no ports, lower case) the services answer to; "*" among them: any."""
    names = {*LOOPBACK, *(h.lower() for h in config.allowed_hosts)}
    try:
        names.add(socket.gethostname().lower())
    except OSError:
        pass
    for bind in (config.scheduler.host, config.dataplane.host, config.runtime.host):
        if bind not in _WILDCARD_BINDS:
            names.add(bind.lower())
    for url in (config.runtime.dataplane, f"//{config.dataplane.scheduler}"):
        host = urlsplit(url).hostname
        if host:
            names.add(host.lower())
    return frozenset(names)


def _host_of(authority: str) -> str:
    """`name`, `name:port`, `[v6]:port` -> the host, lower case."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def origin_host(origin: str) -> str | None:
    """The host of an `Origin` value, or None for an opaque one ("null")."""
    return urlsplit(origin).hostname if origin and origin != "null" else None


class HostGuard:
    """ASGI middleware: 403 for a request whose Host, or Origin, is not among `allowed`."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed
        self._any = "*" in allowed

    def allows_origin(self, origin: str | None) -> bool:
        """Whether a browser page of this origin may call us (and read the answer)."""
        if origin is None or self._any:
            return True
        host = origin_host(origin)
        return host is not None and host.lower() in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._any:
            headers = dict(scope.get("headers") or [])
            host = _host_of(headers.get(b"host", b"").decode("latin-1"))
            origin = headers.get(b"origin")
            problem = None
            if host and host not in self.allowed:
                problem = f"host {host!r} is not one this service answers to"
            elif origin is not None and not self.allows_origin(origin.decode("latin-1")):
                problem = f"requests from pages of {origin.decode('latin-1')!r} are not accepted"
            if problem is not None:
                await _refuse(send, f"{problem}; add the name to allowed_hosts in the config to allow it")
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send, message: str) -> None:
    body = error_json(message)
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
