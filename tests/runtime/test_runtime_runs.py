"""Runs: waiting on them (all, any, timeout), cancelling them, and restoring them from the journal.

The sub-agent loop is replaced by a driver the test controls, so each case is exact and instant.
"""

import asyncio
import errno
import logging

import pytest
from support import until

from luftpause.runtime import journal_writer
from luftpause.runtime.journal import Journal, read_records
from luftpause.runtime.journal_writer import JournalError
from luftpause.runtime.restore import evict, restore
from luftpause.runtime.run import Run, UnknownRun
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec


class Script:
    """A driver whose runs finish when the test says so, and that records what it was given."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.started: list[tuple[str, list[dict]]] = []
        self.ended: list[str] = []

    async def drive(self, runs: Runs, run: Run) -> None:
        self.started.append((run.handle, list(run.messages)))
        gate = self.release.setdefault(run.handle, asyncio.Event())
        await gate.wait()
        runs.finish(run, "finished", result=f"answer to {run.spec.task}")

    async def on_end(self, handle: str) -> None:
        self.ended.append(handle)

    def finish(self, handle: str) -> None:
        self.release.setdefault(handle, asyncio.Event()).set()


def spec(task: str = "t", **kw) -> RunSpec:
    return RunSpec(task=task, model="m", **kw)


@pytest.fixture
def script():
    return Script()


@pytest.fixture
def runs(tmp_path, script):
    registry = Runs(Journal(tmp_path), script.drive, script.on_end)
    yield registry
    registry.journal.close()


async def test_await_all_returns_when_every_run_has_ended(runs, script):
    a, b = runs.spawn(spec("a"), None), runs.spawn(spec("b"), None)
    waiter = asyncio.create_task(runs.wait([a.handle, b.handle], "all", 10))
    script.finish(a.handle)
    (first,), _ = await runs.wait([a.handle], "all", 5)
    assert first.status == "finished"
    # One of the two has ended: an await of all of them still waits, until its timeout.
    result, timed_out = await runs.wait([a.handle, b.handle], "all", 0.2)
    assert timed_out and [r.status for r in result] == ["finished", "running"]
    assert not waiter.done()
    script.finish(b.handle)
    result, timed_out = await asyncio.wait_for(waiter, 5)
    assert [r.status for r in result] == ["finished", "finished"] and not timed_out
    assert result[0].result == "answer to a"


async def test_await_any_returns_when_the_first_run_ends(runs, script):
    a, b = runs.spawn(spec("a"), None), runs.spawn(spec("b"), None)
    waiter = asyncio.create_task(runs.wait([a.handle, b.handle], "any", 10))
    script.finish(b.handle)
    result, timed_out = await asyncio.wait_for(waiter, 5)
    assert [r.status for r in result] == ["running", "finished"] and not timed_out


async def test_await_times_out_with_the_runs_still_running(runs):
    a = runs.spawn(spec("a"), None)
    result, timed_out = await runs.wait([a.handle], "all", 0.05)
    assert timed_out and result[0].status == "running"


async def test_await_of_an_unknown_handle_is_an_error(runs):
    a = runs.spawn(spec("a"), None)
    with pytest.raises(UnknownRun, match="unknown run handle 'nope'"):
        await runs.wait([a.handle, "nope"], "all", 1)


async def test_cancel_ends_a_running_run_and_journals_it(runs, script, tmp_path):
    a = runs.spawn(spec("a"), None)
    await until(lambda: script.started, what="the run's loop to start")
    loop = a.task
    cancelled = await runs.cancel(a.handle)
    assert cancelled.status == "cancelled" and loop.cancelled()
    assert a.task is None, "a run that has ended lets go of its stopped loop"
    await until(lambda: script.ended)
    assert script.ended == [a.handle]
    ends = [r for r in read_records(tmp_path / "runs.jsonl") if r["type"] == "finished"]
    assert [(r["run"], r["status"]) for r in ends] == [(a.handle, "cancelled")]
    # A run that has ended stays as it ended.
    assert (await runs.cancel(a.handle)).status == "cancelled"


async def test_shutdown_stops_loops_without_ending_their_runs(runs, script, tmp_path):
    a = runs.spawn(spec("a"), None)
    await until(lambda: script.started, what="the run's loop to start")
    await runs.shutdown()
    assert a.task.cancelled() and a.status == "running"
    assert [r["type"] for r in read_records(tmp_path / "runs.jsonl")] == ["spawned"]


async def test_restore_answers_for_ended_runs_and_resumes_the_others_from_their_last_round(stores):
    first = Script()
    before = Runs(stores.open(), first.drive, first.on_end)
    done = before.spawn(spec("done", system="be brief"), "caller-1")
    open_run = before.spawn(spec("open"), "caller-2")
    first.finish(done.handle)
    await before.wait([done.handle], "all", 5)
    open_run.counters.update(toolCalls=1, turns=1)
    round_messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    before.record_round(open_run, round_messages)
    await before.shutdown()
    before.journal.close()

    second = Script()
    after = Runs(stores.open(), second.drive, second.on_end)
    restore(after)
    restored_done = after.get(done.handle)
    assert (restored_done.status, restored_done.result) == ("finished", "answer to done")
    result, timed_out = await after.wait([done.handle], "all", 0)
    assert not timed_out and result[0].result == "answer to done"

    await until(lambda: second.started, what="the open run to resume")
    assert [h for h, _ in second.started] == [open_run.handle]
    resumed_messages = second.started[0][1]
    assert resumed_messages == [{"role": "user", "content": "open"}, *round_messages]
    resumed = after.get(open_run.handle)
    assert resumed.caller == "caller-2" and resumed.counters["toolCalls"] == 1 and resumed.running
    second.finish(open_run.handle)
    result, _ = await after.wait([open_run.handle], "all", 5)
    assert result[0].status == "finished"
    await after.shutdown()
    after.journal.close()


async def test_a_run_the_journal_names_its_own_parent_is_restored_alone_and_can_be_cancelled(stores):
    journal = stores.open()
    journal.spawned("loop", spec("round and round", parent="loop").model_dump(), "c")
    journal.close()
    script = Script()
    after = Runs(stores.open(), script.drive, script.on_end)
    restore(after)
    run = after.get("loop")
    assert run.parent is None and list(run.subtree()) == [run] and list(run.ancestors()) == [run]
    await asyncio.wait_for(after.cancel("loop"), 5)
    assert run.status == "cancelled"
    await after.shutdown()
    after.journal.close()


def _fill_the_disk(monkeypatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_writer.os, "fsync", full)


async def test_a_run_whose_step_cannot_be_journaled_fails_saying_so(tmp_path, monkeypatch):
    stepped = asyncio.Event()

    async def one_step_then_wait(runs: Runs, run: Run) -> None:
        await stepped.wait()
        runs.record_round(run, [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}])
        await runs.journal.durable()  # as a tool round is acknowledged
        runs.finish(run, "finished", result="never")

    registry = Runs(Journal(tmp_path), one_step_then_wait, Script().on_end)
    run = await registry.spawn_durably(spec("t"), "c")
    _fill_the_disk(monkeypatch)
    stepped.set()
    (result,), timed_out = await registry.wait([run.handle], "all", 5)
    assert not timed_out and result.status == "failed"
    assert (
        result.error.startswith("journal: cannot write the journal")
        and "No space left on device" in result.error
    )
    await registry.shutdown()


async def test_spawn_is_refused_while_the_journal_cannot_be_written_and_leaves_no_run(tmp_path, monkeypatch):
    script = Script()
    registry = Runs(Journal(tmp_path), script.drive, script.on_end)
    _fill_the_disk(monkeypatch)
    with pytest.raises(JournalError, match="No space left on device"):
        await registry.spawn_durably(spec("first"), "c")  # the write of its own record fails
    with pytest.raises(JournalError, match="No space left on device"):
        await registry.spawn_durably(spec("second"), "c")  # and every one after
    assert registry.roots() == [], "no run goes on in memory that the journal does not have"
    loops = [t for t in asyncio.all_tasks() if t.get_name().startswith("run:")]
    if loops:
        await asyncio.wait(loops, timeout=5)
    assert all(t.cancelled() for t in loops), "the loop of a run taken back is stopped"
    await registry.shutdown()


async def test_old_finished_trees_move_to_the_archive_and_still_answer(stores):
    script = Script()
    before = Runs(stores.open(), script.drive, script.on_end)
    old = before.spawn(spec("old"), "c")
    child = before.spawn(spec("old child", parent=old.handle), "c")
    recent = before.spawn(spec("recent"), "c")
    open_run = before.spawn(spec("open"), "c")
    for r in (old, child, recent):
        script.finish(r.handle)
    await before.wait([old.handle, child.handle, recent.handle], "all", 5)
    before.record_round(open_run, [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "r"}])  # fmt: skip
    await before.journal.durable()
    # While it runs: a tree all finished longer ago than the window leaves memory, and answers.
    later = old.finished_at + 100
    recent.finished_at = later - 10  # as if it had ended well after the others
    assert await evict(before, retention_s=50, now=later) == 2
    assert {r.handle for r in before} == {recent.handle, open_run.handle}
    (answer,), _ = await before.wait([old.handle], "all", 0)
    assert (answer.status, answer.result) == ("finished", "answer to old")
    await before.shutdown()
    before.journal.close()
    # The file keeps their records until the next start; PostgreSQL drops them with the eviction.
    left = {r["run"] for r in stores.records()}
    assert (old.handle in left) is (stores.kind == "file") and (child.handle in left) is (
        stores.kind == "file"
    )

    # At the next start the journal is compacted: finished runs keep two records, old trees none.
    lines_before = len(stores.records())
    second = Script()
    after = Runs(stores.open(), second.drive, second.on_end)
    restore(after, retention_s=1e9)  # nothing newly old: only the rounds of finished runs go
    records = stores.records()
    assert len(records) < lines_before or stores.kind == "postgresql"
    assert {r["run"] for r in records} == {recent.handle, open_run.handle}
    assert [r["type"] for r in records if r["run"] == recent.handle] == ["spawned", "finished"]
    assert [r["type"] for r in records if r["run"] == open_run.handle] == ["spawned", "round"]
    assert after.get(child.handle).result == "answer to old child", "the archive answers after a restart"
    await until(lambda: second.started, what="the open run to resume")
    assert [h for h, _ in second.started] == [open_run.handle]
    assert second.started[0][1][-1] == {"role": "tool", "tool_call_id": "c1", "content": "r"}
    await after.shutdown()
    after.journal.close()


async def test_a_compaction_at_start_archives_old_trees_once(stores):
    script = Script()
    before = Runs(stores.open(), script.drive, script.on_end)
    done = before.spawn(spec("done"), "c")
    script.finish(done.handle)
    await before.wait([done.handle], "all", 5)
    await before.shutdown()
    before.journal.close()
    for _ in range(2):  # a second start finds nothing more to do
        after = Runs(stores.open(), Script().drive, Script().on_end)
        restore(after, retention_s=0)
        assert list(after) == [] and after.get(done.handle).status == "finished"
        await after.shutdown()
        after.journal.close()
    assert stores.archived(done.handle)["status"] == "finished"
    assert stores.records() == []


async def test_a_start_warns_once_of_each_journal_record_it_skips(tmp_path, caplog):
    """Compaction and the replay after it read the same file: a damaged record is said once."""
    journal = Journal(tmp_path)
    journal.spawned("a", {"task": "ta"}, None)
    journal.close()
    with (tmp_path / "runs.jsonl").open("a") as f:
        f.write('{"v":1,"type":"spawned","run":"b","at":"yesterday","spec":{"task":"tb"}}\n')
        f.write('{"v":1,"type":"spawned","run":"c","spec":{"ta')  # torn by a crash
    with caplog.at_level(logging.WARNING):
        after = Runs(Journal(tmp_path), Script().drive, Script().on_end)
        restore(after, retention_s=1e9)
    malformed = [m for m in caplog.messages if "malformed" in m]
    torn = [m for m in caplog.messages if "not a complete JSON record" in m]
    assert len(malformed) == 1 and "'b'" in malformed[0], caplog.messages
    assert len(torn) == 1 and "line 3" in torn[0], caplog.messages
    await after.shutdown()
    after.journal.close()
