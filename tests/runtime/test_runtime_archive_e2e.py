"""The archive answers fast, off the event loop, and whole; it is trimmed by its retention window.

Real processes on loopback: a fake engine standing in for the dataplane, the fake MCP server and
`luftpause runtime`, driven by the official `mcp` client. Before the runtime starts:

- `archive.jsonl` holds 5,000 runs (7.5 MB, as a busy week leaves it): `await` on 1,000 of them
  in one call must answer within AWAIT_BOUND_S while `/metrics`, polled all along, answers every
  time within METRICS_BOUND_S (each handle used to be a scan of the whole file, on the event loop:
  4.2 s, and /metrics stalled 3.9 s);
- `runs.jsonl` holds a tree that finished ten minutes ago, whose root's tool-call budget tripped:
  the start moves it to the archive, and the root still answers with its children, its
  budget's use over the whole subtree, its seconds stopped when the last run ended, and the
  `budget exceeded` message;
- the archive holds a tree that ended two hours ago, past `[runtime] archive_retention_s` (an
  hour here): the start trims it, and its handles are unknown from then on.
"""

import asyncio
import json
import time

import httpx
from mcp import Client
from support import amend_config, call
from test_runtime_e2e import backends, error_of, make_runtime  # noqa: F401 (backends: the fixture)

ARCHIVED, AWAITED = 5000, 1000
# The await took 4.2 s and stalled /metrics for 3.9 s when each handle was a scan of the file on
# the event loop: bounds well under those, with room for a loaded machine.
AWAIT_BOUND_S = 2.0
METRICS_BOUND_S = 1.5


def _spec(task: str, parent: str | None = None, **budget) -> dict:
    return {"task": task, "model": "fake-llama", "serviceClass": "interactive", "system": None,
            "maxToolCalls": 8, "tools": None, "maxTokens": 16, "parallelToolCalls": False, "parent": parent,
            "budgetTokens": None, "budgetToolCalls": None, "budgetSeconds": None, "approveTools": None,
            **budget}  # fmt: skip


def _archived(handle: str, at: float, result: str, parent: str | None = None) -> dict:
    return {"v": 1, "type": "archived", "run": handle, "at": at, "spec": _spec("t", parent), "caller": None,
            "owner": None, "spawnedAt": at - 5, "status": "finished", "result": result, "error": None,
            "toolCalls": 1, "turns": 2}  # fmt: skip


def _journaled(
    handle: str, spawned_at: float, ended_at: float, spec: dict, error: str, **counters
) -> list[dict]:
    return [
        {"v": 1, "type": "spawned", "run": handle, "at": spawned_at, "spec": spec, "caller": None},
        {
            "v": 1,
            "type": "finished",
            "run": handle,
            "at": ended_at,
            "status": "cancelled",
            "result": None,
            "error": error,
            **counters,
        },  # fmt: skip
    ]


EXCEEDED = "budget exceeded: toolCalls 1/1"


def _prepare(rt, now: float) -> None:
    config = rt.state_dir.parent / "luftpause.toml"
    amend_config(config, "[runtime]\narchive_retention_s = 3600")
    rt.state_dir.mkdir()
    with (rt.state_dir / "archive.jsonl").open("w") as f:
        for i in range(ARCHIVED):
            result = f"answer {i}" if i % 5 == 0 else "x" * 1800
            f.write(json.dumps(_archived(f"run-arch-{i:05d}", now - 600 - i / 2, result)) + "\n")
        f.write(json.dumps(_archived("run-ancient", now - 7200, "too old")) + "\n")
        f.write(json.dumps(_archived("run-ancient-kid", now - 7300, "too old", parent="run-ancient")) + "\n")
    root = _spec("budgeted root", budgetToolCalls=1, budgetSeconds=3600)
    tree = [
        *_journaled("run-tripped-root", now - 620, now - 600, root, EXCEEDED, toolCalls=0, turns=1),
        *_journaled(
            "run-tripped-a", now - 615, now - 601, _spec("a", "run-tripped-root"), EXCEEDED, toolCalls=1
        ),
        *_journaled(
            "run-tripped-b", now - 614, now - 602, _spec("b", "run-tripped-root"), EXCEEDED, toolCalls=0
        ),
    ]
    rt.journal.write_text("".join(json.dumps(r) + "\n" for r in tree))


async def test_await_on_1000_archived_runs_is_fast_and_metrics_keep_answering(tmp_path, backends):  # noqa: F811
    rt = make_runtime(tmp_path, backends)
    _prepare(rt, time.time())
    assert (rt.state_dir / "archive.jsonl").stat().st_size > 7_000_000
    rt.start()
    awaited = [f"run-arch-{i:05d}" for i in range(0, ARCHIVED, ARCHIVED // AWAITED)]
    try:
        async with Client(rt.url, mode="legacy") as client, httpx.AsyncClient() as http:
            stop, slowest, polls = asyncio.Event(), 0.0, 0

            async def poll_metrics() -> None:
                nonlocal slowest, polls
                while not stop.is_set():
                    started = time.monotonic()
                    answer = await http.get(f"http://127.0.0.1:{rt.port}/metrics", timeout=10)
                    assert answer.status_code == 200
                    slowest, polls = max(slowest, time.monotonic() - started), polls + 1
                    await asyncio.sleep(0.02)  # the poll's pace, not a wait for a condition

            poller = asyncio.create_task(poll_metrics())
            started = time.monotonic()
            answer = await call(client, "await", handles=awaited, timeout=60)
            took = time.monotonic() - started
            stop.set()
            await poller
        print(f"await on {AWAITED} archived runs: {took:.2f} s; slowest /metrics {slowest:.3f} s of {polls}")
        assert answer["timedOut"] is False and len(answer["runs"]) == AWAITED
        assert [r["result"] for r in answer["runs"]] == [f"answer {i}" for i in range(0, ARCHIVED, 5)]
        assert took < AWAIT_BOUND_S, f"await on {AWAITED} archived runs took {took:.2f} s"
        assert polls >= 2 and slowest < METRICS_BOUND_S, f"/metrics took {slowest:.2f} s during the await"
    finally:
        rt.service.stop()


async def test_an_archived_tree_comes_back_whole_and_an_old_one_is_trimmed(tmp_path, backends):  # noqa: F811
    rt = make_runtime(tmp_path, backends)
    _prepare(rt, time.time())
    rt.start()
    try:
        archive = [
            json.loads(line)["run"] for line in (rt.state_dir / "archive.jsonl").read_text().splitlines()
        ]
        assert "run-tripped-root" in archive, "the start moved the old tree to the archive"
        assert "run-ancient" not in archive and "run-ancient-kid" not in archive, "the start trimmed it"
        async with Client(rt.url, mode="legacy") as client:
            (root,) = (await call(client, "status", handle="run-tripped-root"))["runs"]
            assert root["children"] == ["run-tripped-a", "run-tripped-b"]
            assert root["budget"] == {
                "limits": {"toolCalls": 1, "seconds": 3600},
                "used": {"toolCalls": 1, "seconds": 20.0},
                "exceeded": EXCEEDED,
            }
            (child,) = (await call(client, "await", handles=["run-tripped-a"], timeout=5))["runs"]
            assert (child["parent"], child["error"], child["budget"]) == ("run-tripped-root", EXCEEDED, None)
            gone = await error_of(client, "status", handle="run-ancient")
            assert "unknown run handle 'run-ancient'" in gone
    finally:
        rt.service.stop()
