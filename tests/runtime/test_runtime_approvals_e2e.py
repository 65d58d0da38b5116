"""Tool approval, MCP Tasks, run, tools, the run tree and auth, as MCP clients see them.

Real processes: a fake engine stands in for the dataplane, and the runtime starts the tool
fixture (tool_fixture.py: `lookup`, and `delete_file` marked destructive) over stdio, so these
tests also cover stdio tool servers. Each approval test forces the destructive tool with
`tools: ["delete_file"]` and a task for which the fake engine plans exactly one call.
"""

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.extension import ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import ElicitResult, RequestParams, Result
from mcp_types._types import Request
from pydantic import TypeAdapter
from support import Service, call, free_port, task_planning, until, wait_until
from test_runtime_e2e import Backends, error_of
from test_runtime_e2e import backends as backends  # noqa: F401 (the module's fixture, shared)

from luftpause.runtime.auth import UNAUTHORIZED

FIXTURE = Path(__file__).resolve().parent / "tool_fixture.py"


class RuntimeUnderTest:
    def __init__(self, directory: Path, engines: Backends, token: str | None = None) -> None:
        self.port = free_port()
        self.state = directory / "state"
        self.calls_log = directory / "calls.jsonl"
        self.token = token
        config = directory / "luftpause.toml"
        command = json.dumps([sys.executable, str(FIXTURE), "--log", str(self.calls_log)])
        config.write_text(
            f"""
[runtime]
port = {self.port}
dataplane = "http://127.0.0.1:{engines.engine_port}"
state_dir = "{self.state}"

[[runtime.mcp_servers]]
name = "fixture"
command = {command}
"""
        )
        self.service = Service("runtime", ["runtime", "--config", str(config)], directory / "runtime.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/status"

    def start(self) -> "RuntimeUnderTest":
        self.service.start(env={"LUFTPAUSE_TOKEN": self.token} if self.token else None)
        wait_until(
            lambda: self.service.alive() and _listening(self.status_url),
            what="the runtime's /status",
        )
        return self

    def calls(self) -> list[dict]:
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text().splitlines() if line.strip()]

    def records(self) -> list[dict]:
        path = self.state / "runs.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


