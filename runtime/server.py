"""The runtime's MCP server: spawn sub-agents, await them, and see them, over streamable HTTP.

`POST /mcp` speaks both wires of the `mcp` SDK: legacy stateful sessions (initialize, then
mcp-session-id) and the sessionless 2026-07-28 protocol. `GET /status` lists every run as JSON.
Each spawned run is a sub-agent whose loop (agent.py) runs as an asyncio task in this process;
every run is journaled (journal.py) and restored when the runtime starts again.

The tools' docstrings are what the harness model reads, so they say what each tool does and
returns in a sentence or two.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from luftpause import __version__
from luftpause.config import Config
from luftpause.runtime.agent import Agent
from luftpause.runtime.journal import Journal
from luftpause.runtime.llm import Dataplane
from luftpause.runtime.runs import (
    DEFAULT_AWAIT_TIMEOUT_S,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOOL_CALLS,
    MAX_AWAIT_TIMEOUT_S,
    AwaitMode,
    Runs,
    RunSpec,
    RunView,
    ServiceClass,
    UnknownRun,
)
from luftpause.runtime.tool_servers import ToolServers

log = logging.getLogger(__name__)

# How long spawn waits for tool servers still being connected to before judging its `tools`.
SPAWN_LISTING_WAIT_S = 5.0


class SpawnResult(BaseModel):
    handle: str = Field(description="the run's handle, for await, status and cancel")


class AwaitResult(BaseModel):
    runs: list[RunView] = Field(description="the awaited runs, in the order asked, each as it stands now")
    timedOut: bool = Field(description="true when the timeout passed before the runs were done")


class RunsResult(BaseModel):
    runs: list[RunView]


class Runtime:
    """The runtime's parts, wired together: journal, runs, sub-agent loop, tool servers."""

    def __init__(self, config: Config, state_dir: str | None = None) -> None:
        settings = config.runtime
        self.config = config
        self.state_dir = Path(state_dir or settings.state_dir)
        self.journal = Journal(self.state_dir)
        self.tool_servers = ToolServers(settings.mcp_servers)
        self.dataplane = Dataplane(settings.dataplane)
        self.agent = Agent(self.dataplane, self.tool_servers, settings.default_model)
        self.runs = Runs(self.journal, self.agent.drive, self.dataplane.end_run)

    async def start(self) -> None:
        self.tool_servers.start()
        self.runs.restore()
        log.info("runtime: journal at %s, dataplane at %s", self.journal.path, self.dataplane.base_url)

    async def stop(self) -> None:
        await self.runs.shutdown()
        await self.tool_servers.close()
        await self.dataplane.close()
        self.journal.close()

    async def spawn(self, spec: RunSpec, caller: str | None) -> str:
        if spec.tools is not None:
            await self._check_tool_names(spec.tools)
        return self.runs.spawn(spec, caller).handle

    async def _check_tool_names(self, names: list[str]) -> None:
        tools, unavailable = self.tool_servers.catalog()
        if all(n in tools for n in names):
            return
        if unavailable:
            await self.tool_servers.listed(SPAWN_LISTING_WAIT_S)
            tools, unavailable = self.tool_servers.catalog()
        unknown = [n for n in names if n not in tools]
        if unknown:
            message = (
                f"unknown tools: {', '.join(unknown)}. Available tools: {', '.join(sorted(tools)) or 'none'}."
            )
            if unavailable:
                message += " Not reachable now: " + "; ".join(unavailable) + "."
            raise ToolError(message)

    def status_document(self) -> dict[str, Any]:
        tools, _ = self.tool_servers.catalog()
        return {
            "runs": [run.summary() for run in self.runs],
            "toolServers": [
                {
                    "name": s.name,
                    "tools": [t.name for t in s.tools] if s.tools is not None else None,
                    "problem": s.problem,
                }
                for s in self.tool_servers.servers
            ],
            "tools": sorted(tools),
        }


def caller_of(ctx: Context) -> str | None:
    """Who spawns: the MCP session when the client has one, else the client's name and version."""
    headers = ctx.headers
    session_id = headers.get("mcp-session-id") if headers is not None else None
    if session_id:
        return session_id
    params = ctx.session.client_params
    info = params.client_info if params is not None else None
    if info is not None and info.name:
        return f"{info.name}/{info.version}" if info.version else info.name
    return None


