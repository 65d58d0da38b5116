"""The fake MCP tool server: `lookup` and `deep_search`, which wait about a second and return filler.

It stands in for the tool servers a sub-agent calls (Wikipedia, search) so that a fan-out of
sub-agents has real tool latency to overlap. Streamable HTTP at `/mcp`, served straight (no mount,
so `POST /mcp` answers without a redirect), both the legacy session wire and the sessionless one,
and `GET /health` for whoever waits for it to come up; or over stdio (`serve_stdio`), as a
harness launches a local tool server. The text it returns is a deterministic function of the
query; only the delay is random, unless a fixed latency is set for benchmarks (every call then
takes exactly that long; the description's benchmarks fix lookup at 2 s).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import time

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from luftpause import logs, tracing
from luftpause.runtime.tool_servers import IDEMPOTENCY_META_KEY

log = logging.getLogger(__name__)

# A file every call is appended to as it starts, when set (see `_record`).
CALLS_ENV = "LUFTPAUSE_FAKE_MCP_CALLS"

LOOKUP_DELAY_S = (0.8, 1.2)
"""A quick look-up against a remote API: about a second, give or take."""

DEEP_SEARCH_DELAY_S = (1.0, 1.5)
"""Several look-ups folded into one answer: a bit slower than `lookup`."""

_SENTENCES = (
    "Several sources describe it in similar terms.",
    "The earliest records mention it only briefly.",
    "Later accounts add detail but agree on the main points.",
    "Figures vary between sources by a few percent.",
    "It is often compared with related topics of the same period.",
    "Recent summaries emphasise its practical side.",
    "Some details remain disputed among specialists.",
    "A short overview is usually enough for most purposes.",
)

# Both tools only read: a runtime that asks the user before destructive tool calls must not ask here.
_READ_ONLY = ToolAnnotations(
    read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
)


def _filler(query: str, sentences: int) -> str:
    digest = hashlib.sha256(query.encode()).digest()
    return " ".join(_SENTENCES[digest[i] % len(_SENTENCES)] for i in range(sentences))


def tool_answer(tool: str, query: str) -> str:
    """What `tool` answers to `query` (without the wait): the simulator uses the same text."""
    if tool == "deep_search":
        return f"Deep search summary for '{query}': {_filler(query + '#deep', 5)}"
    return f"Lookup result for '{query}': {_filler(query, 2)}"


def _record(tool: str, query: str, ctx: Context) -> None:
    """With $LUFTPAUSE_FAKE_MCP_CALLS naming a file, every call is appended to it as it starts:
    the tool, its query and the idempotency key its request carried (bench/faults.py counts
    the calls made twice)."""
    path = os.environ.get(CALLS_ENV)
    if not path:
        return
    meta = ctx.request_context.meta or {}
    entry = {
        "tool": tool,
        "query": query,
        "key": meta.get(IDEMPOTENCY_META_KEY),
        "pid": os.getpid(),
        "at": time.time(),
    }
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


async def lookup(query: str, ctx: Context) -> str:
    """Look up a short fact or definition. Give a focused query (a name, a term or a question);
    returns a few sentences of reference text about it. Takes about a second."""
    _record("lookup", query, ctx)
    await asyncio.sleep(_delay(LOOKUP_DELAY_S, _fixed_lookup_s))
    return tool_answer("lookup", query)


async def deep_search(query: str, ctx: Context) -> str:
    """Search several sources in depth and return a longer summary of what they say about the
    query. Slower than lookup (one to one and a half seconds); use it when a short fact is not
    enough."""
    _record("deep_search", query, ctx)
    await asyncio.sleep(_delay(DEEP_SEARCH_DELAY_S, _fixed_lookup_s))
    return tool_answer("deep_search", query)


# Set by `fixed_latency(...)`: benchmarks want every tool call to take the same time.
_fixed_lookup_s: float | None = None


def fixed_latency(seconds: float | None) -> None:
    """Every tool call takes exactly `seconds` (None: the random delays above)."""
    global _fixed_lookup_s
    _fixed_lookup_s = seconds


def _delay(spread: tuple[float, float], fixed: float | None) -> float:
    return fixed if fixed is not None else random.uniform(*spread)


def create_server() -> MCPServer:
    server = MCPServer(
        name="fake-mcp",
        instructions="Fake tools for testing luftpause: lookup for a quick fact, deep_search for a longer summary.",
        version="0.1.0",
        log_level="WARNING",
    )
    for fn in (lookup, deep_search):
        server.add_tool(fn, annotations=_READ_ONLY, structured_output=False)

    @server.custom_route("/health", methods=["GET"])
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return server


def create_app(host: str = "127.0.0.1") -> Starlette:
    """The ASGI app; `host` decides whether DNS-rebinding protection is on (it is on loopback)."""
    return create_server().streamable_http_app(streamable_http_path="/mcp", host=host)


def serve_stdio(fixed_latency_s: float | None = None) -> None:
    """Serves MCP on stdin/stdout until the client closes them."""
    import anyio

    fixed_latency(fixed_latency_s)
    anyio.run(create_server().run_stdio_async)


def serve(host: str, port: int, fixed_latency_s: float | None = None) -> None:
    """Runs the fake MCP server until SIGTERM or SIGINT."""
    # Traced like the services (its tools/call spans are the `mcp` SDK's), when the endpoint is set.
    tracing.setup("luftpause-fake-mcp")
    fixed_latency(fixed_latency_s)
    app = create_app(host)
    log.info("fake MCP server on http://%s:%d/mcp (tools: lookup, deep_search)", host, port)
    # Legacy sessions keep a GET stream open; a short grace period stops shutdown waiting on it.
    uvicorn.run(
        app, host=host, port=port, log_config=None, access_log=logs.access_log(), timeout_graceful_shutdown=2
    )
