"""The dataplane service: an OpenAI-compatible proxy in front of the engine pool, on port 8080.

Routes: `POST /v1/chat/completions` (the per-turn path, `proxy.Proxy`), `GET /v1/models` (the
models the pool's replicas serve), `DELETE /v1/runs/{run_id}` (the agent ends a run) and
`GET /health`. `serve(config)` runs it under uvicorn until SIGTERM or SIGINT.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from luftpause import config as lp_config
from luftpause.dataplane import headers
from luftpause.dataplane.errors import error_response
from luftpause.dataplane.proxy import Proxy

log = logging.getLogger(__name__)

# How long a stopping dataplane lets turns in flight finish before it closes their connections.
SHUTDOWN_GRACE_S = 5


def create_app(config: lp_config.Config) -> FastAPI:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.open()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="luftpause dataplane", lifespan=lifespan)
    app.state.proxy = proxy
    app.router.routes.append(Route("/v1/chat/completions", endpoint=proxy, methods=["POST"]))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(422, f"invalid request: {exc.errors()}")

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

    @app.delete("/v1/runs/{run_id}", status_code=204)
    async def end_run(run_id: str) -> Response:
        proxy.end_run(run_id)
        return Response(status_code=204, headers={headers.RUN_ID: run_id})

    return app


def serve(config: lp_config.Config) -> None:
    """Runs the dataplane on config.dataplane.host:port until SIGTERM or SIGINT."""
    settings = config.dataplane
    log.info("dataplane on http://%s:%d, scheduler at %s", settings.host, settings.port, settings.scheduler)
    uvicorn.run(
        create_app(config),
        host=settings.host,
        port=settings.port,
        # The CLI configured logging already; per-request access lines would cost more than the turn.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
