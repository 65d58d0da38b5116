"""The gRPC port's bearer check (`LUFTPAUSE_TOKEN`): with a token, every call whose metadata lacks
`authorization: Bearer <token>` is answered UNAUTHENTICATED (`BearerCheck`, compared in constant
time by luftpause/bearer.py), after reading what a streaming client sends for a moment so that it
sees the refusal rather than a broken stream. `grpc_server` is the scheduler's server with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from luftpause import config as lp_config
from luftpause.bearer import bearer_matches
from luftpause.config import TOKEN_ENV

# How long a refused call's request stream is read before the refusal is sent.
REFUSAL_DRAIN_S = 1.0

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class BearerCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks `authorization: Bearer <token>`,
    compared in constant time as the dataplane compares its clients' (dataplane/auth.py)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, str):  # gRPC gives bytes only for keys ending in -bin
            authorization = authorization.encode()
        if handler is None or bearer_matches(authorization or None, self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler[_Req, _Resp]) -> grpc.RpcMethodHandler[_Req, _Resp]:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED and does nothing else."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[_Req, _Resp]) -> None:
        if handler.request_streaming:
            # Read what the client sends (for a moment at most) before answering: a stream closed
            # under a client still writing reaches it as INTERNAL, not as the refusal.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REFUSAL_DRAIN_S):
                    async for _ in request:
                        pass
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token (see {TOKEN_ENV})"
        )

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip


def grpc_server(token: str | None, max_connections: int, handshake_timeout_s: float) -> grpc.aio.Server:
    """The scheduler's gRPC server, taking only calls that carry `token` when there is one, and at
    most `max_connections` connections, each closed unless it begins HTTP/2 (its preface and
    settings) within `handshake_timeout_s`: idle connections never fill the descriptor table that
    the status port shares."""
    return grpc.aio.server(
        interceptors=[BearerCheck(token)] if token else None,
        options=[
            # gRPC sets SO_REUSEPORT by default, which lets a second scheduler bind the same port
            # and take half of the first one's connections; a port in use must be an error instead.
            ("grpc.so_reuseport", 0),
            ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout_s * 1000))),
            # Keepalive (config.scheduler_keepalive_options): the scheduler pings a dataplane that
            # went quiet, and takes the dataplane's pings as often as half the period (by default
            # gRPC takes one each 5 minutes and sends GOAWAY for more; core's
            # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS goes by this name).
            *lp_config.scheduler_keepalive_options(),
            ("grpc.http2.min_ping_interval_without_data_ms", round(lp_config.SCHEDULER_KEEPALIVE_S * 500)),
        ],
    )
