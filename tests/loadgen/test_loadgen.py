"""`luftpause loadgen` against a real stack: closed-loop runs through the proxy or sub-agents over
MCP, a progress line, a summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from support import Ports, start_up, stop_up, write_config


def test_loadgen_runs_closed_loop_agents_through_the_proxy_and_sums_them_up(tmp_path: Path) -> None:
    ports = Ports()
    proc = start_up(write_config(tmp_path, ports), tmp_path / "up.log")
    try:
        done = subprocess.run(
            [
                sys.executable, "-m", "luftpause", "loadgen",
                "--url", f"http://127.0.0.1:{ports.dataplane}",
                "--agents", "3", "--duration-s", "8", "--class", "batch", "--caller", "tester",
                "--context-chars", "800", "--tool-latency-s", "0.2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        stop_up(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["agents"], summary["class"], summary["caller"]) == (3, "batch", "tester")
    assert summary["errors"] == 0
    assert summary["runs"] >= 3 and summary["runs_per_min"] == round(summary["runs"] / (8 / 60), 2)
    # Every run makes 1 to 3 tool calls, each followed by a turn, then answers.
    assert summary["runs"] <= summary["tool_calls"] <= 3 * summary["turns"]
    assert summary["run_time_p50_s"] <= summary["run_time_p90_s"]
    assert set(summary["turns_by_replica"]) <= {"fake-a", "fake-b"}
    assert sum(summary["turns_by_replica"].values()) == summary["turns"]
    assert "runs " in done.stderr and "tool calls" in done.stderr  # the progress line


def _loadgen(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "luftpause", "loadgen", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_loadgen_spawns_sub_agents_over_mcp_and_awaits_them_all(tmp_path: Path) -> None:
    ports = Ports()
    proc = start_up(write_config(tmp_path, ports), tmp_path / "up.log")
    runtime = f"http://127.0.0.1:{ports.runtime}/mcp"
    try:
        fan = _loadgen("--runtime", runtime, "--spawn", "4", "--context-chars", "600")
        flood = _loadgen(
            "--runtime", runtime, "--spawn-agents", "2", "--duration-s", "12", "--class", "batch",
            "--context-chars", "600",
        )  # fmt: skip
        # What the runtime itself says it ran, as a user would check: every run it knows of.
        status = httpx.get(f"http://127.0.0.1:{ports.runtime}/status", timeout=5).json()
    finally:
        stop_up(proc)
    assert fan.returncode == 0, fan.stderr[-3000:]
    summary = json.loads(fan.stdout.strip().splitlines()[-1])
    assert (summary["spawned"], summary["finished"], summary["failed"]) == (4, 4, 0)
    # Each sub-agent makes 1 to 3 tool calls against fake-mcp, a turn after each, then answers.
    assert 4 <= summary["tool_calls"] <= 12 and summary["turns"] == summary["tool_calls"] + 4
    assert summary["failed_tool_calls"] == 0
    assert "finished 4 of 4" in fan.stderr  # the progress line

    assert flood.returncode == 0, flood.stderr[-3000:]
    summary = json.loads(flood.stdout.strip().splitlines()[-1])
    assert (summary["agents"], summary["class"], summary["errors"]) == (2, "batch", 0)
    assert summary["runs"] >= 2 and summary["runs_per_min"] == round(summary["runs"] / (12 / 60), 2)
    assert (
        summary["runs"] <= summary["tool_calls"]
        and summary["turns"] == summary["tool_calls"] + summary["runs"]
    )
    assert "runs in flight" in flood.stderr
    classes = [r["serviceClass"] for r in status["runs"]]
    assert classes.count("interactive") == 4 and classes.count("batch") >= summary["runs"]
