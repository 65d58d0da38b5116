"""The PostgreSQL run store against a real server: the records it keeps, its schema, and what a
user sees when the store is misnamed, unreachable, or goes down while runs run."""

import asyncio
import dataclasses
import subprocess
import sys

import psycopg
import pytest
from support import PostgresUnavailable, amend_config, free_port, start_postgres, write_runtime_config

from luftpause.config import RuntimeSettings
from luftpause.runtime.journal import Journal, ReplayedRun
from luftpause.runtime.journal_writer import JournalError
from luftpause.runtime.postgres_store import RETRY_S, SCHEMA_VERSION, PostgresStore
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.store import StoreUnavailable

COUNTERS = {"toolCalls": 1, "failedToolCalls": 0, "turns": 1, "promptTokens": 10, "completionTokens": 1}


def _write_a_run(store) -> None:
    store.spawned("run-1", {"task": "t", "model": "m"}, "caller-1", owner="o")
    store.turn("run-1", {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, COUNTERS)
    store.call("run-1", {"role": "tool", "tool_call_id": "c1", "content": "r\u0000 é"}, COUNTERS)
    store.asked("run-1", "c2", "wipe", 1e10)
    store.approval("run-1", "c2", "wipe", True)
    store.round("run-1", [{"role": "assistant", "content": None}], COUNTERS)
    store.finished("run-1", "finished", "answer", None, COUNTERS)


async def test_the_store_keeps_the_records_the_journal_file_keeps(tmp_path, postgres_url):
    stores = [Journal(tmp_path), PostgresStore(postgres_url)]
    for store in stores:
        _write_a_run(store)
        await store.durable()
    kept = [[{k: v for k, v in r.items() if k != "at"} for r in s.records()] for s in stores]
    replayed = [[_untimed(r) for r in s.replay()] for s in stores]
    for store in stores:
        store.close()
    assert kept[0] == kept[1] and len(kept[0]) == 7
    assert replayed[0] == replayed[1] and replayed[1][0].finished["result"] == "answer"


def _untimed(run: ReplayedRun) -> ReplayedRun:
    return dataclasses.replace(run, spawned_at=0.0, finished={**(run.finished or {}), "at": 0.0})


def test_the_runtime_creates_its_tables_and_refuses_a_schema_newer_than_it_knows(postgres_url):
    PostgresStore(postgres_url).close()
    PostgresStore(postgres_url).close()  # a second start migrates nothing
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM luftpause_schema").fetchall() == [(SCHEMA_VERSION,)]
        conn.execute("UPDATE luftpause_schema SET version = version + 1")
    with pytest.raises(
        StoreUnavailable, match=f"schema version {SCHEMA_VERSION + 1}, newer than this runtime"
    ):
        PostgresStore(postgres_url)


def test_a_store_that_is_no_url_is_refused_by_the_config_naming_the_setting():
    with pytest.raises(ValueError, match='neither "file" nor a PostgreSQL URL'):
        RuntimeSettings(store="mysql://db/runs")


def test_an_unreachable_store_is_an_error_naming_the_setting_without_the_password():
    url = f"postgresql://luftpause:s3cret@127.0.0.1:{free_port()}/runs"
    with pytest.raises(StoreUnavailable) as refused:
        PostgresStore(url)
    message = str(refused.value)
    assert "[runtime] store" in message and "cannot be reached" in message and "Start PostgreSQL" in message
    assert "s3cret" not in message and "postgresql://luftpause@127.0.0.1" in message


def test_the_runtime_does_not_start_on_an_unreachable_store_and_says_why(tmp_path):
    config = write_runtime_config(tmp_path, free_port(), free_port(), free_port(), tmp_path / "state")
    amend_config(config, {"runtime": {"store": f"postgresql://u@127.0.0.1:{free_port()}/x"}})
    done = subprocess.run(
        [sys.executable, "-m", "luftpause", "runtime", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "luftpause runtime: the run store postgresql://u@127.0.0.1" in done.stderr
    assert "([runtime] store) cannot be reached" in done.stderr


async def test_while_the_database_is_down_spawn_is_refused_and_steps_wait_then_nothing_is_lost():
    try:
        server = start_postgres()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    hold = asyncio.Event()

    async def idle(runs: Runs, run: Run) -> None:
        await hold.wait()

    async def no_end(handle: str) -> None:
        return None

    try:
        store = PostgresStore(server.url())
        runs = Runs(store, idle, no_end)
        running = await runs.spawn_durably(RunSpec(task="before", model="m"), None)
        server.stop()
        # A spawn first reads how many runs its caller has on other runtimes: that read finds the
        # outage, and the spawn is refused before anything is queued.
        with pytest.raises(JournalError, match=r"cannot be reached.*spawn is refused until it is back"):
            await asyncio.wait_for(runs.spawn_durably(RunSpec(task="refused early", model="m"), None), 30)
        # Had the database gone down just after that read, the spawn is queued; the writer has not
        # met the outage yet: the spawn finds it, and is refused within seconds.
        store.running_elsewhere = lambda caller, at_most: 0  # type: ignore[method-assign]
        with pytest.raises(JournalError, match=r"cannot be reached.*spawn is refused until it is back"):
            await asyncio.wait_for(runs.spawn_durably(RunSpec(task="during", model="m"), None), 30)
        runs.record_round(running, [{"role": "assistant", "content": "during"}])
        step = asyncio.ensure_future(store.durable())
        # Two of the writer's tries at the database pass with the step queued: it waits, it does not fail.
        await asyncio.wait({step}, timeout=2 * RETRY_S)
        assert not step.done(), "a step waits for the store, it does not fail"
        with pytest.raises(JournalError, match=r"cannot be reached.*spawn is refused until it is back"):
            runs.spawn(RunSpec(task="still down", model="m"), None)  # refused before anything is queued
        server.start()
        await asyncio.wait_for(step, 30)
        assert store.writer.unreachable is None
        records = store.records()
        assert [r["type"] for r in records if r["run"] == running.handle] == ["spawned", "round"]
        others = [r for r in records if r["run"] != running.handle]
        assert [(r["type"], r["spec"]["task"] if "spec" in r else r["status"]) for r in others] == [
            ("spawned", "during"),
            ("finished", "failed"),
        ], "the refused spawn reached the store after all, and ended there: nothing resumes it"
        assert others[1]["error"].startswith("spawn refused: the run store")
        with psycopg.connect(server.url()) as conn:
            leases = [h for (h,) in conn.execute("SELECT run FROM luftpause_leases")]
        assert leases == [running.handle]
        await runs.shutdown()
        store.close()
    finally:
        server.remove()
