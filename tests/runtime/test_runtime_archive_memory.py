"""Eviction's memory does not grow with the archive: the soak's slow growth of the runtime.

Every eviction pass (each tenth of the retention window) used to read and parse all of
archive.jsonl to skip runs already there; the archive only grows, so each pass needed more
memory than the last, and the runtime's resident memory crept up with it (0.12 MiB a minute in a
45-minute soak). A pass now costs what the runs leaving memory cost, whatever the archive holds;
and asking for one archived run reads its one line, by the archive's index of offsets (built by one
scan a line at a time, some 130 bytes a run), instead of all of the archive at once.
"""

import json
import tracemalloc

from luftpause.runtime.journal import Journal, read_records
from luftpause.runtime.restore import evict
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec

# As many archived runs as a busy day leaves, each with a result of a few KB.
ARCHIVED = 2000


async def _finish_at_once(runs: Runs, run: Run) -> None:
    runs.finish(run, "finished", result=f"answer to {run.spec.task}")


async def _noop(handle: str) -> None:
    return None


async def test_an_eviction_pass_needs_no_more_memory_with_a_large_archive(tmp_path):
    with (tmp_path / "archive.jsonl").open("w") as f:
        for i in range(ARCHIVED):
            record = {"v": 1, "type": "archived", "run": f"run-old-{i}", "at": 1.0, "spec": {"task": "t", "model": "m"},
                      "caller": None, "owner": None, "status": "finished", "result": "x" * 2000 + str(i)}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    size_before = (tmp_path / "archive.jsonl").stat().st_size
    runs = Runs(Journal(tmp_path), _finish_at_once, _noop)
    run = runs.spawn(RunSpec(task="new", model="m"), None)
    await runs.wait([run.handle], "all", 5)

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        assert await evict(runs, retention_s=0, now=run.finished_at + 1) == 1
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()

    # Parsing the archive would take well over its 4 MB on disk; the one run leaving takes little.
    assert peak < size_before / 8, (
        f"an eviction pass peaked at {peak / 1e6:.1f} MB with a {size_before / 1e6:.1f} MB archive"
    )
    archived = read_records(tmp_path / "archive.jsonl")
    assert len(archived) == ARCHIVED + 1 and archived[-1]["run"] == run.handle
    (answer,), _ = await runs.wait([run.handle], "all", 0)
    assert (answer.status, answer.result) == ("finished", "answer to new"), "the archive answers for it"
    await runs.shutdown()
    runs.journal.close()


async def test_asking_for_an_archived_run_needs_no_more_memory_with_a_large_archive(tmp_path):
    with (tmp_path / "archive.jsonl").open("w") as f:
        for i in range(ARCHIVED):
            record = {"v": 1, "type": "archived", "run": f"run-old-{i}", "at": 1.0, "spec": {"task": "t", "model": "m"},
                      "caller": None, "owner": None, "status": "finished", "result": f"answer {i} " + "x" * 2000}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    size = (tmp_path / "archive.jsonl").stat().st_size
    runs = Runs(Journal(tmp_path), _finish_at_once, _noop)

    tracemalloc.start()
    try:
        (answer,), _ = await runs.wait([f"run-old-{ARCHIVED // 2}"], "all", 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert (answer.status, answer.result[:12]) == ("finished", f"answer {ARCHIVED // 2} ")
    assert peak < size / 8, f"one lookup peaked at {peak / 1e6:.1f} MB with a {size / 1e6:.1f} MB archive"
    await runs.shutdown()
    runs.journal.close()
