"""The fake engine's HTTP face: an OpenAI-compatible server in front of the engine model.

Routes: `POST /v1/chat/completions` (JSON or SSE), `POST /classify` and `/v1/classify` (vLLM's
single-pass shape), `GET /v1/models`, `GET /health`, `GET /metrics` (SGLang's names), and what
the SGLang router asks of a worker: `GET /server_info`, `GET /model_info` (also under their older
`/get_` names) and `GET /get_load`. Every chat response object carries the replica name as
`system_fingerprint`, which is how tests and benchmarks see which replica served a turn. What the
engine says comes from `replies`, how long it takes from `model`; this module only translates.
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
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from luftpause.config import DEFAULT_MODEL
from luftpause.fake_engine import classify, metrics
from luftpause.fake_engine.logprobs import reply_logprobs
from luftpause.fake_engine.model import Engine, EngineTiming, timing_from_env
from luftpause.fake_engine.protocol import (
    ChatRequest,
    Envelope,
    RequestError,
    delta_for,
    describe,
    parse_request,
)
from luftpause.fake_engine.replies import Reply, ReplyError, compose_reply
from luftpause.fake_engine.tokens import count_tokens, prompt_tokens

log = logging.getLogger(__name__)

TIMING_ENV = "LUFTPAUSE_FAKE_ENGINE_TIMING"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(
    name: str = "fake-a",
    model: str = DEFAULT_MODEL,
    slots: int = 8,
    timing: EngineTiming | None = None,
    labels: tuple[str, ...] = classify.DEFAULT_LABELS,
) -> FastAPI:
    """One fake engine replica called `name`, serving `model` with `slots` running slots.

    `labels` are what `/classify` answers with when the replica is used as a single-pass one.
    """
    engine = Engine(slots=slots, timing=timing)
    registry = metrics.metrics_registry(engine, model)
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
        "max_running_requests": slots,
        "max_total_num_tokens": engine.timing.kv_pool_tokens,
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
        finished = await _unless_disconnected(request.receive, _single_pass(engine, prompt))
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
            reply = compose_reply(
                messages, tools, chat.tool_choice, chat.token_limit, engine.timing.reply_tokens
            )
        except ReplyError as e:
            return error(400, str(e))
        prompt = prompt_tokens(messages, tools)
        envelope = Envelope(model, name)
        logprobs = reply_logprobs(messages, reply, chat.top_logprobs or 0) if chat.logprobs else None
        if chat.stream:
            return StreamingResponse(
                _stream(engine, envelope, reply, prompt, chat, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        finished = await _unless_disconnected(request.receive, _generate(engine, reply, prompt))
        if not finished:
            # Nobody is listening any more; the slot is already free.
            return Response(status_code=499)
        return JSONResponse(envelope.completion(reply, prompt, logprobs))

    return app


async def _generate(engine: Engine, reply: Reply, prompt: int) -> None:
    async with engine.admit(prompt) as admission:
        await admission.prefill()
        for _ in range(reply.completion_tokens):
            await admission.decode()


async def _single_pass(engine: Engine, prompt: int) -> None:
    async with engine.admit(prompt) as admission:
        await admission.prefill()


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
    return not job.cancelled()


def _sse(body: dict[str, Any] | str) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _stream(
    engine: Engine,
    envelope: Envelope,
    reply: Reply,
    prompt: int,
    chat: ChatRequest,
    logprobs: list[dict[str, Any]] | None,
) -> AsyncIterator[bytes]:
    # A client that disconnects cancels this generator at its current await, which leaves the
    # `admit` block and frees the slot (or the place in the queue) at once.
    usage_field = chat.include_usage
    async with engine.admit(prompt) as admission:
        await admission.prefill()
        for index in range(reply.completion_tokens):
            await admission.decode()
            if index == 0:
                yield _sse(envelope.chunk({"role": "assistant", "content": ""}, with_usage_field=usage_field))
            token_logprobs = logprobs[index] if logprobs is not None else None
            yield _sse(
                envelope.chunk(delta_for(reply, index), with_usage_field=usage_field, logprobs=token_logprobs)
            )
    yield _sse(envelope.chunk({}, finish_reason=reply.finish_reason, with_usage_field=usage_field))
    if usage_field:
        yield _sse(envelope.usage_chunk(prompt, reply.completion_tokens))
    yield _sse("[DONE]")


def serve(name: str, host: str, port: int, model: str = DEFAULT_MODEL, slots: int = 8) -> None:
    """Runs one fake engine until SIGTERM or SIGINT; timing overrides come from $LUFTPAUSE_FAKE_ENGINE_TIMING."""
    timing = timing_from_env(os.environ.get(TIMING_ENV, ""))
    app = create_app(name=name, model=model, slots=slots, timing=timing)
    log.info(
        "fake engine %s serving %s on http://%s:%d with %d slots (%s)", name, model, host, port, slots, timing
    )
    # Streams last a fraction of a second, so a short grace period lets them finish on shutdown.
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=3)
