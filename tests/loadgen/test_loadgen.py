"""`luftpause loadgen` against a real stack: closed-loop runs through the proxy, a progress line, a summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import Ports, start_up, stop_up, write_config


def test_loadgen_runs_closed_loop_agents_through_the_proxy_and_sums_them_up(tmp_path: Path) -> None:
    ports = Ports()
    proc = start_up(write_config(tmp_path, ports), tmp_path / "up.log")
    try:
        done = subprocess.run(
            [
                sys.executable, "-m", "luftpause", "loadgen",
                "--url", f"http://127.0.0.1:{ports.dataplane}",
                "--agents", "3", "--duration-s", "20", "--class", "batch", "--caller", "tester",
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
    assert summary["runs"] >= 3 and summary["runs_per_min"] == round(summary["runs"] / (20 / 60), 2)
    # Every run makes 1 to 3 tool calls, each followed by a turn, then answers.
    assert summary["runs"] <= summary["tool_calls"] <= 3 * summary["turns"]
    assert summary["run_time_p50_s"] <= summary["run_time_p90_s"]
    assert set(summary["turns_by_replica"]) <= {"fake-a", "fake-b"}
    assert sum(summary["turns_by_replica"].values()) == summary["turns"]
    assert "runs " in done.stderr and "tool calls" in done.stderr  # the progress line
