"""Two runtimes on one PostgreSQL store (a real server), in one process: each run is driven by
one of them under a lease, and either answers await, status, cancel and approve for any run.

Each runtime is a registry of runs (runs.py) over a store of its own connections and its own
owner name, with its lease keeper (leases.py); the sub-agent loop is a script the test controls.
"""

import asyncio
import time

import psycopg
import pytest
from support import until

from luftpause.config import RuntimeSettings
from luftpause.runtime.approvals import ask_approval, decide_approval
from luftpause.runtime.leases import Leases
from luftpause.runtime.postgres_store import PostgresStore
from luftpause.runtime.restore import restore, restore_at_start
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs, SpawnRefused
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.views import status_runs


class Runtime:
    """A registry, its store and its lease keeper; its loops finish a run when the test says so,
    or wait for the approval of one tool call first (`ask`)."""

    def __init__(self, url: str, owner: str, lease_s: float, settings: RuntimeSettings | None = None) -> None:
        self.store = PostgresStore(url, owner=owner, lease_s=lease_s)
        self.runs = Runs(self.store, self.drive, self.on_end, settings=settings)
        self.leases = Leases(self.runs, self.store)
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.ask = False
        self.allowed: dict[str, bool] = {}

    async def drive(self, runs: Runs, run: Run) -> None:
        self.started.append(run.handle)
        if self.ask:
            run.pending_turn = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "wipe", "arguments": '{"disk": "d1"}'}}]}  # fmt: skip
            runs.record_turn(run, run.pending_turn)
            self.allowed[run.handle] = await ask_approval(runs, run, "c1", "wipe", {"disk": "d1"})
        await self.release.setdefault(run.handle, asyncio.Event()).wait()
        runs.finish(run, "finished", result=f"answer to {run.spec.task}")

    async def on_end(self, handle: str) -> None:
        return None

    async def spawn(self, task: str, caller: str = "caller") -> Run:
        return await self.runs.spawn_durably(RunSpec(task=task, model="m"), caller)

    async def stop(self) -> None:
        await self.leases.stop()
        await self.runs.shutdown()
        self.store.close()


async def under(rt: Runtime, parent: Run, task: str) -> Run:
    """A run spawned on `rt` under `parent`, wherever that runs (as the spawn tool looks it up)."""
    (shown,) = await rt.runs.find([parent.handle])
    return await rt.runs.spawn_durably(
        RunSpec(task=task, model="m", parent=parent.handle), "caller", parent=shown
    )


@pytest.fixture
async def pair(postgres_url):
    """Runtimes a and b, with leases long enough that only a notification can wake a waiter in
    the tests' time."""
    a, b = Runtime(postgres_url, "a", 60.0), Runtime(postgres_url, "b", 60.0)
    for r in (a, b):
        r.leases.start()
    yield a, b
    for r in (a, b):
        await r.stop()


async def test_an_await_on_the_other_runtime_wakes_when_the_run_ends(pair):
    a, b = pair
    run = await a.spawn("far away")
    (shown,) = await b.runs.find([run.handle])
    assert shown.status == "running" and b.started == [], "b shows the run; a drives it"
    waiting = asyncio.ensure_future(b.runs.wait_on([shown], "all", 30))
    # b's await is parked on its changes before the run ends, so that the end's notification is
    # what wakes it (asyncio.Condition keeps its parked waiters in `_waiters`).
    await until(lambda: len(b.runs.changes._condition._waiters) == 1, what="b's await to be parked")
    a.release[run.handle].set()
    (ended,), timed_out = await asyncio.wait_for(waiting, 10)  # well within the keeper's 20 s
    assert not timed_out and (ended.status, ended.result) == ("finished", "answer to far away")


