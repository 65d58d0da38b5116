"""The runtime's MCP server: spawn sub-agents, await them, see them, approve their tool calls.

`POST /mcp` speaks both wires of the `mcp` SDK: legacy stateful sessions (initialize, then
mcp-session-id) and the sessionless 2026-07-28 protocol. `GET /status` returns the run tree as
JSON, with CORS headers for the allowed origins so that the scheduler's status page can show it;
`GET /metrics` the runtime's Prometheus metrics (metrics.py).
The tools are in mcp_tools.py and the parts they use in parts.py. Each spawned run is a
sub-agent whose loop (agent.py) runs as an asyncio task in this process; every run is journaled
(journal.py) and restored when the runtime starts again (restore.py); one runtime at a time may
use a state directory (state_lock.py).

Approvals reach the harness user while an await or run covers the run, if the client advertises
elicitation (elicitation.py). Tasks clients get run as a task (tasks.py). With `LUFTPAUSE_TOKEN`
set, /mcp, /status and /metrics need it as a bearer token (auth.py). A request body is at most
`[runtime] max_body_bytes` (`BodyLimit`); the port's other bounds are luftpause/http_server.py's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from luftpause import __version__, http_server, logs, tracing
from luftpause.bearer import Tokens, token_from_env
from luftpause.config import OPERATOR_TOKEN_ENV, Config
from luftpause.errors import error_body
from luftpause.hosts import HostGuard, allowed_hosts
from luftpause.runtime import auth
from luftpause.runtime.arguments import readable_arguments_error
from luftpause.runtime.auth import cors_headers
from luftpause.runtime.mcp_tools import register_tools
from luftpause.runtime.metrics import CONTENT_TYPE
from luftpause.runtime.parts import Runtime
from luftpause.runtime.state_lock import StateDirInUse
from luftpause.runtime.store import StoreUnavailable
from luftpause.runtime.tasks import TasksExtension

log = logging.getLogger(__name__)


class RuntimeMCP(MCPServer):
    """The SDK's server, with arguments that fail the tool's schema refused in one sentence (the
    SDK's own message is pydantic's, with a URL per error) instead of a validation dump."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if isinstance(e.__cause__, ValidationError) and not isinstance(e, UnexpectedToolError):
                raise ToolError(readable_arguments_error(name, e.__cause__)) from None
            raise


class BodyLimit:
    """Refuses a request body over `limit` bytes with a 413 whose JSON error names the limit and its
    config key, from the Content-Length when there is one, else once the body has grown past it.

    The mcp SDK has a limit of its own, answered in plain text that an MCP client cannot show; it
    is given the same limit, behind this one, so it never answers. The body is read here whole
    (as the SDK does) and handed on as one message.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(int(declared), scope, receive, send)
            return
        body, first = bytearray(), None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client left: the app sees it
                break
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(None, scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        queued: list[Message] = [first] if first else [{"type": "http.request", "body": bytes(body)}]

        async def replay() -> Message:
            return queued.pop() if queued else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, size: int | None, scope: Scope, receive: Receive, send: Send) -> None:
        what = f"{size:,} bytes" if size is not None else "longer than that"
        message = (
            f"request body is {what}; this runtime takes at most {self.limit:,} bytes "
            "(raise [runtime] max_body_bytes in the config to allow more)"
        )
        await JSONResponse(error_body(message), status_code=413, headers={"connection": "close"})(
            scope, receive, send
        )


def build_mcp(runtime: Runtime) -> MCPServer:
    """The MCP server with the runtime's tools, and the Tasks extension."""
    mcp = RuntimeMCP(
        "luftpause",
        version=__version__,
        instructions=(
            "Sub-agents on a shared model pool. spawn starts one and returns a handle at once; "
            "spawn several to work in parallel, then await them together. run does both for one. "
            "Runs survive restarts. A run shown as AwaitingApproval waits for approve."
        ),
        extensions=[TasksExtension(runtime)],
    )
    register_tools(mcp, runtime)

    @mcp.custom_route("/status", methods=["GET", "OPTIONS"])
    async def status_route(request: Request) -> Response:
        cors = cors_headers(request.headers.get("origin"))
        if request.method == "OPTIONS":
            return Response(status_code=204, headers=cors)
        return JSONResponse(await runtime.status_document(), headers=cors)

    @mcp.custom_route("/metrics", methods=["GET"])
    async def metrics_route(_: Request) -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)

    return mcp


def build_app(config: Config, state_dir: str | None = None, token: str | None = None) -> Starlette:
    """The ASGI app: /mcp and /status, with the runtime started and stopped by its lifespan.

    `token` (default: `LUFTPAUSE_TOKEN` from the environment) guards /mcp and /status and is sent
    to the dataplane; without one everyone is accepted, with a warning.
    """
    if token is None:
        token = token_from_env("the runtime's /mcp and /status accept everyone")
    operator_token = token_from_env(name=OPERATOR_TOKEN_ENV)
    runtime = Runtime(config, state_dir, token=token, operator_token=operator_token)
    mcp = build_mcp(runtime)
    limit = config.runtime.max_body_bytes
    app = mcp.streamable_http_app(host=config.runtime.host, max_request_body_size=limit)
    # Behind the bearer check (added before it), so a stranger's body is never read.
    app.add_middleware(BodyLimit, limit=limit)
    if token is not None:
        app.add_middleware(
            auth.BearerAuth, tokens=Tokens(token, operator_token), guarded=auth.guarded, refuse=auth.refuse
        )
    # Added last, so it runs first: a foreign Host or Origin is refused before anything else.
    app.add_middleware(HostGuard, allowed=allowed_hosts(config))
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
    tracing.setup("luftpause-runtime")
    try:
        app = build_app(config, state_dir)
    except (StateDirInUse, StoreUnavailable) as e:
        raise SystemExit(f"luftpause runtime: {e}") from None
    settings = config.runtime
    log.info("runtime: MCP at http://%s:%d/mcp, status at /status", settings.host, settings.port)
    uv_config = http_server.uvicorn_config(
        app,
        settings,
        "runtime",
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=logs.access_log(),
        # An await may hold its request open for minutes; do not wait for it on shutdown.
        timeout_graceful_shutdown=3,
    )
    http_server.Server(uv_config, settings, "runtime").run()
