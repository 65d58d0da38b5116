"""The dataplane service: an OpenAI-compatible proxy in front of the engine pool, on port 8080.

Routes: `POST /v1/chat/completions` (the per-turn path, `proxy.Proxy`), `POST /v1/decide`
(`decide.Decide`), `GET /v1/models` (every model the pool serves),
`DELETE /v1/runs/{run_id}` (the agent ends a run), `GET /health` and `GET /metrics`
(Prometheus). With `LUFTPAUSE_TOKEN` set, every `/v1` route needs it as a bearer token
(`auth`). `serve(config)` runs it under uvicorn until SIGTERM or SIGINT, as one
process or as one worker of several sharing the port (`workers`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from luftpause import config as lp_config
from luftpause import http_server, logs, tracing
from luftpause.bearer import Tokens
from luftpause.dataplane import auth, headers
from luftpause.dataplane.answer import quiet_deliberate_cut_offs
from luftpause.dataplane.auth import token_from_env
from luftpause.dataplane.decide import Decide
from luftpause.dataplane.errors import TurnRefused, error_response, refusal_response
from luftpause.dataplane.metrics import CONTENT_TYPE
from luftpause.dataplane.openapi import describe_turn_routes
from luftpause.dataplane.proxy import Proxy
from luftpause.dataplane.scheduler_client import dataplane_name
from luftpause.hosts import HostGuard, allowed_hosts

log = logging.getLogger(__name__)

# How long a stopping dataplane lets turns in flight finish before it closes their connections.
SHUTDOWN_GRACE_S = 5


class DataplaneApp(FastAPI):
    """FastAPI for every route but the per-turn one, which goes straight to the proxy.

    FastAPI wraps each request, and each message a response sends, in several middleware
    layers; a streamed turn sends one message per engine chunk, and on that path the layers
    cost more than the proxy's own work. The proxy answers its own errors, so it needs none.
    """

    turn_path = "/v1/chat/completions"

    def __init__(self, proxy: Proxy, tokens: Tokens, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proxy, self.tokens = proxy, tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == self.turn_path and scope["method"] == "POST":
            if self.tokens.allow(scope):
                await self.proxy(scope, receive, send)
            else:
                await auth.refuse(scope, send)
            return
        await super().__call__(scope, receive, send)


def create_app(config: lp_config.Config, token: str | None = None, name: str = "") -> FastAPI:
    """The dataplane app; `token` is the bearer every /v1 request needs (None lets everyone in),
    and what it shows the scheduler's gRPC port, which asks for the same one; `name` is what it
    calls itself to the scheduler (`scheduler_client.dataplane_name`)."""
    proxy = Proxy(config, token, name)
    tokens = Tokens(token)
    quiet_deliberate_cut_offs()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.open()
        try:
            yield
        finally:
            await proxy.close()

    app = DataplaneApp(proxy, tokens, title="luftpause dataplane", lifespan=lifespan)
    app.state.proxy = proxy
    # Reached only by other methods on the turn path (a 405), the fast path takes the POSTs.
    app.router.routes.append(Route(DataplaneApp.turn_path, endpoint=proxy, methods=["POST"]))
    app.router.routes.append(Route("/v1/decide", endpoint=Decide(proxy), methods=["POST"]))
    app.add_middleware(auth.BearerAuth, tokens=tokens, guarded=auth.guarded, refuse=auth.refuse)
    generated = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe_turn_routes(generated(), DataplaneApp.turn_path, "/v1/decide")
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(422, f"invalid request: {exc.errors()}")

    _add_plain_routes(app, proxy, config)
    return app


def _add_plain_routes(app: FastAPI, proxy: Proxy, config: lp_config.Config) -> None:
    """The routes that are not turns: health, the models served, metrics, and a run's end."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "scheduler": "connected" if proxy.scheduler.connected else "reconnecting"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        served = dict.fromkeys(m for r in config.replicas for m in r.models)
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "luftpause"} for m in served],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)

    @app.delete("/v1/runs/{run_id:path}", status_code=204)
    async def end_run(run_id: str) -> Response:
        try:
            run_id = headers.path_run_id(run_id)
        except TurnRefused as refusal:
            return refusal_response(refusal)
        proxy.end_run(run_id)
        return Response(status_code=204, headers={headers.RUN_ID: headers.on_the_wire(run_id)})


def serve(config: lp_config.Config, worker: int | None = None, listen_fd: int | None = None) -> None:
    """Runs the dataplane on config.dataplane.host:port until SIGTERM or SIGINT: in this process,
    or as worker `worker` of several accepting on the inherited socket `listen_fd`."""
    settings = config.dataplane
    tracing.setup("luftpause-dataplane")
    name = dataplane_name(settings, worker)
    if worker is None:
        log.info("dataplane %s on http://%s:%d, scheduler at %s", name, settings.host, settings.port,
                 settings.scheduler)  # fmt: skip
    else:
        log.info("dataplane worker %d (%s), scheduler at %s", worker, name, settings.scheduler)
    # The port's bounds (head and body deadlines, connection limit, descriptor limit): http_server.
    uv_config = http_server.uvicorn_config(
        HostGuard(create_app(config, token_from_env(), name), allowed_hosts(config)),
        settings,
        "dataplane",
        host=settings.host,
        port=settings.port,
        # The CLI configured logging already; per-request access lines cost more than the turn, so
        # they are written only at DEBUG (luftpause/logs.py).
        log_config=None,
        access_log=logs.access_log(),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    sockets = None if listen_fd is None else [socket.socket(fileno=listen_fd)]
    http_server.Server(uv_config, settings, "dataplane").run(sockets=sockets)