async def test_a_cancel_on_the_other_runtime_stops_the_run_where_it_runs(pair):
    a, b = pair
    run = await a.spawn("to cancel")
    await until(lambda: run.handle in a.started, what="a's loop of the run to start")
    loop = run.task
    assert loop is not None
    await b.runs.cancel(run.handle)
    await asyncio.wait_for(run.done.wait(), 10)
    assert (run.status, run.error) == ("cancelled", "cancelled by the client")
    await asyncio.wait([loop], timeout=10)
    assert loop.cancelled(), "a's loop of the run stopped"
    assert [r["type"] for r in b.store.records() if r["run"] == run.handle] == ["spawned", "finished"]


async def test_an_approval_on_the_other_runtime_lets_the_tool_call_run_where_it_waits(pair):
    a, b = pair
    a.ask = True
    run = await a.spawn("wipe it")
    await until(lambda: run.pending_approval is not None, what="the call to wait for approval")
    await a.store.durable()
    (shown,) = await b.runs.find([run.handle])
    assert shown.shown_status() == "AwaitingApproval"
    assert (shown.pending_approval.tool, shown.pending_approval.arguments) == ("wipe", {"disk": "d1"})
    assert decide_approval(b.runs, shown, True) is not None
    await b.store.durable()
    await until(lambda: run.handle in a.allowed, what="a's call to be decided")
    assert a.allowed[run.handle] is True and run.pending_approval is None


async def test_the_runs_of_a_runtime_that_stops_renewing_resume_on_the_other_and_it_writes_no_more(
    postgres_url,
):
    a, b = Runtime(postgres_url, "a", 1.0), Runtime(postgres_url, "b", 1.0)
    b.leases.start()
    try:
        run = await a.spawn("orphaned")
        # a dies: no keeper ever renews its lease.
        began = time.monotonic()
        await until(lambda: run.handle in b.started, what="b to resume the run")
        took = time.monotonic() - began
        # Not before the lease expires (its clock starts at the spawn's commit, a little before
        # spawn returned), and by the keeper's round after it, with room for a loaded machine.
        assert 0.9 <= took <= 1.0 + 1.0 / 3 + 2.0, f"resumed {took:.2f} s after the spawn"
        # a wakes up and goes on with the run: its steps are not written any more.
        a.runs.record_round(run, [{"role": "assistant", "content": "from a"}])
        await a.store.durable()
        assert "round" not in [r["type"] for r in b.store.records() if r["run"] == run.handle]
        b.release[run.handle].set()
        (ended,), timed_out = await b.runs.wait([run.handle], "all", 10)
        assert not timed_out and ended.result == "answer to orphaned"
    finally:
        await a.stop()
        await b.stop()


async def test_a_runtime_restarted_takes_its_own_runs_back_at_once(postgres_url):
    first = Runtime(postgres_url, "a", 60.0)
    run = await first.spawn("across a restart")
    await first.stop()  # as a crash leaves it: the lease still held, for a minute
    again, other = Runtime(postgres_url, "a", 60.0), Runtime(postgres_url, "b", 60.0)
    try:
        restore(other.runs)
        restore(again.runs)
        await until(lambda: run.handle in again.started, what="the restarted runtime to resume its run")
        assert other.started == [], "the lease is a's: b leaves the run alone"
    finally:
        await again.stop()
        await other.stop()


async def test_the_runs_of_a_runtime_that_stopped_cleanly_are_taken_at_the_next_round(postgres_url):
    a, b = Runtime(postgres_url, "a", 60.0), Runtime(postgres_url, "b", 60.0)
    try:
        run = await a.spawn("handed over")
        await a.runs.shutdown()
        a.store.release()  # what a runtime's stop does once its loops have stopped
        await b.leases.tick()  # b's next round, without waiting the 20 s for it
        await until(lambda: b.started == [run.handle], what="b to resume the run")
    finally:
        await a.stop()
        await b.stop()


async def test_a_run_that_ended_on_the_other_runtime_answers_there_and_here(pair):
    a, b = pair
    run = await a.spawn("ended far away")
    a.release[run.handle].set()
    await until(lambda: not run.running, what="a to finish the run")
    await a.store.durable()
    (seen,) = await b.runs.find([run.handle])  # b never saw it running
    assert (seen.status, seen.result) == ("finished", "answer to ended far away")


