"""Finished runs leave memory soon, and cost little while they are there.

Memory is a cache: the journal and the archive are the store. A run tree leaves memory once every
run of it has finished more than `[runtime] retention_s` ago (120 s by default), and `await`,
`status <handle>` and `cancel` answer for it from the archive from then on. While a finished run
is held, it keeps only what answers for it: not the loop that drove it (nor, through the loop's
context, the request that spawned it), and not the timer of a seconds budget whose subtree has
ended. Measured in a runtime that spawned runs over MCP as the soak does (tracemalloc, 256 runs):
some 6.1 KB of Python objects a finished run before, 4.1 KB after.
"""

import asyncio
import contextvars
import gc
import re
import weakref

from support import until

import docs
from luftpause.config import RuntimeSettings
from luftpause.runtime.journal import Journal
from luftpause.runtime.restore import evict
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.views import view

# What an MCP request leaves in the context of the task that spawns a run (the SDK's request
# context, the OpenTelemetry span): a task created there copies it.
REQUEST = contextvars.ContextVar("request")


class Request:
    """Stands in for what a request holds; only its lifetime matters here."""


async def _finish_at_once(runs: Runs, run: Run) -> None:
    runs.finish(run, "finished", result=f"answer to {run.spec.task}")


async def _noop(handle: str) -> None:
    return None


def test_the_default_window_is_two_minutes_as_the_readme_says():
    assert RuntimeSettings().retention_s == 120.0
    durable_runs = docs.text()
    assert re.search(r"`\[runtime\] retention_s` \(120 s by default", durable_runs), (
        "docs/clients.md's Durable runs names the default window"
    )


async def test_a_run_finished_over_two_minutes_ago_leaves_memory_and_still_answers(tmp_path):
    runs = Runs(Journal(tmp_path), _finish_at_once, _noop)
    old, recent = (
        runs.spawn(RunSpec(task="old", model="m"), "c"),
        runs.spawn(RunSpec(task="recent", model="m"), "c"),
    )
    await runs.wait([old.handle, recent.handle], "all", 5)
    now = old.finished_at + 121
    recent.finished_at = now - 119

    assert await evict(runs, RuntimeSettings().retention_s, now=now) == 1
    assert [r.handle for r in runs] == [recent.handle], "what a listing without a handle holds"
    (answer,), timed_out = await runs.wait([old.handle], "all", 0)
    assert not timed_out and (answer.status, answer.result) == ("finished", "answer to old")
    assert (await runs.cancel(old.handle)).status == "finished", "a run that has ended stays as it ended"
    await runs.shutdown()
    runs.journal.close()


async def test_a_finished_run_lets_go_of_its_loop_and_of_the_request_that_spawned_it(tmp_path):
    runs = Runs(Journal(tmp_path), _finish_at_once, _noop)

    async def spawn_in_a_request() -> tuple[Run, weakref.ref[Request]]:
        request = Request()
        REQUEST.set(request)
        return runs.spawn(RunSpec(task="t", model="m"), "c"), weakref.ref(request)

    run, request = await asyncio.create_task(spawn_in_a_request())
    (done,), _ = await runs.wait([run.handle], "all", 5)
    assert done.status == "finished"

    def request_gone() -> bool:
        gc.collect()
        return request() is None

    await until(request_gone, timeout_s=5, what="the spawning request's context to be let go")
    assert run.task is None and run.done.is_set()
    await runs.shutdown()
    runs.journal.close()


async def test_the_timer_of_a_seconds_budget_stops_once_its_subtree_has_ended(tmp_path):
    gates: dict[str, asyncio.Event] = {}

    async def finish_when_released(runs: Runs, run: Run) -> None:
        await gates.setdefault(run.spec.task, asyncio.Event()).wait()
        runs.finish(run, "finished", result="done")

    runs = Runs(Journal(tmp_path), finish_when_released, _noop)
    parent = runs.spawn(RunSpec(task="parent", model="m", budgetSeconds=3600), "c")
    child = runs.spawn(RunSpec(task="child", model="m", parent=parent.handle), "c")

    def timers() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name() == f"budget:{parent.handle}" and not t.done()]

    gates.setdefault("parent", asyncio.Event()).set()
    await runs.wait([parent.handle], "all", 5)
    assert timers(), "the budget still caps the child, which runs on"
    gates.setdefault("child", asyncio.Event()).set()
    await runs.wait([child.handle], "all", 5)
    await until(lambda: not timers(), timeout_s=5, what="the budget's timer to stop")
    await runs.shutdown()
    runs.journal.close()


async def test_a_tree_whose_budget_tripped_leaves_memory_and_comes_back_whole(tmp_path):
    async def spend_a_tool_call(runs: Runs, run: Run) -> None:
        run.counters["toolCalls"] += 1
        run.counters["promptTokens"] += 100
        if runs.check_budgets(run):
            runs.finish(run, "finished", result="done")

    gate = asyncio.Event()

    async def wait_then_spend(runs: Runs, run: Run) -> None:
        if run.spec.parent is None:
            await gate.wait()
        await spend_a_tool_call(runs, run)

    runs = Runs(Journal(tmp_path), wait_then_spend, _noop)
    root = runs.spawn(RunSpec(task="root", model="m", budgetTokens=150), "c")
    children = [runs.spawn(RunSpec(task=f"child {i}", model="m", parent=root.handle), "c") for i in range(2)]
    await runs.wait([c.handle for c in children], "all", 5)
    gate.set()
    await runs.wait([root.handle], "all", 5)
    assert root.budget_exceeded, "the second child's tokens passed the root's budget"
    now = max(r.finished_at for r in root.subtree()) + 121

    assert await evict(runs, RuntimeSettings().retention_s, now=now) == 3
    assert list(runs) == []
    (back,) = await runs.find([root.handle])
    assert [c.handle for c in back.children] == [c.handle for c in children]
    assert back.budget_exceeded == root.budget_exceeded
    assert (back.status, back.error) == (root.status, root.error)
    used = {k: v for k, v in view(back).budget.used.items() if k != "seconds"}
    assert used == {"tokens": 200}, "the budget's use counts the whole subtree (its children's tokens)"
    await runs.shutdown()
    runs.journal.close()
