"""A small MCP tool server for the runtime's tests: it counts its calls and has a destructive tool.

- `lookup(query)`: read-only; waits `--delay` seconds, then answers.
- `delete_file(path)`: marked destructiveHint, so a sub-agent's call of it waits for approval.

Every call is appended to `--log` as one JSON line ({"tool", "arguments", "pid", "key": the
idempotency key in the request's `_meta`}) when it starts, so a test can count what the server
received across runtime restarts. Served over stdio (the default;
the runtime starts it as a child process) or over streamable HTTP with `--port`.

    python tests/runtime/tool_fixture.py --log calls.jsonl [--delay 0.5] [--port 9200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import JSONResponse

from luftpause.runtime.tool_servers import IDEMPOTENCY_META_KEY


def create_server(log_path: str, delay_s: float) -> MCPServer:
    server = MCPServer(name="tool-fixture", version="1", log_level="WARNING")

    def record(tool: str, arguments: dict, ctx: Context | None = None) -> None:
        meta = (ctx.request_context.meta or {}) if ctx is not None else {}
        entry = {
            "tool": tool,
            "arguments": arguments,
            "pid": os.getpid(),
            "key": meta.get(IDEMPOTENCY_META_KEY),
        }
        with open(log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

    async def lookup(query: str, ctx: Context) -> str:
        """Look up a short fact about the query."""
        record("lookup", {"query": query}, ctx)
        await asyncio.sleep(delay_s)
        return f"fact about {query}"

    async def delete_file(path: str) -> str:
        """Delete a file for good."""
        record("delete_file", {"path": path})
        return f"deleted {path}"

    server.add_tool(lookup, annotations=ToolAnnotations(read_only_hint=True), structured_output=False)
    server.add_tool(
        delete_file,
        annotations=ToolAnnotations(destructive_hint=True, read_only_hint=False),
        structured_output=False,
    )

    @server.custom_route("/health", methods=["GET"])
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    server = create_server(args.log, args.delay)
    if args.port is None:
        server.run("stdio")
    else:
        import uvicorn

        app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
