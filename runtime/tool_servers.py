"""The upstream MCP tool servers whose tools sub-agents call.

One `mcp.Client` per configured server, over streamable HTTP (`url`) or over stdio (`command`:
the runtime starts the server as its child process), held open by a task of its own
(the SDK's client must be entered and left in the same task) and shared by every run. At startup
a background task per server connects and lists its tools, trying again every `RETRY_S` while the
server is not up, so the runtime may start before its tool servers; the list is kept from then on.
A transport failure during a call drops the connection and the next call reconnects; the call
that hit it fails, and the model is told so. So does a server that closed the connection (a stdio
server that exited: the SDK fails every request on it with CONNECTION_CLOSED from then on). A call
that takes longer than `CALL_TIMEOUT_S` fails the same way, and so does a connection not made
within `CONNECT_TIMEOUT_S`, so one hung tool server cannot hold a run forever.

Tool names are global across servers: the first configured server offering a name wins.

Tool calls are at most once: each is journaled as sent before it leaves, and one in flight when
the runtime dies is not made again (runtime/agent.py `UNKNOWN_OUTCOME`). Each carries an
idempotency key in its request's `_meta` (`luftpause/idempotency-key`: run, round, call index),
which no other call shares, so a server can tell calls apart and log them by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mcp_types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from luftpause.config import McpServer

log = logging.getLogger(__name__)

# How often an unreachable server is tried again.
RETRY_S = 1.0
# How long after startup runs wait for tool servers that are not listed yet (they may be starting
# alongside the runtime); later, a run starts at once with the tools that are listed.
STARTUP_GRACE_S = 15.0
# Longest one tool call may take before the model is told it failed.
CALL_TIMEOUT_S = 300.0
# Longest a connection to a tool server may take (a stdio server started, or a URL answered, and
# the MCP handshake done) before the call or listing that asked for it fails.
CONNECT_TIMEOUT_S = 30.0
# The `_meta` key naming a call's idempotency key (runtime/agent.py `idempotency_key`).
IDEMPOTENCY_META_KEY = "luftpause/idempotency-key"


class ToolServerUnavailable(Exception):
    """A tool server could not be reached or listed; the message says which and why."""


@dataclass(frozen=True)
class UpstreamTool:
    """One tool as a sub-agent sees it, and the server that runs it."""

    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    # The server's hints about the tool (readOnlyHint, destructiveHint, ...), by their wire names.
    annotations: dict[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's function-calling format."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool


class ToolServer:
    """One upstream server: its connection and its tool list."""

    def __init__(self, spec: McpServer, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.spec = spec
        self.call_timeout_s = call_timeout_s
        self.name = spec.name
        self.tools: list[UpstreamTool] | None = None
        # Why the tools are not listed yet; None while the first attempt is under way.
        self.problem: str | None = None
        self.ready = asyncio.Event()
        self._client: Client | None = None
        self._holder: asyncio.Task[None] | None = None
        self._release: asyncio.Event | None = None
        self._lock = asyncio.Lock()

    async def keep_listing(self) -> None:
        """Connects and lists the tools, trying again every `RETRY_S` until it succeeds."""
        failures = 0
        while True:
            try:
                async with self._lock:
                    client = await self._connected()
                listed = await _list_all(client)
            except Exception as e:
                await self._disconnect()
                self.problem = f"tool server {self.name} is unavailable: {_describe(e)}"
                if failures % 30 == 0:
                    log.warning("%s; trying again every %.0f s", self.problem, RETRY_S)
                failures += 1
                await asyncio.sleep(RETRY_S)
                continue
            self.tools = [
                UpstreamTool(
                    server=self.name,
                    name=t.name,
                    description=t.description or t.title or t.name,
                    input_schema=t.input_schema or {"type": "object", "properties": {}},
                    annotations=t.annotations.model_dump(by_alias=True, exclude_none=True)
                    if t.annotations is not None
                    else None,
                )
                for t in listed
            ]
            self.problem = None
            self.ready.set()
            log.info(
                "tool server %s offers %s", self.name, ", ".join(t.name for t in self.tools) or "no tools"
            )
            return

    async def call(self, name: str, arguments: dict[str, Any], idempotency_key: str = "") -> ToolResult:
        """Calls one tool; a transport failure becomes an error result and drops the connection.
        A non-empty `idempotency_key` goes in the request's `_meta` (IDEMPOTENCY_META_KEY)."""
        # RequestParamsMeta is an open map (PEP 728's extra_items), which mypy does not read yet.
        meta = (
            cast(mcp_types.RequestParamsMeta, {IDEMPOTENCY_META_KEY: idempotency_key})
            if idempotency_key
            else None
        )
        client = None
        try:
            async with self._lock:
                client = await self._connected()
            result = await asyncio.wait_for(client.call_tool(name, arguments, meta=meta), self.call_timeout_s)
        except TimeoutError:
            await self._disconnect()
            return ToolResult(
                f"tool {name} on {self.name} gave no result within {self.call_timeout_s:.0f} s", is_error=True
            )
        except MCPError as e:
            if e.error.code == mcp_types.CONNECTION_CLOSED and self._client is client:
                await self._disconnect()  # the server went away: the next call starts it again
            return ToolResult(f"tool {name} failed: {e}", is_error=True)
        except Exception as e:
            await self._disconnect()
            return ToolResult(f"tool server {self.name} failed during {name}: {_describe(e)}", is_error=True)
        return ToolResult(render_result(result), is_error=bool(result.is_error))

    async def _connected(self) -> Client:
        if self._client is not None and self._holder is not None and not self._holder.done():
            return self._client
        target: str | StdioServerParameters
        if self.spec.url is not None:
            target = self.spec.url
        else:
            assert self.spec.command
            target = StdioServerParameters(command=self.spec.command[0], args=list(self.spec.command[1:]))
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        release = asyncio.Event()
        self._release = release
        self._holder = asyncio.create_task(self._hold(target, ready, release), name=f"mcp:{self.name}")
        try:
            self._client = await asyncio.wait_for(asyncio.shield(ready), CONNECT_TIMEOUT_S)
        except TimeoutError:
            await self._disconnect(stop_connecting=True)
            if ready.done() and not ready.cancelled():
                ready.exception()  # the holder's own account of the cancelled connection: not needed
            raise ToolServerUnavailable(
                f"tool server {self.name} did not finish connecting within {CONNECT_TIMEOUT_S:.0f} s"
            ) from None
        return self._client

    async def _hold(
        self, target: str | StdioServerParameters, ready: asyncio.Future[Client], release: asyncio.Event
    ) -> None:
        try:
            async with Client(target) as client:
                ready.set_result(client)
                await release.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(ToolServerUnavailable(f"connecting to {self.name} was cancelled"))
            raise
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                log.warning("tool server %s: connection closed: %s", self.name, _describe(e))

    async def _disconnect(self, stop_connecting: bool = False) -> None:
        """Lets go of the connection; `stop_connecting`: one still being made is given up at once."""
        holder, release = self._holder, self._release
        self._client = self._holder = self._release = None
        if release is not None:
            release.set()
        if holder is not None and stop_connecting:
            holder.cancel()
        if holder is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(holder, timeout=5)


