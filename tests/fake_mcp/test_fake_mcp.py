"""The fake MCP server as a real process, called with the official MCP client on both wires."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from mcp import Client
from support import Service, free_port, running


@pytest.fixture(scope="module")
def mcp_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = Service(
        "fake-mcp", ["fake-mcp", "--port", str(port)], tmp_path_factory.mktemp("mcp") / "fake-mcp.log"
    )
    server.start()
    base = f"http://127.0.0.1:{port}"
    server.wait_http(base + "/health")
    with running(server):
        yield base


def test_health_and_mcp_endpoint_answer_without_redirect(mcp_url: str) -> None:
    assert httpx.get(mcp_url + "/health").json() == {"status": "ok"}
    # A POST that is not MCP is refused by the MCP transport itself, not redirected elsewhere.
    r = httpx.post(mcp_url + "/mcp", json={}, headers={"accept": "application/json, text/event-stream"})
    assert r.status_code == 400 and "location" not in r.headers


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_both_tools_answer_about_the_query_after_about_a_second(mcp_url: str, mode: str) -> None:
    async with Client(mcp_url + "/mcp", mode=mode) as client:
        listed = (await client.list_tools()).tools
        tools = {t.name: t for t in listed}
        assert set(tools) == {"lookup", "deep_search"}
        for tool in listed:
            assert tool.description and len(tool.description) > 40
            assert tool.input_schema["required"] == ["query"]
            assert tool.annotations is not None and tool.annotations.read_only_hint is True

        async def timed(name: str, query: str) -> tuple[float, str]:
            started = time.monotonic()
            result = await client.call_tool(name, {"query": query})
            assert not result.is_error
            return time.monotonic() - started, "".join(c.text for c in result.content if c.type == "text")

        (lookup_s, lookup_text), (deep_s, deep_text) = await asyncio.gather(
            timed("lookup", "capital of Norway"), timed("deep_search", "history of Oslo")
        )
        assert "capital of Norway" in lookup_text and "history of Oslo" in deep_text
        assert lookup_s >= 0.8 and deep_s >= 1.0
        assert len(deep_text) > len(lookup_text)
        # The same query gets the same text; only the delay varies.
        assert (await timed("lookup", "capital of Norway"))[1] == lookup_text


async def test_a_call_without_its_argument_is_an_error_result(mcp_url: str) -> None:
    async with Client(mcp_url + "/mcp") as client:
        result = await client.call_tool("lookup", {})
        assert result.is_error
        assert "query" in "".join(c.text for c in result.content if c.type == "text")


def test_the_server_exits_cleanly_on_sigterm(tmp_path) -> None:
    port = free_port()
    server = Service("fake-mcp", ["fake-mcp", "--port", str(port)], tmp_path / "fake-mcp.log").start()
    with running(server):
        server.wait_http(f"http://127.0.0.1:{port}/health")
        server.stop()
        # Graceful shutdown, then uvicorn re-raises SIGTERM; a crash or a forced kill reads otherwise.
        assert server.proc is not None and server.proc.returncode in (0, -signal.SIGTERM), server.output()[
            -2000:
        ]


async def test_over_stdio_with_a_fixed_latency_lookup_takes_that_long() -> None:
    import sys

    from mcp import StdioServerParameters

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "luftpause", "fake-mcp", "--stdio", "--fixed-latency-s", "0.5"]
    )
    async with Client(params) as client:
        assert {t.name for t in (await client.list_tools()).tools} == {"lookup", "deep_search"}
        for tool in ("lookup", "deep_search"):
            began = time.monotonic()
            result = await client.call_tool(tool, {"query": "Danube"})
            took = time.monotonic() - began
            assert not result.is_error and "Danube" in result.content[0].text
            assert took >= 0.5, f"{tool} answered in {took:.2f} s, before its fixed latency"
