"""MCP behind the balancer of compose.postgres.yaml, and MCP Tasks across two runtimes: two runtimes on one PostgreSQL store, and
HAProxy (Debian's package; .ci/run installs it) with the recipe's own deploy/haproxy/haproxy.cfg,
its servers pointed at the two runtimes on loopback.

A sessionless client (the 2026-07-28 wire) sends its requests round robin, one to each runtime
in turn, and every tool answers wherever it lands: spawn on one, status and await on the other;
GET /status on either lists the runs of both. A legacy session's requests all reach the runtime
that opened it.
"""

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest
from mcp import Client
from support import call, end_process, free_port, http_ok, task_planning, wait_until
from test_runtime_approvals_e2e import (
    ANY,
    CreatedTask,
    TasksClient,
    UpdateParams,
    UpdateTask,
    destructive_task,
    poll,
)
from test_runtime_shared_store_e2e import two_runtimes

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None)


def _balancer_config(directory: Path, port: int, a_port: int, b_port: int) -> Path:
    """The recipe's config, listening on `port` and balancing over the runtimes on loopback."""
    text = RECIPE.read_text()
    text = text.replace("bind :7000", f"bind 127.0.0.1:{port}")
    text = text.replace("runtime-a:7000", f"127.0.0.1:{a_port}").replace(
        "runtime-b:7000", f"127.0.0.1:{b_port}"
    )
    path = directory / "haproxy.cfg"
    path.write_text(text)
    return path


def _start_balancer(directory: Path, port: int, a_port: int, b_port: int, log: Path) -> subprocess.Popen:
    """HAProxy on `port` once both runtimes answer; waited for until it routes to both."""
    with log.open("ab") as out:
        balancer = subprocess.Popen(
            [str(HAPROXY), "-db", "-f", str(_balancer_config(directory, port, a_port, b_port))],
            stdout=out,
            stderr=out,
        )
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/status"), what="haproxy to route")
    except TimeoutError:
        end_process(balancer, 15)
        raise
    return balancer


def _fleet(port: int) -> tuple[list[str], list[str]]:
    """The handles GET /status on `port` lists, and those its run tree holds (every level)."""
    doc = httpx.get(f"http://127.0.0.1:{port}/status").json()
    in_tree, stack = [], list(doc["tree"])
    while stack:
        node = stack.pop()
        in_tree.append(node["handle"])
        stack.extend(node["children"])
    return sorted(r["handle"] for r in doc["runs"]), sorted(in_tree)


def _served(log: Path) -> list[tuple[str, str]]:
    """(runtime, session or "") of every MCP request HAProxy logged, in order."""
    lines = log.read_text().splitlines() if log.exists() else []
    pattern = r" runtimes/(runtime-[ab]) .*?\{([^}]*)\} \"[A-Z]+ /mcp "
    return [(m[1], m[2]) for line in lines if (m := re.search(pattern, line))]


@pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (apt-get install haproxy; .ci/run does)")
@pytest.mark.timeout(240)
async def test_a_client_whose_requests_reach_either_runtime_gets_every_answer(tmp_path, postgres_url):
    port, log = free_port(), tmp_path / "haproxy.log"
    with two_runtimes(tmp_path, postgres_url) as (a, b):
        balancer = _start_balancer(tmp_path, port, a.port, b.port, log)
        try:
            url = f"http://127.0.0.1:{port}/mcp"
            tasks = [task_planning(1, f"balanced {i}") for i in range(4)]
            async with Client(url) as client:
                handles = [(await call(client, "spawn", task=t, tools=["lookup"]))["handle"] for t in tasks]
                shown = [(await call(client, "status", handle=h))["runs"][0]["handle"] for h in handles]
                awaited = await call(client, "await", handles=handles, timeout=120)
            fleets = [_fleet(r.port) for r in (a, b)]
            sessionless = Counter(server for server, session in _served(log) if not session)
            async with Client(url, mode="legacy") as legacy:
                (one,) = [(await call(legacy, "spawn", task=tasks[0], tools=["lookup"]))["handle"]]
                first = await call(legacy, "await", handles=[one], timeout=120)
                again = await call(legacy, "status", handle=one)
            sessions = {}
            for server, session in _served(log):
                if session:
                    sessions.setdefault(session, set()).add(server)
        finally:
            end_process(balancer, 15)

    assert shown == handles
    assert [(r["status"], r["toolCalls"]) for r in awaited["runs"]] == [("finished", 1)] * 4
    # Each runtime drove the runs spawned on it; either one's GET /status lists all four, once each.
    assert fleets == [(sorted(handles), sorted(handles))] * 2
    assert set(sessionless) == {"runtime-a", "runtime-b"}, f"requests went to {sessionless}"
    assert first["runs"][0]["status"] == "finished" and again["runs"][0]["handle"] == one
    assert sessions and all(len(servers) == 1 for servers in sessions.values()), sessions


@pytest.mark.timeout(240)
async def test_a_task_made_on_one_runtime_is_answered_and_approved_on_the_other(tmp_path, postgres_url):
    """MCP Tasks on the sessionless wire, as a round-robin balancer delivers them: the task is
    made on runtime a; tasks/get on b sees its tool call wait for approval, tasks/update on b
    answers it, and tasks/get on a then sees the run completed with the call made."""
    with two_runtimes(tmp_path, postgres_url) as (a, b):
        async with (
            Client(a.url, extensions=[TasksClient()]) as on_a,
            Client(b.url, extensions=[TasksClient()]) as on_b,
        ):
            created = await on_a.session.call_tool("run", destructive_task("shared task"), allow_claimed=True)
            assert isinstance(created, CreatedTask)
            waiting = await poll(on_b, created.task_id, {"input_required"})
            ((key, request),) = waiting["inputRequests"].items()
            assert "delete_file" in request["params"]["message"]
            answer = {"action": "accept", "content": {"allow": True}}
            await on_b.session.send_request(
                UpdateTask(params=UpdateParams(task_id=created.task_id, input_responses={key: answer})), ANY
            )
            done = await poll(on_a, created.task_id, {"completed", "failed", "cancelled"})
            seen_on_b = await poll(on_b, created.task_id, {"completed", "failed", "cancelled"})

    assert done["status"] == "completed" and done["result"]["isError"] is False
    assert done["result"]["structuredContent"]["failedToolCalls"] == 0
    assert seen_on_b["status"] == "completed", (seen_on_b.get("statusMessage"), seen_on_b.get("error"))
    assert not b.calls.exists(), "b never drove the run: a made the call its approval allowed"
