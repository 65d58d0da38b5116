"""A class-blind round-robin router, the real-process stand-in for the `router-round-robin` arm.

Forwards each `POST /v1/chat/completions` to the next engine in turn, unchanged, streamed or not,
and answers `DELETE /v1/runs/{id}` (what loadgen sends at a run's end) with 204, so loadgen
can point at it exactly as it points at the dataplane. Nothing else: no queue, no classes.

    python -m luftpause.bench.sim.round_robin_proxy --port 8090 --engines http://127.0.0.1:9001,http://127.0.0.1:9002
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Sequence

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def create_app(engines: Sequence[str], transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The router app; `transport` replaces the network (tests)."""
    turn = itertools.cycle(range(len(engines)))
    client = httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=512), transport=transport)

    async def chat(request: Request) -> Response:
        body = await request.body()
        target = engines[next(turn)] + "/v1/chat/completions"
        upstream = client.build_request(
            "POST", target, content=body, headers={"content-type": "application/json"}
        )
        reply = await client.send(upstream, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        media = reply.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), status_code=reply.status_code, media_type=media)

    async def run_ended(_: Request) -> Response:
        return Response(status_code=204)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/runs/{run_id}", run_ended, methods=["DELETE"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engines", required=True, help="comma-separated engine base URLs")
    args = parser.parse_args(argv)
    engines = [u.strip().rstrip("/") for u in args.engines.split(",") if u.strip()]
    uvicorn.run(create_app(engines), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
