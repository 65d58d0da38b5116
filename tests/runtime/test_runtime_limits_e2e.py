"""The runtime's limits, each refused or ended with a message naming its `[runtime]` key.

Real processes on loopback: a fake engine standing in for the dataplane, the stdio tool fixture
(`lookup`, and `delete_file`, which its server marks destructive, so that each call of it waits
for approval) and `luftpause runtime`, driven by the official `mcp` client:

- `max_running_per_caller`: a caller with that many runs running is refused the next spawn,
  another caller is not, and one run ended makes room again;
- `approval_timeout_s`: a call unanswered that long fails its run "approval expired", in a live
  runtime and across a restart (the deadline is journaled: the restarted runtime does not
  start it anew, nor forget it);
- `task_retention_s`: an ended MCP task is forgotten after it, by tasks/get and in tasks.jsonl;
- a seconds budget stops counting once its run has ended.
"""

import time

import httpx
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from support import amend_config, call, task_planning, until, wait_until
from test_runtime_approvals_e2e import (
    ANY,
    SHORT,
    GetTask,
    RuntimeUnderTest,
    TaskIdParams,
    TasksClient,
    destructive_task,
    poll,
)
from test_runtime_e2e import backends, error_of  # noqa: F401 (backends: the fixture)


def runtime_with(tmp_path, backends, settings: str) -> RuntimeUnderTest:  # noqa: F811
    """A runtime whose `[runtime]` table has `settings` too, started, with its tools listed."""
    rt = RuntimeUnderTest(tmp_path, backends)
    config = tmp_path / "luftpause.toml"
    amend_config(config, f"[runtime]\n{settings}")
    rt.start()
    wait_until(lambda: "delete_file" in httpx.get(rt.status_url).json()["tools"], what="the fixture's tools")
    return rt


async def test_a_caller_with_max_running_per_caller_runs_running_is_refused_the_next(tmp_path, backends):  # noqa: F811
    rt = runtime_with(tmp_path, backends, "max_running_per_caller = 2")
    try:
        async with Client(rt.url, mode="legacy") as first, Client(rt.url, mode="legacy") as second:
            # Each waits for the user's approval: running until it is answered.
            held = [(await call(first, "spawn", **destructive_task(f"held {i}")))["handle"] for i in range(2)]
            text = await error_of(first, "spawn", **destructive_task("one too many"))
            assert "has 2 runs running" in text and "[runtime] max_running_per_caller = 2" in text, text
            assert (await call(second, "spawn", **destructive_task("another caller")))["handle"]
            await call(first, "cancel", handle=held[0])
            assert (await call(first, "spawn", **destructive_task("room again")))["handle"]
    finally:
        rt.service.stop()


async def test_an_unanswered_approval_expires_and_fails_its_run(tmp_path, backends):  # noqa: F811
    rt = runtime_with(tmp_path, backends, "approval_timeout_s = 2")
    try:
        async with Client(rt.url, mode="legacy") as client:
            handle = (await call(client, "spawn", **destructive_task("never answered")))["handle"]
            (done,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
            while done["status"] == "AwaitingApproval":  # this client cannot be asked: await again
                (done,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
        assert done["status"] == "failed" and done["error"].startswith("approval expired: tool call"), done
        assert "[runtime] approval_timeout_s = 2" in done["error"]
    finally:
        rt.service.stop()


async def test_an_approval_expires_at_its_journaled_deadline_across_a_restart(tmp_path, backends):  # noqa: F811
    timeout_s = 4.0
    rt = runtime_with(tmp_path, backends, f"approval_timeout_s = {timeout_s:g}")
    try:
        async with Client(rt.url, mode="legacy") as client:
            handle = (await call(client, "spawn", **destructive_task("asked before the restart")))["handle"]
            (waiting,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
            assert waiting["status"] == "AwaitingApproval"
            asked = time.time()
        rt.service.kill()
        # The runtime is down past the deadline: the clock is what is waited for.
        wait_until(
            lambda: time.time() > asked + timeout_s + 0.5, timeout_s=timeout_s + 5, what="the deadline"
        )
        rt.start()
        restarted = time.monotonic()
        async with Client(rt.url, mode="legacy") as client:
            (done,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
            while done["status"] == "AwaitingApproval":
                (done,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
        took = time.monotonic() - restarted
        assert done["status"] == "failed" and done["error"].startswith("approval expired"), done
        assert took < timeout_s / 2, (
            f"the restarted runtime waited {took:.1f} s: a fresh deadline, not the journaled one"
        )
    finally:
        rt.service.stop()


async def test_ended_tasks_are_forgotten_after_task_retention_s(tmp_path, backends):  # noqa: F811
    rt = runtime_with(tmp_path, backends, "task_retention_s = 2")
    try:
        async with Client(rt.url, extensions=[TasksClient()]) as client:
            ids = []
            for i in range(3):
                created = await client.session.call_tool(
                    "run", {"task": task_planning(1, f"task {i}"), "tools": ["lookup"], "maxTokens": SHORT},
                    allow_claimed=True,
                )  # fmt: skip
                done = await poll(client, created.task_id, {"completed", "failed", "cancelled"})
                assert done["status"] == "completed" and done["ttlMs"] == 2000
                ids.append(created.task_id)

            async def forgotten() -> bool:
                try:
                    await client.session.send_request(GetTask(params=TaskIdParams(task_id=ids[-1])), ANY)
                except MCPError as e:
                    assert "unknown task" in str(e)
                    return True
                return False

            await until(forgotten, timeout_s=15, what="the ended tasks to be forgotten", interval_s=0.2)
        wait_until(
            lambda: not any(i in (rt.state / "tasks.jsonl").read_text() for i in ids),
            timeout_s=5,
            what="tasks.jsonl to be rewritten without them",
        )
    finally:
        rt.service.stop()


@pytest.mark.timeout(60)
async def test_a_seconds_budget_stops_counting_when_its_run_ends(tmp_path, backends):  # noqa: F811
    rt = runtime_with(tmp_path, backends, "")
    try:
        async with Client(rt.url, mode="legacy") as client:
            task = {"task": task_planning(1, "quick"), "tools": ["lookup"], "maxTokens": SHORT}
            handle = (await call(client, "spawn", **task, budgetSeconds=600))["handle"]
            (done,) = (await call(client, "await", handles=[handle], timeout=30))["runs"]
            assert done["status"] == "finished"
            first = done["budget"]["used"]["seconds"]
            ended = time.monotonic()
            # The window over which the budget must not move: the clock is what is waited for.
            wait_until(lambda: time.monotonic() > ended + 1.5, timeout_s=5, what="a second and a half")
            (later,) = (await call(client, "status", handle=handle))["runs"]
        assert later["budget"]["used"]["seconds"] == first, (first, later["budget"])
    finally:
        rt.service.stop()
