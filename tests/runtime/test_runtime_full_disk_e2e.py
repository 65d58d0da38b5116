"""A full disk under a real runtime's journal, as its MCP client sees it, and the restart after.

Real processes on loopback: a fake engine (standing in for the dataplane), the fake MCP server
(every tool call takes a second) and `luftpause runtime`, driven by the official `mcp` client.
The disk fills only for the runtime, and only under its state directory: `full_disk_site.py`,
put on its PYTHONPATH as `sitecustomize`, makes every write there fail with ENOSPC while a
trigger file exists: the bytes do not reach the file (a buffered file keeps them in its
buffer), as on a real full disk.

One run finishes while the disk is fine; a second is in its first tool call when the disk fills.
Then a spawn is refused with the reason, the running run ends `failed` with `journal: ...`,
await says the journal cannot be written, and nothing stays running. Space is freed and the
runtime stopped with Ctrl-C (SIGINT) and started again: the finished run is as it was, the
refused spawn left no run behind (its record, refused by the disk, must not reach the journal
when the files are closed once there is space again), and the run the disk stopped resumes from
its journal and finishes, as the README says.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import httpx
from mcp import Client
from support import runtime_beside_fakes, task_planning, until, wait_until

SITE = Path(__file__).resolve().parent / "full_disk_site.py"
NO_SPACE = os.strerror(28)  # ENOSPC: "No space left on device"


def journal(state: Path) -> list[dict]:
    path = state / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


async def views(client: Client) -> dict[str, dict]:
    """Every run the client may see, as the status tool says it, by handle."""
    result = await client.call_tool("status", {})
    assert not result.is_error, result.content
    return {r["handle"]: r for r in result.structured_content["runs"]}


async def test_a_full_disk_fails_runs_clearly_and_a_restart_agrees_with_what_was_said(tmp_path):
    state, trigger = tmp_path / "state", tmp_path / "disk-is-full"
    inject = tmp_path / "inject"
    inject.mkdir()
    shutil.copy(SITE, inject / "sitecustomize.py")
    fakes = runtime_beside_fakes(tmp_path, state, tool_latency_s=1)
    engine, tools, runtime = fakes.engine, fakes.tools, fakes.runtime
    port, engine_port, mcp_port = fakes.port, fakes.engine_port, fakes.mcp_port
    full_disk = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")])),
        "LUFTPAUSE_TEST_FULL_DISK_DIR": str(state),
        "LUFTPAUSE_TEST_FULL_DISK_TRIGGER": str(trigger),
    }
    url = f"http://127.0.0.1:{port}/mcp"

    def start_runtime() -> None:
        runtime.start(env=full_disk)
        runtime.wait_http(f"http://127.0.0.1:{port}/status")

    def status_page() -> dict:
        return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()

    try:
        engine.start(), tools.start()
        engine.wait_http(f"http://127.0.0.1:{engine_port}/health")
        tools.wait_http(f"http://127.0.0.1:{mcp_port}/health")
        start_runtime()
        refused_task = "spawned while the disk is full"
        async with Client(url) as client:
            done = await client.call_tool("spawn", {"task": task_planning(1, "before the disk fills")})
            finished = done.structured_content["handle"]
            awaited = await client.call_tool("await", {"handles": [finished], "timeout": 60})
            assert not awaited.is_error, awaited.content
            assert awaited.structured_content["runs"][0]["status"] == "finished"

            cut = await client.call_tool("spawn", {"task": task_planning(3, "cut by the disk")})
            cut = cut.structured_content["handle"]
            wait_until(
                lambda: any(r["type"] == "turn" and r["run"] == cut for r in journal(state)),
                timeout_s=30,
                what="the second run's first tool call to begin",
            )

            trigger.touch()
            refused = await client.call_tool("spawn", {"task": refused_task})
            assert refused.is_error, refused.content
            assert NO_SPACE in refused.content[0].text and "journal" in refused.content[0].text

            async def cut_ended() -> dict | None:
                view = (await views(client))[cut]
                return view if view["status"] != "running" else None

            # Its call in flight takes a second; the record of its answer is its next write.
            ended = await until(
                cut_ended, timeout_s=30, what="the run the disk stopped to end", interval_s=0.05
            )
            assert ended["status"] == "failed"
            assert ended["error"].startswith("journal: ") and NO_SPACE in ended["error"], ended["error"]

            cannot = await client.call_tool("await", {"handles": [cut], "timeout": 5})
            assert cannot.is_error and NO_SPACE in cannot.content[0].text, cannot.content

            before = await views(client)
            assert set(before) == {finished, cut}, "the refused spawn must leave no run"
            assert [r["status"] for r in status_page()["runs"] if r["status"] == "running"] == []

        # Space is freed, then the runtime stopped as a person at its terminal does (Ctrl-C):
        # its files are closed on the way out, so nothing the disk refused may be written then.
        trigger.unlink()
        runtime.kill(signal.SIGINT)
        # Its stop runs to the end (the journal's failure does not cut it short).
        assert "shutdown failed" not in runtime.output(), runtime.output()[-3000:]
        start_runtime()
        async with Client(url) as client:
            after = await views(client)
            assert set(after) == {finished, cut}, f"runs after the restart: {after}"
            assert refused_task not in [r["task"] for r in status_page()["runs"]]
            assert {k: after[finished][k] for k in ("status", "result", "error", "toolCalls")} == {
                k: before[finished][k] for k in ("status", "result", "error", "toolCalls")
            }
            # The journal never had its end: it resumes from its last journaled step.
            resumed = await client.call_tool("await", {"handles": [cut], "timeout": 60})
            assert not resumed.is_error, resumed.content
            (view,) = resumed.structured_content["runs"]
            assert view["status"] == "finished" and view["toolCalls"] == 3, view
    finally:
        runtime.stop()
        tools.stop()
        engine.stop()