async def http_request(method: str, url: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.request(method, url, **kwargs)


def _listening(url: str) -> bool:
    try:
        httpx.get(url, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, backends) -> Iterator[RuntimeUnderTest]:  # noqa: F811
    rt = RuntimeUnderTest(tmp_path_factory.mktemp("approvals"), backends).start()
    try:
        # The stdio tool server is started by the runtime; wait until its tools are listed.
        wait_until(
            lambda: "delete_file" in httpx.get(rt.status_url).json()["tools"], what="the fixture's tools"
        )
        yield rt
    finally:
        rt.service.stop()


def answering(allow: bool | None, asked: list[str]):
    """An elicitation callback that records the question and allows, declines (False) or
    rejects the form (None: the decline action)."""

    async def callback(context, params) -> ElicitResult:
        asked.append(params.message)
        assert params.requested_schema["properties"]["allow"]["type"] == "boolean"
        if allow is None:
            return ElicitResult(action="decline")
        return ElicitResult(action="accept", content={"allow": allow})

    return callback


# Short final answers keep the fake engine's decoding (and so each test) short.
SHORT = 16


def destructive_task(prefix: str) -> dict[str, Any]:
    return {"task": task_planning(1, prefix), "tools": ["delete_file"], "maxTokens": SHORT}


def tool_messages(rt: RuntimeUnderTest, handle: str) -> list[str]:
    return [
        m["content"]
        for r in rt.records()
        if r["run"] == handle and r["type"] == "round"
        for m in r["messages"]
        if m["role"] == "tool"
    ]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
@pytest.mark.parametrize("allow", [True, None])
async def test_a_destructive_call_is_asked_while_await_covers_it_on_both_wires(runtime, mode, allow):
    asked: list[str] = []
    prefix = f"approval {mode} {allow}"
    async with Client(runtime.url, mode=mode, elicitation_callback=answering(allow, asked)) as client:
        handle = (await call(client, "spawn", **destructive_task(prefix)))["handle"]
        (run,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]

    assert run["status"] == "finished" and run["toolCalls"] == 1
    assert len(asked) == 1 and "delete_file" in asked[0] and handle in asked[0]
    received = [c for c in runtime.calls() if c["tool"] == "delete_file" and prefix in json.dumps(c)]
    decisions = [r for r in runtime.records() if r["run"] == handle and r["type"] == "approval"]
    assert [d["allow"] for d in decisions] == [bool(allow)]
    if allow:
        assert run["failedToolCalls"] == 0
        assert tool_messages(runtime, handle)[0].startswith("deleted ")
    else:
        assert run["failedToolCalls"] == 1
        assert tool_messages(runtime, handle) == ["Error: the user declined this tool call"]
        assert received == []


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_run_asks_and_returns_the_finished_run(runtime, mode):
    asked: list[str] = []
    async with Client(runtime.url, mode=mode, elicitation_callback=answering(False, asked)) as client:
        run = await call(client, "run", **destructive_task(f"blocking run {mode}"))
    assert run["status"] == "finished" and run["failedToolCalls"] == 1 and len(asked) == 1


async def test_a_client_that_cannot_be_asked_sees_awaiting_approval_and_answers_with_approve(runtime):
    async with Client(runtime.url) as client:
        handle = (await call(client, "spawn", **destructive_task("approve tool")))["handle"]
        (waiting,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert waiting["status"] == "AwaitingApproval"
        assert waiting["pendingApproval"]["tool"] == "delete_file"
        assert set(waiting["pendingApproval"]["arguments"]) == {"path"}

        approved = await call(client, "approve", handle=handle, allow=True)
        assert approved["pendingApproval"] is None
        (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert done["status"] == "finished" and done["failedToolCalls"] == 0
        assert "no tool call waiting" in await error_of(client, "approve", handle=handle, allow=True)


async def test_approve_tools_makes_a_read_only_tool_wait_too(runtime):
    async with Client(runtime.url, mode="legacy") as client:
        handle = (
            await call(
                client,
                "spawn",
                task=task_planning(1, "approve lookup"),
                tools=["lookup"],
                approveTools=["lookup"],
                maxTokens=SHORT,
            )
        )["handle"]
        (waiting,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert waiting["status"] == "AwaitingApproval" and waiting["pendingApproval"]["tool"] == "lookup"
        await call(client, "approve", handle=handle, allow=False)
        (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
    assert done["status"] == "finished" and done["failedToolCalls"] == 1


async def test_tools_lists_what_sub_agents_can_use(runtime):
    async with Client(runtime.url) as client:
        listed = await call(client, "tools")
    by_name = {t["name"]: t for t in listed["tools"]}
    assert set(by_name) == {"lookup", "delete_file"}
    assert by_name["delete_file"]["needsApproval"] is True and by_name["lookup"]["needsApproval"] is False
    assert by_name["lookup"]["server"] == "fixture" and listed["unavailable"] == []


# --- MCP Tasks ------------------------------------------------------------------------------------


class CreatedTask(Result):
    result_type: Literal["task"] = "task"
    task_id: str
    status: str


class TaskIdParams(RequestParams):
    task_id: str


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any]


class GetTask(Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    name_param = "taskId"


class UpdateTask(Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateParams
    name_param = "taskId"


class CancelTask(Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param = "taskId"


async def _no_resolve(result, ctx):
    raise AssertionError("the test reads the task itself")


class TasksClient(ClientExtension):
    identifier = "io.modelcontextprotocol/tasks"

    def claims(self):
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=_no_resolve)]


ANY = TypeAdapter(dict[str, Any])


async def poll(client: Client, task_id: str, statuses: set[str]) -> dict[str, Any]:
    """tasks/get until the task's status is one of `statuses`."""

    async def reached() -> dict[str, Any] | None:
        task = await client.session.send_request(GetTask(params=TaskIdParams(task_id=task_id)), ANY)
        return task if task["status"] in statuses else None

    return await until(
        reached, timeout_s=60, what=f"the task to be {' or '.join(sorted(statuses))}", interval_s=0.1
    )


@pytest.mark.parametrize("allow", [True, False])
async def test_a_tasks_client_gets_a_task_sees_input_required_and_answers_with_update(runtime, allow):
    async with Client(runtime.url, extensions=[TasksClient()]) as client:
        created = await client.session.call_tool(
            "run", destructive_task(f"task approval {allow}"), allow_claimed=True
        )
        assert isinstance(created, CreatedTask) and created.status == "working"

        waiting = await poll(client, created.task_id, {"input_required"})
        ((key, request),) = waiting["inputRequests"].items()
        assert request["method"] == "elicitation/create" and "delete_file" in request["params"]["message"]

        answer = {"action": "accept", "content": {"allow": allow}}
        await client.session.send_request(
            UpdateTask(params=UpdateParams(task_id=created.task_id, input_responses={key: answer})), ANY
        )
        done = await poll(client, created.task_id, {"completed", "failed", "cancelled"})

    assert done["status"] == "completed" and done["result"]["isError"] is False
    run = done["result"]["structuredContent"]
    assert run["status"] == "finished" and run["failedToolCalls"] == (0 if allow else 1)

    # The task is closed in tasks.jsonl once its run's end is seen (after tasks/get answers from
    # the run itself): wait for that record rather than read the file once.
    def closed() -> list[dict[str, Any]] | None:
        records = task_records(runtime.state, created.task_id)
        return records if records and records[-1]["type"] == "closed" else None

    mine = wait_until(closed, what="the task's closed record")
    assert [t["type"] for t in mine] == ["created", "closed"] and mine[0]["run"] == run["handle"]
    assert mine[1]["status"] == "completed"


async def test_a_tasks_client_can_cancel_and_others_get_run_as_one_call(runtime):
    async with Client(runtime.url, extensions=[TasksClient()]) as client:
        created = await client.session.call_tool("run", destructive_task("task cancel"), allow_claimed=True)
        await poll(client, created.task_id, {"input_required"})
        await client.session.send_request(CancelTask(params=TaskIdParams(task_id=created.task_id)), ANY)
        cancelled = await poll(client, created.task_id, {"cancelled"})
        assert cancelled["status"] == "cancelled"
    (run,) = [
        r
        for r in (await http_request("GET", runtime.status_url)).json()["runs"]
        if r["task"] == task_planning(1, "task cancel")
    ]
    assert run["status"] == "cancelled"

    # The same call from a client without the extension blocks until the run is done.
    async with Client(runtime.url) as client:
        run = await call(client, "run", task=task_planning(1, "plain run"), tools=["lookup"], maxTokens=SHORT)
    assert run["status"] == "finished" and run["toolCalls"] == 1


async def test_a_tasks_client_is_refused_bad_arguments_and_unknown_models_in_one_sentence(runtime):
    async with Client(runtime.url, extensions=[TasksClient()]) as client:
        bad_class = await client.session.call_tool(
            "run", {"task": "hello", "serviceClass": "urgent"}, allow_claimed=True
        )
        assert bad_class.is_error
        assert (
            bad_class.content[0].text == "run: serviceClass must be 'interactive' or 'batch', not 'urgent'."
        )
        unknown = await client.session.call_tool(
            "run", {"task": "hello", "model": "gpt-nope"}, allow_claimed=True
        )
        assert unknown.is_error and unknown.content[0].text.startswith("unknown model 'gpt-nope'")


def task_records(state: Path, task_id: str) -> list[dict[str, Any]]:
    """tasks.jsonl's records of one task, in order (a line still being written is left out)."""
    lines = (state / "tasks.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.endswith("}")) if r["task"] == task_id]


async def test_a_task_whose_run_ended_just_before_a_crash_stays_completed_after_the_restart(
    tmp_path,
    backends,  # noqa: F811
):
    rt = RuntimeUnderTest(tmp_path, backends).start()
    try:
        async with Client(rt.url, extensions=[TasksClient()]) as client:
            created = await client.session.call_tool(
                "run",
                {"task": task_planning(1, "ends before the crash"), "tools": ["lookup"], "maxTokens": SHORT},
                allow_claimed=True,
            )
            done = await poll(client, created.task_id, {"completed", "failed", "cancelled"})
        assert done["status"] == "completed"
        wait_until(lambda: len(task_records(rt.state, created.task_id)) == 2, what="the closed record")
        rt.service.kill()
        # As a crash between the run's end and the task's closed record leaves the file.
        path = rt.state / "tasks.jsonl"
        path.write_text(
            "".join(line + "\n" for line in path.read_text().splitlines() if '"closed"' not in line)
        )
        rt.start()
        async with Client(rt.url, extensions=[TasksClient()]) as client:
            again = await client.session.send_request(
                GetTask(params=TaskIdParams(task_id=created.task_id)), ANY
            )
        assert again["status"] == "completed", again
        assert again["result"]["structuredContent"]["handle"] == done["result"]["structuredContent"]["handle"]
        assert [r["type"] for r in task_records(rt.state, created.task_id)] == ["created", "closed"]
    finally:
        rt.service.stop()


async def test_an_open_task_is_failed_on_restart_while_its_run_resumes(tmp_path, backends):  # noqa: F811
    rt = RuntimeUnderTest(tmp_path, backends).start()
    try:
        async with Client(rt.url, extensions=[TasksClient()]) as client:
            created = await client.session.call_tool(
                "run", destructive_task("task restart"), allow_claimed=True
            )
            await poll(client, created.task_id, {"input_required"})
        rt.service.kill()
        rt.start()
        async with Client(rt.url, extensions=[TasksClient()]) as client:
            failed = await poll(client, created.task_id, {"failed"})
            assert "restarted" in failed["statusMessage"] and failed["error"]["message"]
        # The run resumed and asks again (the approval was never answered): answer it with approve.
        async with Client(rt.url) as client:
            (handle,) = [r["handle"] for r in (await call(client, "status"))["runs"]]
            (waiting,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
            assert waiting["status"] == "AwaitingApproval"
            await call(client, "approve", handle=handle, allow=True)
            (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert done["status"] == "finished" and done["failedToolCalls"] == 0
    finally:
        rt.service.stop()


# --- decisions across restarts, the tree, auth ------------------------------------------------------


async def test_an_answered_approval_is_not_asked_again_after_a_crash(tmp_path, backends):  # noqa: F811
    rt = RuntimeUnderTest(tmp_path, backends).start()
    try:
        async with Client(rt.url) as client:
            handle = (await call(client, "spawn", **destructive_task("decided before crash")))["handle"]
            await call(client, "await", handles=[handle], timeout=60)
            # Journal the decision, then crash before the run can go on: the runtime is stopped
            # hard right after approve returns.
            await call(client, "approve", handle=handle, allow=False)
        rt.service.kill()
        assert [r["allow"] for r in rt.records() if r["type"] == "approval"] == [False]
        rt.start()
        async with Client(rt.url) as client:
            (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert done["status"] == "finished" and done["failedToolCalls"] == 1
        assert tool_messages(rt, handle) == ["Error: the user declined this tool call"]
    finally:
        rt.service.stop()


async def test_status_shows_the_tree_with_cors_and_cancel_reaches_children(runtime):
    async with Client(runtime.url) as client:
        parent = (await call(client, "spawn", **destructive_task("tree parent")))["handle"]
        children = [
            (await call(client, "spawn", parent=parent, **destructive_task(f"tree child {i}")))["handle"]
            for i in range(2)
        ]
        (shown,) = (await call(client, "status", handle=parent))["runs"]
        assert shown["children"] == children
        await call(client, "cancel", handle=parent)
        awaited = await call(client, "await", handles=children, timeout=10)
    assert {r["status"] for r in awaited["runs"]} == {"cancelled"}

    # The scheduler's status page (another port of this machine) may read it: its origin is named back.
    response = await http_request("GET", runtime.status_url, headers={"origin": "http://127.0.0.1:5001"})
    assert response.headers["access-control-allow-origin"] == "http://127.0.0.1:5001"
    (root,) = [n for n in response.json()["tree"] if n["handle"] == parent]
    assert [c["handle"] for c in root["children"]] == children
    for key in ("turns", "toolCalls", "failedToolCalls", "promptTokens", "completionTokens", "turnSeconds"):
        assert root["subtree"][key] == pytest.approx(
            root["own"][key] + sum(c["own"][key] for c in root["children"]), abs=0.01
        )
    preflight = await http_request(
        "OPTIONS",
        runtime.status_url,
        headers={"origin": "http://localhost:5001", "access-control-request-method": "GET"},
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:5001"
    # A page of any other site may not, nor a request naming a foreign host (DNS rebinding).
    foreign = await http_request("GET", runtime.status_url, headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers
    assert "allowed_hosts" in foreign.json()["error"]["message"]
    rebound = await http_request("GET", runtime.status_url, headers={"host": "evil.example:7000"})
    assert rebound.status_code == 403


async def test_the_token_guards_mcp_and_status(tmp_path, backends):  # noqa: F811
    rt = RuntimeUnderTest(tmp_path, backends, token="s3cret").start()
    try:
        for url in (rt.url, rt.status_url):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                response = await http_request(
                    "POST" if url == rt.url else "GET", url, json={}, headers=headers
                )
                assert response.status_code == 401
                assert "bearer token" in response.json()["error"]["message"]
        authorized = await http_request("GET", rt.status_url, headers={"authorization": "Bearer s3cret"})
        assert authorized.status_code == 200
        http = httpx2.AsyncClient(headers={"authorization": "Bearer s3cret"}, timeout=30)
        async with http, Client(streamable_http_client(rt.url, http_client=http)) as client:
            assert "spawn" in {t.name for t in (await client.list_tools()).tools}
    finally:
        rt.service.stop()


async def test_a_tool_call_budget_cancels_the_parent_and_its_running_children(runtime):
    async with Client(runtime.url) as client:
        # The parent waits on an approval nobody gives, so it is still running when its
        # children, which plan 3 calls each (12 in all), spend the budget.
        parent = (await call(client, "spawn", budgetToolCalls=5, **destructive_task("budget parent")))[
            "handle"
        ]
        children = [
            (
                await call(
                    client,
                    "spawn",
                    parent=parent,
                    task=task_planning(3, f"budget child {i}"),
                    tools=["lookup"],
                )
            )["handle"]
            for i in range(4)
        ]
        awaited = await call(client, "await", handles=children, timeout=60)
        awaited["runs"] += (await call(client, "status", handle=parent))["runs"]
    message = "budget exceeded: toolCalls 5/5"
    by_handle = {r["handle"]: r for r in awaited["runs"]}
    assert (by_handle[parent]["status"], by_handle[parent]["error"]) == ("cancelled", message)
    assert by_handle[parent]["budget"] == {
        "limits": {"toolCalls": 5},
        "used": {"toolCalls": 5},
        "exceeded": message,
    }
    assert all(by_handle[c]["status"] in ("cancelled", "finished") for c in children)
    assert any(by_handle[c]["error"] == message for c in children)

    status = (await http_request("GET", runtime.status_url)).json()
    (root,) = [n for n in status["tree"] if n["handle"] == parent]
    assert root["subtree"]["toolCalls"] == 5 == sum(r["toolCalls"] for r in awaited["runs"])
    for key in ("turns", "toolCalls", "failedToolCalls", "promptTokens", "completionTokens", "toolSeconds"):
        assert root["subtree"][key] == pytest.approx(
            root["own"][key] + sum(c["subtree"][key] for c in root["children"]), abs=0.01
        )


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_every_tool_on_both_wires(runtime, mode):
    """decide is driven on both wires against a real dataplane in test_runtime_durable_up."""
    async with Client(runtime.url, mode=mode) as client:
        assert (await call(client, "tools"))["unavailable"] == []
        finished = await call(
            client, "run", task=task_planning(1, f"every tool {mode}"), tools=["lookup"], maxTokens=SHORT
        )
        assert finished["status"] == "finished"
        handle = (await call(client, "spawn", **destructive_task(f"every tool approve {mode}")))["handle"]
        (waiting,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert waiting["status"] == "AwaitingApproval"
        assert (await call(client, "approve", handle=handle, allow=True))["status"] == "running"
        (done,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
        assert done["status"] == "finished"
        other = (await call(client, "spawn", **destructive_task(f"every tool cancel {mode}")))["handle"]
        assert (await call(client, "cancel", handle=other))["status"] == "cancelled"
        listed = {r["handle"]: r["status"] for r in (await call(client, "status"))["runs"]}
        assert listed[handle] == "finished" and listed[other] == "cancelled"


async def test_await_all_returns_early_only_to_say_which_runs_need_the_user(runtime):
    """A client that cannot be asked: one run waits for approval, another runs on."""
    async with Client(runtime.url) as client:
        waiting = (await call(client, "spawn", **destructive_task("needs the user")))["handle"]
        working = (
            await call(client, "spawn", task=task_planning(2, "runs on"), tools=["lookup"], maxTokens=SHORT)
        )["handle"]
        early = await call(client, "await", handles=[waiting, working], mode="all", timeout=60)
        assert early["timedOut"] is False
        assert early["needsApproval"] == [waiting]
        by_handle = {r["handle"]: r for r in early["runs"]}
        assert by_handle[waiting]["status"] == "AwaitingApproval"

        # Returned before the runs were done: the only reason given is the one that holds.
        assert not all(r["status"] in ("finished", "failed", "cancelled") for r in early["runs"])

        await call(client, "approve", handle=waiting, allow=True)
        done = await call(client, "await", handles=[waiting, working], mode="all", timeout=60)
        assert done["timedOut"] is False and done["needsApproval"] == []
        assert [r["status"] for r in done["runs"]] == ["finished", "finished"]

        fresh = (
            await call(
                client, "spawn", task=task_planning(3, "still going"), tools=["lookup"], maxTokens=SHORT
            )
        )["handle"]
        timed_out = await call(client, "await", handles=[fresh], timeout=0)
        assert timed_out["timedOut"] is True and timed_out["needsApproval"] == []
        assert timed_out["runs"][0]["status"] == "running"
        await call(client, "cancel", handle=fresh)


async def test_spawn_refuses_an_unknown_model_and_bad_values_at_once_in_one_sentence(runtime):
    async with Client(runtime.url) as client:
        # At once: spawn itself refuses (one that took the run would return its handle, and the
        # run fail later), naming what the pool serves; no bound on the clock is needed.
        unknown = await error_of(client, "spawn", task="hello", model="gpt-nope")
        assert unknown == (
            "Error executing tool spawn: unknown model 'gpt-nope': the pool serves 'fake-llama'; "
            "name one of them, or omit model for the default ('fake-llama')."
        )
        assert await error_of(client, "spawn", task="hello", serviceClass="urgent") == (
            "spawn: serviceClass must be 'interactive' or 'batch', not 'urgent'."
        )
        assert await error_of(client, "await", handles=["run-x"], mode="sometimes") == (
            "await: mode must be 'all' or 'any', not 'sometimes'."
        )
        assert await error_of(client, "spawn", task="hello", maxToolCalls=-1) == (
            "spawn: maxToolCalls should be greater than or equal to 0, not -1."
        )
    assert not [r for r in runtime.records() if r["type"] == "spawned" and r["spec"]["task"] == "hello"]


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however deeply nested."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]


async def test_a_client_without_the_bearer_sees_an_authentication_error(tmp_path, backends):  # noqa: F811
    rt = RuntimeUnderTest(tmp_path, backends, token="s3cret").start()
    try:
        for mode in ("legacy", "auto"):
            # The SDK client raises the error from inside its task groups, so it arrives wrapped
            # in exception groups; what it wraps is the server's JSON-RPC error, with its text.
            with pytest.raises(BaseException) as refused:
                async with Client(rt.url, mode=mode) as client:
                    await client.list_tools()
            (error,) = leaves(refused.value)
            assert isinstance(error, MCPError), repr(error)
            assert error.error.code == UNAUTHORIZED
            assert str(error) == "missing bearer token: send Authorization: Bearer <LUFTPAUSE_TOKEN>"
    finally:
        rt.service.stop()