async def test_a_callers_running_runs_are_counted_on_every_runtime(postgres_url):
    limits = RuntimeSettings(max_running_per_caller=3)
    a, b = Runtime(postgres_url, "a", 60.0, limits), Runtime(postgres_url, "b", 60.0, limits)
    try:
        first, second = await a.spawn("one"), await a.spawn("two")
        third = await b.spawn("three")
        with pytest.raises(SpawnRefused) as refused:
            await b.spawn("four")
        assert str(refused.value).startswith(
            "caller 'caller' has 3 runs running (2 of them on other runtimes sharing the run store), "
            "the most one caller may ([runtime] max_running_per_caller = 3)"
        )
        with pytest.raises(SpawnRefused, match="has 3 runs running \\(1 of them on other runtimes"):
            await a.spawn("four")
        assert (await b.spawn("another caller's", caller="other")).running  # counted apart
        # A run ending anywhere gives its caller's place back everywhere.
        a.release[first.handle].set()
        await until(lambda: not first.running, what="a to finish a run")
        await a.store.durable()
        fourth = await b.spawn("four")
        assert fourth.running and second.running and third.running
    finally:
        for r in (a, b):
            await r.stop()


def test_a_store_at_schema_3_counts_the_callers_of_the_runs_it_already_leased(postgres_url):
    """Migration 4 gives each lease its run's caller, from the run's spawned record; migration 5
    finds the runs spawned under a run."""
    store = PostgresStore(postgres_url, owner="old", lease_s=60.0)
    store.spawned("r1", {"task": "t", "model": "m"}, "someone")
    store.spawned("r2", {"task": "t", "model": "m", "parent": "r1"}, "someone")
    store.writer.flush()
    store.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP INDEX luftpause_records_parent")
        conn.execute("DROP INDEX luftpause_leases_caller")
        conn.execute("ALTER TABLE luftpause_leases DROP COLUMN caller")
        conn.execute("UPDATE luftpause_schema SET version = 3")
    upgraded = PostgresStore(postgres_url, owner="new", lease_s=60.0)
    try:
        assert upgraded.running_elsewhere("someone", 10) == 2
        assert upgraded.running_elsewhere("nobody", 10) == 0
        assert upgraded.children(["r1", "r2"]) == [("r1", "r2")]
    finally:
        upgraded.close()


async def test_a_run_tree_spawned_across_both_runtimes_is_as_deep_as_max_depth_on_either(postgres_url):
    limits = RuntimeSettings(max_depth=3)
    a, b = Runtime(postgres_url, "a", 60.0, limits), Runtime(postgres_url, "b", 60.0, limits)

    try:
        root = await a.spawn("root")
        child = await under(b, root, "child")  # b drives it; its parent is a's
        grandchild = await under(a, child, "grandchild")  # a drives it; its parent is b's
        for rt, parent in ((b, grandchild), (a, grandchild)):
            with pytest.raises(SpawnRefused) as refused:
                await under(rt, parent, "too deep")
            assert str(refused.value).startswith(
                f"run {grandchild.handle} is 3 runs deep (its root counting as one), and a run tree may "
                "be at most 3 deep ([runtime] max_depth = 3)"
            )
    finally:
        for r in (a, b):
            await r.stop()


async def test_a_tree_spawned_across_both_runtimes_is_cancelled_whole_from_either(pair):
    a, b = pair
    for canceller in (a, b):
        root = await a.spawn("root")
        here, there = await under(a, root, "child on a"), await under(b, root, "child on b")
        await canceller.runs.cancel(root.handle)
        tree = (root, here, there)
        await until(lambda: not any(r.running for r in tree), timeout_s=10, what="the tree to be cancelled")  # noqa: B023
        assert [r.status for r in tree] == ["cancelled"] * 3
        # Cancelled where the cancel was asked, as a client's cancel; on the other runtime, as
        # the child of a parent that ended.
        near, far = (here, there) if canceller is a else (there, here)
        assert near.error == "cancelled by the client"
        assert far.error == f"its parent {root.handle} ended (cancelled)"
    # A parent that finishes leaves its children running, on either runtime, as on one.
    root = await a.spawn("root that finishes")
    here, there = await under(a, root, "child on a"), await under(b, root, "child on b")
    (shown,) = await b.runs.find([root.handle])
    a.release[root.handle].set()
    await until(lambda: not shown.running, timeout_s=10, what="b to read that the root finished")
    assert (shown.status, here.running, there.running) == ("finished", True, True)


