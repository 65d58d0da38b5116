"""Who is asking, as the scheduler and the runtime see it: two own-loop agents and two
sessionless MCP clients of the same kind are four callers, and one MCP client cannot see or
cancel another's run. A whole stack (`luftpause up`), the official `mcp` client on the
sessionless wire, and OpenAI-style turns through the proxy."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from support import Ports, call, start_up, stop_up, task_planning, wait_until, write_config


async def error_of(client: Client, tool: str, **arguments) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    directory = tmp_path_factory.mktemp("callers")
    ports = Ports()
    proc = start_up(write_config(directory, ports), directory / "up.log")
    try:
        yield ports
    finally:
        stop_up(proc)


def mcp_client(ports: Ports, caller: str) -> tuple[httpx2.AsyncClient, Client]:
    """A sessionless client that names its caller in x-luftpause-caller."""
    http = httpx2.AsyncClient(headers={"x-luftpause-caller": caller}, timeout=30)
    return http, Client(streamable_http_client(f"http://127.0.0.1:{ports.runtime}/mcp", http_client=http))


def own_loop_turn(ports: Ports, run_id: str, caller: str) -> None:
    reply = httpx.post(
        f"http://127.0.0.1:{ports.dataplane}/v1/chat/completions",
        json={"model": "fake-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-luftpause-run-id": run_id, "x-luftpause-caller": caller},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


async def test_two_own_loop_agents_and_two_sessionless_mcp_clients_are_four_callers(stack: Ports) -> None:
    own_loop_turn(stack, "own-run-1", "own-loop-a")
    own_loop_turn(stack, "own-run-2", "own-loop-b")
    alice_http, alice = mcp_client(stack, "alice")
    bob_http, bob = mcp_client(stack, "bob")
    async with alice_http, bob_http, alice, bob:
        assert alice.protocol_version == bob.protocol_version  # the same kind of client
        task = {"tools": ["lookup"], "maxTokens": 16}
        mine = (await call(alice, "spawn", task=task_planning(3, "alice's"), **task))["handle"]
        theirs = (await call(bob, "spawn", task=task_planning(3, "bob's"), **task))["handle"]

        async with httpx.AsyncClient(timeout=5) as http:
            runtime_status = (await http.get(f"http://127.0.0.1:{stack.runtime}/status")).json()
        callers = {r["handle"]: r["caller"] for r in runtime_status["runs"]}
        assert callers[mine] == "mcp/0.1.0@alice" and callers[theirs] == "mcp/0.1.0@bob"

        expected = {"own-loop-a", "own-loop-b", "mcp/0.1.0@alice", "mcp/0.1.0@bob"}

        def four_callers() -> bool:
            doc = httpx.get(f"http://127.0.0.1:{stack.status}/status", timeout=5).json()
            return expected <= set(doc["runs"]["by_caller"])

        wait_until(four_callers, 30, what="the scheduler to show all four callers")

        # Bob sees only his own run, and can neither cancel nor await Alice's.
        assert [r["handle"] for r in (await call(bob, "status"))["runs"]] == [theirs]
        refused = await error_of(bob, "cancel", handle=mine)
        assert refused == (
            f"Error executing tool cancel: run {mine} was spawned by another caller: only that caller "
            "(or the operator token) can see it, await it or cancel it"
        )
        assert "spawned by another caller" in await error_of(bob, "await", handles=[mine], timeout=1)
        (still,) = (await call(alice, "status", handle=mine))["runs"]
        assert still["status"] != "cancelled"

        # Alice can cancel her own run.
        assert (await call(alice, "cancel", handle=mine))["status"] in ("cancelled", "finished")
        await call(bob, "cancel", handle=theirs)
