"""The fake engine's HTTP face: an OpenAI-compatible server in front of the engine model.

Routes: `POST /v1/chat/completions` (JSON or SSE), `POST /classify` and `/v1/classify` (vLLM's
single-pass shape), `GET /v1/models`, `GET /health`, `GET /metrics` (SGLang's or vLLM's names,
per instance), and what the SGLang router asks of a worker: `GET /server_info`, `GET /model_info`
(also under their older `/get_` names) and `GET /get_load`; the scheduler's prober reads the KV
pool's size and its host tier from `/get_server_info` as from SGLang's (`max_total_num_tokens`,
`enable_hierarchical_cache`). Every chat response object carries the replica name as
`system_fingerprint`, which is how tests and benchmarks see which replica served a turn. What the
engine says comes from `replies`, how long it takes from the engine model (`engine`, driven by
`realtime`); this module only translates. A
stream sends `chunk_tokens` tokens per chunk, so that a flood of streams measures the scheduler
rather than our own JSON encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from luftpause import logs
from luftpause.config import DEFAULT_MODEL
from luftpause.errors import error_body
from luftpause.fake_engine import classify, metrics
from luftpause.fake_engine.engine import ModelRequest
from luftpause.fake_engine.logprobs import reply_logprobs
from luftpause.fake_engine.params import EngineParams, params_from_env
from luftpause.fake_engine.prefix_cache import prompt_blocks, reply_block
from luftpause.fake_engine.protocol import (
    ChatRequest,
    Envelope,
    RequestError,
    delta_for_range,
    describe,
    parse_request,
    reply_message,
)
from luftpause.fake_engine.realtime import EngineRejected, RealtimeEngine
from luftpause.fake_engine.replies import Reply, ReplyError, compose_reply
from luftpause.fake_engine.tokens import count_tokens

log = logging.getLogger(__name__)

TIMING_ENV = "LUFTPAUSE_FAKE_ENGINE_TIMING"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)


def create_app(
    name: str = "fake-a",
    model: str = DEFAULT_MODEL,
    slots: int | None = None,
    params: EngineParams | None = None,
    labels: tuple[str, ...] = classify.DEFAULT_LABELS,
    metrics_flavour: str = "sglang",
    time_scale: float = 1.0,
    chunk_tokens: int = 1,
) -> FastAPI:
    """One fake engine replica called `name`, serving `model`.

    `slots` overrides `params.slots` (0: as many as the KV pool holds). `labels` are what
    `/classify` answers with when the replica is used as a single-pass one. `metrics_flavour` is
    "sglang" or "vllm"; `time_scale` multiplies every modelled duration (0.1: ten times faster).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    params = params or EngineParams()
    if slots is not None:
        params = replace(params, slots=slots)
    engine = RealtimeEngine(params, time_scale=time_scale)
    registry = metrics.metrics_registry(engine, model, metrics_flavour)
    started = int(time.time())
    app = FastAPI(title=f"luftpause fake engine {name}", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.name = name
    app.state.model = model

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": started, "owned_by": "luftpause-fake-engine"}
            ],
        }

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    info = {
        "served_model_name": model,
        "model_path": model,
        "tokenizer_path": model,
        "is_generation": True,
        # Without a request cap the KV pool is the limit; SGLang then derives its figure from the
        # pool the same way (half the pool's tokens, at most 4096), and routers expect a number.
        "max_running_requests": params.slots or min(params.kv_pool_tokens // 2, 4096),
        "max_total_num_tokens": params.kv_pool_tokens,
        # SGLang's server arguments are in the same document; this one says whether its host tier
        # (HiCache, `--enable-hierarchical-cache`) is on.
        "enable_hierarchical_cache": params.host_cache_tokens > 0,
        "version": "luftpause-fake-engine",
    }
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: info, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [{"dp_rank": 0, "num_tokens": engine.load().used_tokens}]

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify_route(request: Request) -> Response:
        try:
            body = classify.ClassifyRequest.model_validate_json(await request.body())
        except ValidationError as e:
            return error(400, "invalid classify request: " + describe(e))
        if body.model != model:
            return error(404, f"model '{body.model}' is not served here; this engine serves '{model}'")
        texts = classify.inputs_of(body)
        prompt = sum(count_tokens(t) for t in texts)
        blocks = prompt_blocks([{"role": "user", "content": t} for t in texts])
        work = engine.submit(ModelRequest(engine.next_id(), blocks, completion_tokens=0))
        try:
            finished = await _unless_disconnected(request.receive, work.wait())
        except EngineRejected as e:
            return error(400, str(e))
        if not finished:
            return Response(status_code=499)
        return JSONResponse(
            {
                "id": "classify-" + uuid.uuid4().hex,
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": [classify.classification(i, t, labels) for i, t in enumerate(texts)],
                "usage": {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"request body is not valid JSON: {e}")
        try:
            chat = parse_request(data)
        except RequestError as e:
            return error(400, str(e))
        if chat.model != model:
            return error(404, f"model '{chat.model}' is not served here; this engine serves '{model}'")
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()]
        try:
            reply = compose_reply(messages, tools, chat.tool_choice, chat.token_limit, params.reply_tokens)
        except ReplyError as e:
            return error(400, str(e))
        blocks = prompt_blocks(messages, tools)
        prompt = sum(b.tokens for b in blocks)
        envelope = Envelope(model, name)
        logprobs = reply_logprobs(messages, reply, chat.top_logprobs or 0) if chat.logprobs else None
        engine_request = ModelRequest(
            engine.next_id(),
            blocks,
            completion_tokens=reply.completion_tokens,
            max_tokens=chat.token_limit,
            reply=reply_block(blocks, reply_message(reply)),
            priority=chat.priority or 0,
        )
        if chat.stream:
            return StreamingResponse(
                _stream(engine, engine_request, envelope, reply, prompt, chat, logprobs, chunk_tokens),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        generation = engine.submit(engine_request)
        try:
            finished = await _unless_disconnected(request.receive, generation.wait())
        except EngineRejected as e:
            return error(400, str(e))
        if not finished:
            # Nobody is listening any more; the slot is already free.
            return Response(status_code=499)
        return JSONResponse(envelope.completion(reply, prompt, logprobs))

    return app


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[None]) -> bool:
    """Runs `work` unless the client goes away first, in which case `work` is cancelled."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
    if job.cancelled():
        return False
    job.result()  # an error of the work itself is the caller's to answer
    return True


def _sse(body: dict[str, Any] | str) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _stream(
    engine: RealtimeEngine,
    engine_request: ModelRequest,
    envelope: Envelope,
    reply: Reply,
    prompt: int,
    chat: ChatRequest,
    logprobs: list[dict[str, Any]] | None,
    chunk_tokens: int,
) -> AsyncIterator[bytes]:
    # A client that disconnects closes this generator at its current await, which closes the
    # token iterator and cancels the request in the engine (queue place or slot) at once. The
    # request is submitted here, not before, so a stream never started never holds a slot.
    usage_field = chat.include_usage
    sent = 0
    opened = False
    generation = engine.submit(engine_request)
    try:
        async with contextlib.aclosing(generation.tokens()) as progress:
            async for decoded in progress:
                if not opened:
                    opened = True
                    yield _sse(
                        envelope.chunk({"role": "assistant", "content": ""}, with_usage_field=usage_field)
                    )
                while decoded - sent >= chunk_tokens or (
                    decoded > sent and decoded >= reply.completion_tokens
                ):
                    end = min(decoded, sent + chunk_tokens)
                    yield _sse(
                        envelope.chunk(
                            delta_for_range(reply, sent, end),
                            with_usage_field=usage_field,
                            logprobs=logprobs[sent:end] if logprobs is not None else None,
                        )
                    )
                    sent = end
    except EngineRejected as e:
        yield _sse(error_body(str(e)))
        return
    yield _sse(envelope.chunk({}, finish_reason=reply.finish_reason, with_usage_field=usage_field))
    if usage_field:
        yield _sse(envelope.usage_chunk(prompt, reply.completion_tokens))
    yield _sse("[DONE]")


def serve(
    name: str,
    host: str,
    port: int,
    model: str = DEFAULT_MODEL,
    slots: int | None = None,
    metrics_flavour: str = "sglang",
    time_scale: float = 1.0,
    chunk_tokens: int = 1,
) -> None:
    """Runs one fake engine until SIGTERM or SIGINT; parameter overrides come from $LUFTPAUSE_FAKE_ENGINE_TIMING."""
    params = params_from_env(os.environ.get(TIMING_ENV, ""))
    app = create_app(
        name=name,
        model=model,
        slots=slots,
        params=params,
        metrics_flavour=metrics_flavour,
        time_scale=time_scale,
        chunk_tokens=chunk_tokens,
    )
    log.info(
        "fake engine %s serving %s on http://%s:%d (%s metrics, time scale %g, %d tokens a chunk, %s)",
        name,
        model,
        host,
        port,
        metrics_flavour,
        time_scale,
        chunk_tokens,
        app.state.engine.params,
    )
    # Streams last a fraction of a second, so a short grace period lets them finish on shutdown.
    uvicorn.run(
        app, host=host, port=port, log_config=None, access_log=logs.access_log(), timeout_graceful_shutdown=3
    )
