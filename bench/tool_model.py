"""A real engine's replies made to call tools as an agent's model would: a proxy in front of it.

The real-engine benchmark serves a model of random weights: its replies are random text, so its
turns end in `length`, never in `tool_calls`. Every front would then see runs that end after each
turn (luftpause's scheduler lets such a run move and holds no place for it), which no real
agent's run does. This proxy stands in front of one `llama-server` and, for a chat completion
whose conversation still has tool calls to make, turns the engine's reply into a tool call:
`finish_reason` `tool_calls`, one call of the first tool with a short query, the content
dropped; the turn that makes the last call is followed by one whose reply ends in `stop`. How
many calls a run makes is a function of its conversation alone (`loadgen.agents.planned_tool_calls`
of its first user message), so the agent and this proxy agree without a word between them, and
every front sees the same runs. The engine did all the work (prefill and decode, as many tokens
as it was asked): only the reply's form changes. Usage and everything else pass through as the
engine wrote them, and every other route (`/health`, `/metrics`, `/slots`, `/props`) is passed
through unchanged, but for the routes the SGLang router reads a worker's model from
(`worker_info`). A streamed reply is rewritten chunk by chunk as a model streams a tool call
(`stream_chunk`): the engine's first token becomes the call's opening (its id and name), its later
tokens carry nothing, and its last chunk the call's arguments and the finish reason, so the first
token comes when the engine's does.

    python -m luftpause.bench.tool_model --engine http://127.0.0.1:8080 --port 8081 --tool-calls 1-3
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from luftpause.loadgen.agents import planned_tool_calls
from luftpause.loadgen.conversation import TOOLS

_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def calls_made(messages: Sequence[Any]) -> int:
    """Tool results the conversation carries: the calls its run has made so far."""
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")


def first_user_content(messages: Sequence[Any]) -> str:
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return str(m["content"])
    return ""


def as_agents_model(
    body: dict[str, Any], reply: dict[str, Any], tool_calls: tuple[int, int]
) -> dict[str, Any]:
    """The engine's non-streamed `reply` to `body`, as a model that makes the run's planned calls."""
    made, planned = plan_of(body, tool_calls)
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return reply
    choice = dict(choices[0])
    if made < planned:
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [_call(made)]}
        choice["finish_reason"] = "tool_calls"
    else:
        message = dict(choice.get("message") or {})
        message.pop("tool_calls", None)
        choice["message"] = message
        choice["finish_reason"] = "stop"
    return {**reply, "choices": [choice, *choices[1:]]}


def _call(made: int) -> dict[str, Any]:
    name = TOOLS[0]["function"]["name"]
    return {
        "id": f"call_{made}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"query": f"fact {made + 1}"})},
    }


def plan_of(body: dict[str, Any], tool_calls: tuple[int, int]) -> tuple[int, int]:
    """(calls made so far, calls the run makes) for a chat request's conversation."""
    messages = body.get("messages") or []
    return calls_made(messages), planned_tool_calls(first_user_content(messages), tool_calls)


def stream_chunk(chunk: dict[str, Any], made: int, planned: int, opened: bool) -> tuple[dict[str, Any], bool]:
    """One streamed chunk of the engine's reply as the agent's model would send it, and whether
    the tool call has been opened (its id and name sent) once it is out."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return chunk, opened  # the usage chunk, or anything else: as it came
    choice = dict(choices[0])
    delta = dict(choice.get("delta") or {})
    finished = choice.get("finish_reason") is not None
    if made < planned:
        call = _call(made)
        content = delta.pop("content", None)
        if (content or finished) and not opened:
            opening = {
                "index": 0,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            delta["tool_calls"] = [opening]
            opened = True
        if finished:
            more = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
            delta["tool_calls"] = [*delta.get("tool_calls", ()), more]
            choice["finish_reason"] = "tool_calls"
    elif finished:
        choice["finish_reason"] = "stop"
    choice["delta"] = delta
    return {**chunk, "choices": [choice, *choices[1:]]}, opened


async def _rewritten(lines: AsyncIterator[str], made: int, planned: int) -> AsyncIterator[bytes]:
    opened = False
    async for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk, opened = stream_chunk(json.loads(line[6:]), made, planned, opened)
            line = "data: " + json.dumps(chunk)
        yield (line + "\n").encode()


def build_app(engine: str, tool_calls: tuple[int, int]) -> FastAPI:
    app = FastAPI()
    # On the app's state so that a test can put its own engine there.
    app.state.engine_client = httpx.AsyncClient(base_url=engine, timeout=None)

    async def worker_info(request: Request) -> dict[str, Any]:
        """What the SGLang router asks a worker for its model (`/model_info`, `/server_info`),
        which llama-server does not serve: its model as its `/v1/models` names it. Without it the
        router lists the model as "unknown", and the runtime, which asks the front's
        `/v1/models`, refuses a spawn naming the real one."""
        client: httpx.AsyncClient = request.app.state.engine_client
        listed = (await client.get("/v1/models")).json()
        name = str(listed["data"][0]["id"])
        return {"model_path": name, "served_model_name": name, "tokenizer_path": name, "is_generation": True}

    for route in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.add_api_route(route, worker_info, methods=["GET"])

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.engine_client
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
        chat = path.endswith("chat/completions") and request.method == "POST"
        body = json.loads(raw or b"{}") if chat else {}
        if chat and body.get("stream"):
            sent = client.build_request("POST", "/" + path, content=raw, headers=headers)
            answer = await client.send(sent, stream=True)
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
            if answer.status_code != 200:
                content = await answer.aread()
                await answer.aclose()
                return Response(content, status_code=answer.status_code, headers=kept)
            made, planned = plan_of(body, tool_calls)
            return StreamingResponse(
                _rewritten(answer.aiter_lines(), made, planned),
                status_code=200,
                headers=kept,
                background=BackgroundTask(answer.aclose),
            )
        answer = await client.request(request.method, "/" + path, content=raw, headers=headers)
        content = answer.content
        if chat and answer.status_code == 200:
            content = json.dumps(as_agents_model(body, answer.json(), tool_calls)).encode()
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        return Response(content, status_code=answer.status_code, headers=kept)

    return app


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m luftpause.bench.tool_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--engine", required=True, help="the engine's base URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tool-calls", type=_range, default=(1, 3), help="calls a run makes, LO-HI")
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(args.engine, args.tool_calls), host="127.0.0.1", port=args.port, log_level="warning"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
