"""GET /metrics on the runtime's HTTP port, read as Prometheus reads it, while sub-agents work.

Real processes as in test_runtime_approvals_e2e.py (a fake engine for the dataplane, the tool
fixture over stdio): a run waits on an approval and is approved, one spends its tool-call
budget. Runs by state, approvals waiting, tool calls by
server and outcome, budget trips and the journal's write latency move with them; with
`LUFTPAUSE_TOKEN` set a scrape needs the token and is told so without it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from mcp import Client
from support import call, sample, scrape, task_planning, until
from test_runtime_approvals_e2e import RuntimeUnderTest, destructive_task
from test_runtime_e2e import Backends
from test_runtime_e2e import backends as backends  # noqa: F401 (the module's fixture, shared)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, backends: Backends) -> Iterator[RuntimeUnderTest]:  # noqa: F811
    rt = RuntimeUnderTest(tmp_path_factory.mktemp("metrics"), backends).start()
    try:
        yield rt
    finally:
        rt.service.stop()


async def test_runs_approvals_tool_calls_budgets_and_journal_writes_move(runtime: RuntimeUnderTest):
    before = scrape(f"http://127.0.0.1:{runtime.port}")
    assert sample(before, "luftpause_runtime_approvals_waiting") == 0
    assert sample(before, "luftpause_runtime_tool_calls_total", server="fixture", outcome="ok") == 0
    async with Client(runtime.url) as client:
        handle = (await call(client, "spawn", **destructive_task("metrics approval")))["handle"]
        await until(
            lambda: (
                sample(scrape(f"http://127.0.0.1:{runtime.port}"), "luftpause_runtime_approvals_waiting") == 1
            ),
            timeout_s=60,
            what="the approval waiting in /metrics",
        )
        waiting = scrape(f"http://127.0.0.1:{runtime.port}")
        assert sample(waiting, "luftpause_runtime_runs", state="AwaitingApproval") == 1
        await call(client, "approve", handle=handle, allow=True)
        (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert done["status"] == "finished"

        # One call within the budget, the second trips it (the task plans three).
        budgeted = await call(
            client, "spawn", budgetToolCalls=1, task=task_planning(3, "metrics budget"), tools=["lookup"]
        )
        (tripped,) = (await call(client, "await", handles=[budgeted["handle"]], timeout=60))["runs"]
        assert tripped["error"] == "budget exceeded: toolCalls 1/1"

    after = scrape(f"http://127.0.0.1:{runtime.port}")
    assert sample(after, "luftpause_runtime_approvals_waiting") == 0
    assert sample(after, "luftpause_runtime_runs", state="AwaitingApproval") == 0
    assert sample(after, "luftpause_runtime_runs", state="finished") == 1
    assert sample(after, "luftpause_runtime_runs", state="cancelled") == 1
    assert sample(after, "luftpause_runtime_tool_calls_total", server="fixture", outcome="ok") == 2
    assert sample(after, "luftpause_runtime_budget_trips_total", kind="toolCalls") == 1
    assert sample(after, "luftpause_runtime_budget_trips_total", kind="tokens") == 0
    writes = sample(after, "luftpause_runtime_journal_write_seconds_count")
    assert writes > sample(before, "luftpause_runtime_journal_write_seconds_count")
    assert 0 < sample(after, "luftpause_runtime_journal_write_seconds_sum") < writes * 5
    # No run handle is ever a label.
    assert not any(handle in str(labels) for _, labels in after)


def test_with_a_token_a_scrape_needs_it_and_is_told_so(tmp_path, backends: Backends):  # noqa: F811
    rt = RuntimeUnderTest(tmp_path, backends, token="s3cret").start()
    try:
        refused = httpx.get(f"http://127.0.0.1:{rt.port}/metrics", timeout=5)
        assert refused.status_code == 401
        assert "LUFTPAUSE_TOKEN" in refused.json()["error"]["message"]
        samples = scrape(f"http://127.0.0.1:{rt.port}", headers={"authorization": "Bearer s3cret"})
        assert sample(samples, "luftpause_runtime_runs", state="running") == 0
    finally:
        rt.service.stop()
