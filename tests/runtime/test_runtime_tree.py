"""The run tree, budgets, parallel tool calls, resuming a cut round, approvals and decide, against a
scripted dataplane (an httpx mock transport) and scripted tools: exact and instant.
"""

import asyncio
import itertools
import json
import threading
from types import SimpleNamespace

import httpx
import psycopg
import pytest
from support import until

from luftpause.runtime.agent import UNKNOWN_OUTCOME, Agent
from luftpause.runtime.approvals import decide_approval
from luftpause.runtime.journal import Journal
from luftpause.runtime.llm import Dataplane, decision_of
from luftpause.runtime.restore import restore
from luftpause.runtime.runs import Runs, SpawnRefused
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.tool_servers import ToolResult, UpstreamTool
from luftpause.runtime.views import subtree_totals, view

LOOKUP = UpstreamTool(
    server="fake",
    name="lookup",
    description="Looks a thing up.",
    input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
WIPE = UpstreamTool(
    server="fake",
    name="wipe",
    description="Wipes a disk.",
    input_schema={"type": "object", "properties": {"disk": {"type": "string"}}},
    annotations={"destructiveHint": True},
)


class Tools:
    """Scripted tool servers: every call is recorded; `gate` (if set) holds calls until opened,
    and a call whose arguments are in `hang` never returns."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None
        self.hang: list[dict] = []

    def catalog(self):
        return {"lookup": LOOKUP, "wipe": WIPE}, []

    async def settled(self) -> None:
        return None

    async def call(self, tool: UpstreamTool, arguments: dict, idempotency_key: str = "") -> ToolResult:
        self.calls.append((tool.name, arguments))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if arguments in self.hang:
                await asyncio.Event().wait()
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        return ToolResult(f"{tool.name} done: {json.dumps(arguments)}", is_error=False)


def completion(message: dict, prompt_tokens: int = 100, completion_tokens: int = 10) -> httpx.Response:
    body = {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }
    return httpx.Response(200, json=body)


_ids = itertools.count()


def calls_reply(*calls: tuple[str, dict], **usage) -> httpx.Response:
    parts = [
        {"id": f"call_{next(_ids)}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for n, a in calls
    ]
    return completion({"role": "assistant", "content": None, "tool_calls": parts}, **usage)


def answer(text: str = "done") -> httpx.Response:
    return completion({"role": "assistant", "content": text})


class Dataplanes:
    """A scripted dataplane: `script(run_id, body)` answers each turn; runs named in `hold`
    never get an answer (their turn waits until the run is cancelled)."""

    def __init__(self, script) -> None:
        self.script = script
        self.hold: set[str] = set()
        self.bodies: list[dict] = []
        self.requests: list[httpx.Request] = []
        self.deleted: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "DELETE":
            self.deleted.append(request.url.path.rsplit("/", 1)[-1])
            return httpx.Response(204)
        body = json.loads(request.content)
        self.bodies.append(body)
        run_id = request.headers.get("x-luftpause-run-id", "")
        if run_id in self.hold:
            await asyncio.Event().wait()
        return self.script(run_id, body)


class Stack:
    def __init__(self, tmp_path, script, token: str | None = None, stores=None) -> None:
        self.tmp_path = tmp_path
        # The run store each start opens (tests/runtime/conftest.py); the journal file unless given.
        self.open_store = stores.open if stores is not None else lambda: Journal(tmp_path)
        self.engine = Dataplanes(script)
        self.tools = Tools()
        self.token = token
        self.open()

    def open(self) -> None:
        self.dataplane = Dataplane(
            "http://dataplane", transport=httpx.MockTransport(self.engine.handle), token=self.token
        )
        self.agent = Agent(self.dataplane, self.tools, default_model="m")
        self.runs = Runs(self.open_store(), self.agent.drive, self.dataplane.end_run)

    async def close(self) -> None:
        await self.runs.shutdown()
        self.runs.journal.close()
        await self.dataplane.close()

    async def restart(self) -> None:
        await self.close()
        self.open()
        restore(self.runs)

    def spawn(self, task: str = "t", **kw):
        return self.runs.spawn(RunSpec(task=task, model="m", **kw), "caller-1")


def always_calls(run_id, body):
    if "tools" not in body:
        return answer()
    return calls_reply(("lookup", {"query": f"q{next(_ids)}"}))


@pytest.fixture
async def stack(tmp_path):
    s = Stack(tmp_path, always_calls)
    yield s
    await s.close()


async def test_a_tool_call_budget_caps_the_whole_subtree_and_cancels_it(stack):
    parent = stack.spawn("coordinate", budgetToolCalls=5)
    stack.engine.hold.add(parent.handle)  # the parent is busy thinking while its children work
    # Three children that would make 4 calls each: 12 in all, against a budget of 5.
    children = [stack.spawn(f"child {i}", parent=parent.handle, maxToolCalls=4) for i in range(3)]
    await asyncio.wait_for(parent.done.wait(), 10)
    await until(lambda: not any(c.running for c in children))

    message = "budget exceeded: toolCalls 5/5"
    assert (parent.status, parent.error) == ("cancelled", message)
    # Five calls let through; a call whose run was cancelled while its `sent` record was being
    # written never left (as one waiting for approval would not): at most one a child, whose
    # calls go one at a time.
    assert 5 - len(children) <= len(stack.tools.calls) <= 5
    assert sum(c.counters["toolCalls"] for c in parent.subtree()) == 5
    assert {c.status for c in children} == {"cancelled"} and {c.error for c in children} == {message}
    shown = view(parent)
    assert shown.budget.limits == {"toolCalls": 5} and shown.budget.used["toolCalls"] == 5
    assert shown.budget.exceeded == message and shown.children == [c.handle for c in children]
    totals = subtree_totals(parent)
    for key in ("turns", "toolCalls", "promptTokens", "completionTokens"):
        assert totals[key] == sum(r.counters[key] for r in parent.subtree())
    await until(lambda: set(stack.engine.deleted) >= {r.handle for r in parent.subtree()})

    with pytest.raises(SpawnRefused, match="over its budget"):
        stack.spawn("late child", parent=parent.handle)


async def test_a_token_budget_trips_on_the_turn_that_passes_it(stack):
    run = stack.spawn("spend", budgetTokens=250)  # 110 tokens a turn: the third turn passes it
    await asyncio.wait_for(run.done.wait(), 10)
    assert run.status == "cancelled" and run.error == "budget exceeded: tokens 330/250"
    assert run.counters["turns"] == 3 and run.counters["toolCalls"] == 2


async def test_a_seconds_budget_trips_an_idle_subtree_by_its_timer(stack):
    parent = stack.spawn("slow", budgetSeconds=0.2)
    child = stack.spawn("slower", parent=parent.handle)
    stack.engine.hold.update({parent.handle, child.handle})
    await asyncio.wait_for(child.done.wait(), 10)
    assert parent.status == child.status == "cancelled"
    assert parent.error.startswith("budget exceeded: seconds ") and parent.error.endswith("/0.2")


async def test_cancelling_a_parent_cancels_its_running_descendants_only(stack):
    parent = stack.spawn("root")
    child = stack.spawn("child", parent=parent.handle)
    grandchild = stack.spawn("grandchild", parent=child.handle)
    stack.engine.hold.update({parent.handle, child.handle, grandchild.handle})
    done = stack.spawn("quick", parent=parent.handle, maxToolCalls=0)
    await asyncio.wait_for(done.done.wait(), 10)
    assert done.status == "finished"

    await stack.runs.cancel(parent.handle)
    assert [r.status for r in (parent, child, grandchild, done)] == ["cancelled"] * 3 + ["finished"]
    assert [c.handle for c in parent.children] == [child.handle, done.handle]


async def test_parallel_tool_calls_run_at_once_and_are_asked_for(tmp_path):
    replies = iter([calls_reply(("lookup", {"query": "a"}), ("lookup", {"query": "b"})), answer()])
    s = Stack(tmp_path, lambda run_id, body: next(replies))
    s.tools.gate = asyncio.Event()
    try:
        run = s.spawn("both", parallelToolCalls=True)
        await until(lambda: s.tools.in_flight == 2)
        s.tools.gate.set()
        await asyncio.wait_for(run.done.wait(), 10)
    finally:
        await s.close()
    assert run.status == "finished" and run.counters["toolCalls"] == 2
    assert s.engine.bodies[0]["parallel_tool_calls"] is True
    tool_ids = [m["tool_call_id"] for m in s.engine.bodies[1]["messages"] if m["role"] == "tool"]
    asked = [c["id"] for c in s.engine.bodies[1]["messages"][1]["tool_calls"]]
    assert tool_ids == asked  # answered in the order asked, whatever order they finished in


async def test_without_parallel_tool_calls_the_calls_of_a_reply_run_one_by_one(tmp_path):
    replies = iter([calls_reply(("lookup", {"query": "a"}), ("lookup", {"query": "b"})), answer()])
    s = Stack(tmp_path, lambda run_id, body: next(replies))
    try:
        run = s.spawn("one by one")
        await asyncio.wait_for(run.done.wait(), 10)
    finally:
        await s.close()
    assert s.tools.most_in_flight == 1 and len(s.tools.calls) == 2
    assert "parallel_tool_calls" not in s.engine.bodies[0]


async def test_a_round_cut_by_a_restart_sends_only_the_calls_it_had_not_sent(tmp_path, stores):
    first = calls_reply(*(("lookup", {"query": q}) for q in ("one", "two", "three")))
    replies = iter([first, answer("after restart")])
    s = Stack(tmp_path, lambda run_id, body: next(replies), stores=stores)
    s.tools.hang = [{"query": "two"}]
    run = s.spawn("cut")
    # The first call is answered and the second hangs: stop the runtime mid-round, with the
    # second in flight and the third not sent.
    await until(lambda: len(s.tools.calls) == 2)
    await s.close()
    kinds = [r["type"] for r in stores.records()]
    assert kinds == ["spawned", "turn", "sent", "call", "sent"]

    s.tools.calls.clear()
    s.tools.hang = []
    s.open()
    restore(s.runs)
    resumed = s.runs.get(run.handle)
    await asyncio.wait_for(resumed.done.wait(), 10)
    await s.close()
    # Tool calls are at most once: the one in flight at the stop is not sent again.
    assert s.tools.calls == [("lookup", {"query": "three"})]
    assert resumed.result == "after restart"
    assert (resumed.counters["toolCalls"], resumed.counters["failedToolCalls"]) == (3, 1)
    round_record = [r for r in stores.records() if r["type"] == "round"][0]
    answers = [m.get("content") for m in round_record["messages"][1:]]
    assert answers[0] == 'lookup done: {"query": "one"}' and answers[2] == 'lookup done: {"query": "three"}'
    assert answers[1] == UNKNOWN_OUTCOME.format(key=f"{run.handle}/0/1")
    assert answers[1].startswith("Error: the outcome of this tool call is unknown")


async def test_a_runtime_that_lost_a_runs_lease_sends_none_of_its_calls(tmp_path, postgres_url):
    """Tool calls are at most once across runtimes too: once another runtime has taken a run's
    lease, this one stores no `sent` record of it, sends no call of it and lets the run go."""
    from luftpause.runtime.postgres_store import PostgresStore

    replies = iter([calls_reply(("lookup", {"query": "one"}), ("lookup", {"query": "two"})), answer()])
    s = Stack(
        tmp_path,
        lambda run_id, body: next(replies),
        stores=SimpleNamespace(open=lambda: PostgresStore(postgres_url)),
    )
    s.tools.gate = asyncio.Event()
    try:
        run = s.spawn("taken over")
        await until(lambda: s.tools.in_flight == 1)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE luftpause_leases SET owner = 'another runtime' WHERE run = %s", (run.handle,)
            )
        s.tools.gate.set()
        await until(lambda: run.handle in s.runs.foreign, what="the run to be let go")
        records = s.runs.journal.records()
    finally:
        await s.close()
    assert s.tools.calls == [("lookup", {"query": "one"})]
    assert [r["key"] for r in records if r["type"] == "sent"] == [f"{run.handle}/0/0"]
    assert run.running, "let go, not ended: the runtime holding the lease drives it on"


async def test_a_decision_journaled_before_a_restart_is_not_asked_again(tmp_path, stores):
    replies = iter([calls_reply(("wipe", {"disk": "d1"})), answer("wiped")])
    s = Stack(tmp_path, lambda run_id, body: next(replies), stores=stores)
    run = s.spawn("wipe it")
    await until(lambda: run.pending_approval is not None)
    assert view(run).status == "AwaitingApproval"
    assert view(run).pendingApproval.model_dump() == {"tool": "wipe", "arguments": {"disk": "d1"}}
    # Decide, and stop before the loop can act on it: the decision is all that is journaled.
    s.tools.gate = asyncio.Event()
    decide_approval(s.runs, run, True)
    await s.restart()
    resumed = s.runs.get(run.handle)
    await until(lambda: len(s.tools.calls) == 1 or resumed.pending_approval is not None)
    assert resumed.pending_approval is None
    s.tools.gate.set()
    await asyncio.wait_for(resumed.done.wait(), 10)
    await s.close()
    assert resumed.result == "wiped" and s.tools.calls == [("wipe", {"disk": "d1"})]


async def test_an_unanswered_approval_is_asked_again_after_a_restart(tmp_path, stores):
    replies = iter([calls_reply(("wipe", {"disk": "d2"})), answer("declined, so nothing done")])
    s = Stack(tmp_path, lambda run_id, body: next(replies), stores=stores)
    run = s.spawn("wipe it")
    await until(lambda: run.pending_approval is not None)
    await s.restart()
    resumed = s.runs.get(run.handle)
    await until(lambda: resumed.pending_approval is not None)
    decide_approval(s.runs, resumed, False)
    await asyncio.wait_for(resumed.done.wait(), 10)
    await s.close()
    assert s.tools.calls == [] and resumed.counters["failedToolCalls"] == 1
    tool_message = s.engine.bodies[-1]["messages"][-1]
    assert tool_message["content"] == "Error: the user declined this tool call"


async def test_decide_goes_to_the_dataplane_with_the_bearer_token(tmp_path):
    seen: list[httpx.Request] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/decide":
            return httpx.Response(
                200, json={"label": "yes", "probabilities": {"yes": 0.9, "no": 0.1}, "unscored": []}
            )
        return answer()

    dataplane = Dataplane("http://dp", transport=httpx.MockTransport(handle), token="t0k")
    try:
        decided = await dataplane.decide({"input": "is it?", "labels": ["yes", "no"]}, {})
        await dataplane.complete({"model": "m", "messages": []}, {})
    finally:
        await dataplane.close()
    assert decided["label"] == "yes"
    assert json.loads(seen[0].content) == {"input": "is it?", "labels": ["yes", "no"]}
    assert {r.headers["authorization"] for r in seen} == {"Bearer t0k"}


def test_a_decide_answer_becomes_label_probabilities_and_unscored():
    labelled = {
        "data": [
            {
                "index": 0,
                "label": "no",
                "probs": [0.25, 0.75, 0.0],
                "labels": ["yes", "no", "maybe"],
                "unscored": ["maybe"],
            }
        ]
    }
    assert decision_of(labelled) == {
        "label": "no",
        "probabilities": {"yes": 0.25, "no": 0.75, "maybe": 0.0},
        "unscored": ["maybe"],
    }
    classifier = {"data": [{"index": 0, "label": "spam", "probs": [0.1, 0.9], "num_classes": 2}]}
    assert decision_of(classifier) == {"label": "spam", "probabilities": [0.1, 0.9], "unscored": []}


async def _finish_at_once(runs: Runs, run) -> None:
    runs.finish(run, "finished", result="done")


async def _no_end_hook(handle: str) -> None:
    return None


async def test_the_depth_limit_counts_archived_ancestors_read_off_the_event_loop(tmp_path):
    """A chain of 16 archived runs (the default max_depth): a child of its leaf is refused naming
    the limit, a child of the run above is spawned; the archive is read in a thread, not on the
    event loop that serves every other request."""
    chain = [f"run-old-{i:02d}" for i in range(16)]
    with (tmp_path / "archive.jsonl").open("w") as f:
        for i, handle in enumerate(chain):
            spec = {"task": f"level {i}", "model": "m", "parent": chain[i - 1] if i else None}
            record = {"v": 1, "type": "archived", "run": handle, "at": 1.0, "spec": spec, "caller": "c",
                      "owner": None, "status": "finished", "result": f"answer {i}"}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    runs = Runs(Journal(tmp_path), _finish_at_once, _no_end_hook)
    loop_thread = threading.get_ident()
    read_on: set[int] = set()
    archived = runs.journal.archived

    def spied(handle: str):
        read_on.add(threading.get_ident())
        return archived(handle)

    runs.journal.archived = spied  # type: ignore[method-assign]
    try:
        leaf, above = await runs.find([chain[-1], chain[-2]])
        with pytest.raises(
            SpawnRefused, match=rf"run {chain[-1]} is 16 runs deep .*\[runtime\] max_depth = 16"
        ):
            await runs.spawn_durably(
                RunSpec(task="too deep", model="m", parent=leaf.handle), "c", parent=leaf
            )
        child = await runs.spawn_durably(RunSpec(task="deep enough", model="m", parent=above.handle), "c",
                                         parent=above)  # fmt: skip
        assert child.spec.parent == chain[-2]
        assert read_on and loop_thread not in read_on, "the archive was read on the event loop"
    finally:
        await runs.shutdown()
        runs.journal.close()