def build_mcp(runtime: Runtime) -> MCPServer:
    """The MCP server with the runtime's tools."""
    mcp = MCPServer(
        "luftpause",
        version=__version__,
        instructions=(
            "Sub-agents on a shared model pool. spawn starts one and returns a handle at once; "
            "spawn several to work in parallel, then await them together. Runs survive restarts."
        ),
    )

    def tool(name: str | None = None):
        # The SDK passes docstrings through with their indentation; the model should not see it.
        def register(fn):
            mcp.add_tool(fn, name=name, description=inspect.cleandoc(fn.__doc__ or ""))
            return fn

        return register

    @tool()
    async def spawn(
        task: Annotated[str, Field(description="what the sub-agent should do: its first user message")],
        ctx: Context,
        model: Annotated[str | None, Field(description="model to run on; default: the runtime's")] = None,
        serviceClass: Annotated[
            ServiceClass, Field(description="interactive (someone waits on it) or batch (background)")
        ] = "interactive",
        system: Annotated[str | None, Field(description="system prompt for the sub-agent")] = None,
        maxToolCalls: Annotated[
            int, Field(ge=0, description="tool calls the sub-agent may make before it must answer")
        ] = DEFAULT_MAX_TOOL_CALLS,
        tools: Annotated[
            list[str] | None, Field(description="names of the tools it may use; default: all")
        ] = None,
        maxTokens: Annotated[
            int, Field(ge=0, description="reply length limit per model turn; 0 leaves it to the engine")
        ] = DEFAULT_MAX_TOKENS,
    ) -> SpawnResult:
        """Start a sub-agent on `task` and return its handle at once, without waiting for it.

        The sub-agent answers with the help of the tool servers' tools; collect its answer with await.
        """
        spec = RunSpec(
            task=task,
            model=model or runtime.config.runtime.default_model,
            serviceClass=serviceClass,
            system=system,
            maxToolCalls=maxToolCalls,
            tools=tools,
            maxTokens=maxTokens,
        )
        return SpawnResult(handle=await runtime.spawn(spec, caller_of(ctx)))

    @tool(name="await")
    async def await_runs(
        handles: Annotated[list[str], Field(min_length=1, description="handles returned by spawn")],
        mode: Annotated[AwaitMode, Field(description="all: wait for every run; any: for the first")] = "all",
        timeout: Annotated[  # noqa: ASYNC109 (the tool's argument, part of its contract)
            float, Field(ge=0, description=f"seconds to wait, at most {MAX_AWAIT_TIMEOUT_S:.0f}")
        ] = DEFAULT_AWAIT_TIMEOUT_S,
    ) -> AwaitResult:
        """Wait until all (or any) of the runs are done, or the timeout passes; return each run's
        status, result, error, toolCalls, failedToolCalls and turns, and whether it timed out.

        Runs still running after a timeout keep going: await them again.
        """
        try:
            runs, timed_out = await runtime.runs.wait(handles, mode, timeout)
        except UnknownRun as e:
            raise ToolError(str(e)) from None
        return AwaitResult(runs=[r.view() for r in runs], timedOut=timed_out)

    @tool()
    async def status(
        handle: Annotated[str | None, Field(description="one run's handle; omit for every run")] = None,
    ) -> RunsResult:
        """Return runs as they stand now, without waiting: one run, or every run this runtime knows."""
        try:
            runs = [runtime.runs.get(handle)] if handle is not None else list(runtime.runs)
        except UnknownRun as e:
            raise ToolError(str(e)) from None
        return RunsResult(runs=[r.view() for r in runs])

    @tool()
    async def cancel(handle: Annotated[str, Field(description="the run to cancel")]) -> RunView:
        """Cancel a running run and return it; its status becomes cancelled. A run already done is returned unchanged."""
        try:
            run = await runtime.runs.cancel(handle)
        except UnknownRun as e:
            raise ToolError(str(e)) from None
        return run.view()

    @mcp.custom_route("/status", methods=["GET"])
    async def status_route(request: Request) -> JSONResponse:
        return JSONResponse(runtime.status_document())

    return mcp


def build_app(config: Config, state_dir: str | None = None) -> Starlette:
    """The ASGI app: /mcp and /status, with the runtime started and stopped by its lifespan."""
    runtime = Runtime(config, state_dir)
    mcp = build_mcp(runtime)
    app = mcp.streamable_http_app(host=config.runtime.host)
    session_manager_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            async with session_manager_lifespan(a):
                yield
        finally:
            await runtime.stop()

    app.router.lifespan_context = lifespan
    app.state.runtime = runtime
    return app


def serve(config: Config, state_dir: str | None = None) -> None:
    """Serves the runtime on config.runtime.host:port until SIGINT or SIGTERM."""
    app = build_app(config, state_dir)
    settings = config.runtime
    if not log.isEnabledFor(logging.DEBUG):
        # One line per HTTP request to the dataplane and the tool servers drowns everything else.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    log.info("runtime: MCP at http://%s:%d/mcp, status at /status", settings.host, settings.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            access_log=False,
            # An await may hold its request open for minutes; do not wait for it on shutdown.
            timeout_graceful_shutdown=3,
        )
    )
    server.run()
