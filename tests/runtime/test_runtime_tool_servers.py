"""A tool server that goes away, or never answers, does not take its tools away for good: a stdio
server that exits is started again at the next call (the call that found it gone fails), and a
connection not made within CONNECT_TIMEOUT_S fails the call instead of holding it forever."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from luftpause.config import McpServer
from luftpause.runtime import tool_servers
from luftpause.runtime.tool_servers import ToolServer

FIXTURE = Path(__file__).with_name("tool_fixture.py")


def _pids(log: Path) -> list[int]:
    return [json.loads(line)["pid"] for line in log.read_text().splitlines()] if log.exists() else []


async def test_a_stdio_server_that_exited_is_started_again_at_the_next_call(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    server = ToolServer(McpServer(name="counting", command=[sys.executable, str(FIXTURE), "--log", str(log)]))
    try:
        first = await server.call("lookup", {"query": "a"})
        assert not first.is_error, first.text
        (pid,) = _pids(log)
        os.kill(pid, signal.SIGKILL)
        lost = await server.call("lookup", {"query": "b"})
        assert lost.is_error, "the call that finds the server gone fails"
        again = await server.call("lookup", {"query": "c"})
        assert not again.is_error, again.text
        assert _pids(log)[-1] != pid, "a new server process answered"
    finally:
        await server._disconnect()


async def test_a_server_that_never_finishes_connecting_fails_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tool_servers, "CONNECT_TIMEOUT_S", 1.0)
    silent = McpServer(name="silent", command=[sys.executable, "-c", "import time; time.sleep(60)"])
    server = ToolServer(silent)
    started = time.monotonic()
    result = await asyncio.wait_for(server.call("lookup", {"query": "a"}), 30)
    assert result.is_error
    assert "tool server silent did not finish connecting within 1 s" in result.text
    assert time.monotonic() - started < 10
    await server._disconnect()