async def test_a_budget_set_on_one_runtime_caps_the_runs_below_it_on_the_other(pair):
    a, b = pair
    root = await a.runs.spawn_durably(RunSpec(task="root", model="m", budgetToolCalls=1), "caller")
    child = await under(b, root, "child")
    assert b.runs.check_budgets(child, calling_tool=True), "the first call is within the root's budget"
    child.counters["toolCalls"] += 1
    assert not b.runs.check_budgets(child, calling_tool=True), "a second call would pass it"
    assert child.status == "cancelled" and child.error == "budget exceeded: toolCalls 1/1"
    # The whole tree is cancelled: the root too, on the runtime that drives it.
    await until(lambda: not root.running, timeout_s=10, what="a's root to be cancelled by b's trip")
    assert (root.status, root.error) == ("cancelled", "budget exceeded: toolCalls 1/1")


async def test_a_budget_counts_what_its_runs_spent_on_the_other_runtime_ended_or_running(pair):
    a, b = pair
    root = await a.runs.spawn_durably(RunSpec(task="root", model="m", budgetTokens=1000), "caller")
    ended, running = await under(b, root, "ended on b"), await under(b, root, "running on b")
    grandchild = await under(b, running, "below it on b")
    here = await under(a, root, "child on a")
    ended.counters["promptTokens"] = 300
    b.release[ended.handle].set()  # it finishes: its lease is gone, its spend stays
    await until(lambda: not ended.running, what="b's first child to finish")
    running.counters["promptTokens"] = 200
    b.runs.record_turn(running, {"role": "assistant", "content": None, "tool_calls": []})
    grandchild.counters["promptTokens"] = 100
    b.runs.record_turn(grandchild, {"role": "assistant", "content": None, "tool_calls": []})
    await b.store.durable()
    await a.leases.tick()  # a's keeper round, without waiting 20 s for it
    # a's GET /status lists the runs a holds, and shows b's in the root's tree, with their spend.
    runs, (tree,) = status_runs(list(a.runs))
    assert {r["handle"] for r in runs} == {root.handle, here.handle}
    assert tree["handle"] == root.handle and tree["subtree"]["promptTokens"] == 600
    assert tree["budget"]["used"] == {"tokens": 600}
    children = {c["handle"]: c for c in tree["children"]}
    assert children.keys() == {ended.handle, running.handle, here.handle}
    assert [c["handle"] for c in children[running.handle]["children"]] == [grandchild.handle]
    # b's lists its runs, each tree from the first run of it that b holds, its parent named.
    runs, entries = status_runs(list(b.runs))
    assert sorted((e["handle"], e["parent"]) for e in entries) == sorted(
        [(ended.handle, root.handle), (running.handle, root.handle)]
    )
    here.counters["promptTokens"] = 300
    assert a.runs.check_budgets(here), "900 of 1000 tokens spent: the tree goes on"
    here.counters["promptTokens"] = 500
    assert not a.runs.check_budgets(here), "1100 of 1000 spent, 600 of them on b"
    assert (here.status, here.error) == ("cancelled", "budget exceeded: tokens 1100/1000")
    # The trip on a cancels the tree on b too.
    await until(
        lambda: not running.running and not grandchild.running, timeout_s=10, what="b's runs to be cancelled"
    )
    assert running.status == grandchild.status == "cancelled"
    # b counts what a's runs below one of its own roots spent, alike.
    other = await b.runs.spawn_durably(RunSpec(task="root on b", model="m", budgetToolCalls=2), "caller")
    on_a, on_b = await under(a, other, "child on a"), await under(b, other, "child on b")
    on_a.counters["toolCalls"] = 2
    a.runs.record_turn(on_a, {"role": "assistant", "content": None, "tool_calls": []})
    await a.store.durable()
    assert b.runs.check_budgets(on_b, calling_tool=True), "b has not read a's calls yet"
    await b.leases.tick()
    assert not b.runs.check_budgets(on_b, calling_tool=True), "a third call would pass the limit"
    assert on_b.error == "budget exceeded: toolCalls 2/2"