async def _list_all(client: Client) -> list[mcp_types.Tool]:
    listed: list[mcp_types.Tool] = []
    cursor = None
    while True:
        page = await client.list_tools(cursor=cursor)
        listed.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return listed


class ToolServers:
    """All configured tool servers, seen as one catalog of tools."""

    def __init__(self, specs: Sequence[McpServer]) -> None:
        self.servers = [ToolServer(s) for s in specs]
        self._listers: list[asyncio.Task[None]] = []
        self._started = time.monotonic()

    def start(self) -> None:
        """Starts connecting to every server in the background."""
        self._started = time.monotonic()
        self._listers = [asyncio.create_task(s.keep_listing(), name=f"list:{s.name}") for s in self.servers]

    def catalog(self) -> tuple[dict[str, UpstreamTool], list[str]]:
        """Every listed tool by name, and why each server not listed yet is not."""
        tools: dict[str, UpstreamTool] = {}
        unavailable: list[str] = []
        for server in self.servers:
            if server.tools is None:
                unavailable.append(server.problem or f"tool server {server.name} is still being connected to")
                continue
            for tool in server.tools:
                if tool.name in tools:
                    log.debug(
                        "tool %s of %s is hidden by the one of %s",
                        tool.name,
                        server.name,
                        tools[tool.name].server,
                    )
                    continue
                tools[tool.name] = tool
        return tools, unavailable

    async def settled(self) -> None:
        """Waits for unlisted servers while the runtime is young (`STARTUP_GRACE_S`), so that a run
        resumed or spawned right at startup does not miss the tools of a server still starting."""
        remaining = STARTUP_GRACE_S - (time.monotonic() - self._started)
        if remaining > 0:
            await self.listed(remaining)

    async def listed(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) until every server that can be listed has been."""
        pending = [s.ready.wait() for s in self.servers if not s.ready.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), timeout_s)

    async def call(
        self, tool: UpstreamTool, arguments: dict[str, Any], idempotency_key: str = ""
    ) -> ToolResult:
        server = next(s for s in self.servers if s.name == tool.server)
        return await server.call(tool.name, arguments, idempotency_key)

    async def close(self) -> None:
        for t in self._listers:
            t.cancel()
        await asyncio.gather(*self._listers, return_exceptions=True)
        await asyncio.gather(*(s._disconnect() for s in self.servers), return_exceptions=True)


def render_result(result: mcp_types.CallToolResult) -> str:
    """A tool result as the text of a role "tool" message."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(
            block.resource, mcp_types.TextResourceContents
        ):
            parts.append(block.resource.text)
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{block.type} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _describe(e: BaseException) -> str:
    # The SDK and anyio wrap transport errors in exception groups; the first leaf says the most.
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if str(e) else text
