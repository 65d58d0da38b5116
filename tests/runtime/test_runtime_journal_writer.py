"""The journal's writer (journal_writer.py): off the event loop, in order, one fsync per batch,
a disk that fails or stalls is an error the waiting step sees, and a batch that failed leaves
none of its lines in the file."""

import asyncio
import errno
import json
import threading

import pytest

from luftpause.runtime import journal_writer
from luftpause.runtime.journal import Journal, read_records
from luftpause.runtime.journal_writer import JournalError, JsonlWriter


async def test_records_of_both_files_keep_their_order_and_share_fsyncs(tmp_path, monkeypatch):
    real_fsync = journal_writer.os.fsync
    gate = threading.Event()
    fsyncs = []

    def slow_fsync(fd):
        gate.wait(5)  # the first batch holds the disk while the rest queue up behind it
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(journal_writer.os, "fsync", slow_fsync)
    writer = JsonlWriter()
    runs, tasks = tmp_path / "runs.jsonl", tmp_path / "tasks.jsonl"
    writer.open(runs)
    writer.open(tasks)
    for i in range(50):
        writer.append(runs, {"n": i})
        writer.append(tasks, {"n": i})
    gate.set()
    await writer.durable()
    assert [r["n"] for r in read_records(runs)] == list(range(50))
    assert [r["n"] for r in read_records(tasks)] == list(range(50))
    # Group commit: far fewer fsyncs than the hundred records (one per file per batch).
    assert len(fsyncs) < 10
    writer.close()


async def test_a_full_disk_fails_the_waiting_step_and_every_later_one(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_writer.os, "fsync", full)
    journal = Journal(tmp_path)
    journal.spawned("run-1", {"task": "t"}, None)
    with pytest.raises(JournalError) as failed:
        await journal.durable()
    assert str(failed.value) == f"cannot write the journal {tmp_path / 'runs.jsonl'}: No space left on device"
    with pytest.raises(JournalError):
        journal.spawned("run-2", {"task": "t"}, None)
    with pytest.raises(JournalError):
        await journal.durable()


async def test_a_stalled_disk_is_an_error_in_time_and_the_event_loop_runs_on(tmp_path, monkeypatch):
    stalled = threading.Event()
    monkeypatch.setattr(journal_writer.os, "fsync", lambda fd: stalled.wait(10))
    writer = JsonlWriter()
    path = tmp_path / "runs.jsonl"
    writer.open(path)
    writer.append(path, {"n": 1})
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    beat = asyncio.create_task(ticker())
    with pytest.raises(JournalError) as slow:
        await writer.durable(timeout_s=0.3)
    beat.cancel()
    assert (
        str(slow.value) == "the disk took more than 0.3 s to write the journal; the step is not acknowledged"
    )
    assert ticks >= 5  # the loop kept running while the disk stalled
    stalled.set()
    writer.close()
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == [1]


async def test_a_failed_batch_leaves_none_of_its_lines_for_a_later_start(tmp_path, monkeypatch):
    # The write went through but its fsync failed: the step is refused, so its line must go.
    writer = JsonlWriter()
    path = tmp_path / "runs.jsonl"
    writer.open(path)
    writer.append(path, {"n": 1})
    await writer.durable()
    real_fsync = journal_writer.os.fsync
    full = {"on": True}

    def fsync(fd):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(journal_writer.os, "fsync", fsync)
    writer.append(path, {"n": 2})
    with pytest.raises(JournalError):
        await writer.durable()
    full["on"] = False  # space again, then the runtime stops: closing writes nothing more
    writer.close()
    assert [r["n"] for r in read_records(path)] == [1]