async def test_a_runtime_restarted_links_its_runs_to_their_parents_on_the_other(postgres_url):
    a, b = Runtime(postgres_url, "a", 60.0), Runtime(postgres_url, "b", 60.0)
    a.leases.start()
    try:
        cancelled_root, running_root = await a.spawn("cancelled while b is down"), await a.spawn("running")
        orphaned = await under(b, cancelled_root, "child of the cancelled root")
        kept = await under(b, running_root, "child of the running root")
        await b.stop()  # as a crash leaves it: its leases still held
        await a.runs.cancel(cancelled_root.handle)
        again = Runtime(postgres_url, "b", 60.0)
        try:
            await restore_at_start(again.runs)  # as the runtime's start does (parts.py)
            again.leases.start()
            (was_orphaned, was_kept) = await again.runs.find([orphaned.handle, kept.handle])
            assert (was_orphaned.status, was_orphaned.error) == (
                "cancelled",
                f"its parent {cancelled_root.handle} ended (cancelled)",
            )
            assert was_kept.running and was_kept.parent is not None
            # Linked: the running root's cancel, asked on a, reaches the child b drives now.
            await a.runs.cancel(running_root.handle)
            await until(
                lambda: not was_kept.running, timeout_s=10, what="the restarted b's child to be cancelled"
            )
            assert was_kept.error == f"its parent {running_root.handle} ended (cancelled)"
        finally:
            await again.stop()
    finally:
        await a.stop()


async def test_a_runtime_that_takes_runs_over_links_them_to_their_parents_on_the_other(postgres_url):
    a, b, c = (Runtime(postgres_url, owner, 60.0) for owner in "abc")
    a.leases.start()
    c.leases.start()
    try:
        root = await a.spawn("root on a")
        child = await under(b, root, "child on b, taken over by c")
        await b.runs.shutdown()
        b.store.release()  # b stopped: c takes its runs at its next round
        await c.leases.tick()  # that round, without waiting the 20 s for it
        await until(lambda: c.started == [child.handle], what="c to resume b's run")
        (taken,) = await c.runs.find([child.handle])
        # Linked at the takeover: the root's cancel, asked on a, reaches the child c drives now.
        await a.runs.cancel(root.handle)
        await until(lambda: not taken.running, timeout_s=10, what="c's child to be cancelled with its root")
        assert (taken.status, taken.error) == ("cancelled", f"its parent {root.handle} ended (cancelled)")
    finally:
        for r in (a, b, c):
            await r.stop()


async def test_a_keeper_round_failing_on_an_error_nobody_expected_leaves_the_keeper_going(
    postgres_url, caplog
):
    rt = Runtime(postgres_url, "keeper", 1.5)  # a round every half second
    rounds: list[float] = []
    real_tick = rt.leases.tick

    async def first_round_fails() -> None:
        rounds.append(time.monotonic())
        if len(rounds) == 1:
            raise ValueError("a driver error the store does not translate")
        await real_tick()

    rt.leases.tick = first_round_fails  # type: ignore[method-assign]
    rt.leases.start()
    try:
        await until(lambda: len(rounds) >= 2, timeout_s=10, what="a keeper round after the failed one")
    finally:
        await rt.stop()
    assert "leases not renewed this time; runs driven here go on" in caplog.text
    assert "a driver error the store does not translate" in caplog.text
