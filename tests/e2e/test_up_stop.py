"""`luftpause up` as an operator runs it: Ctrl-C, a closed terminal or `kill -9` stop every
service it started; a second `up` on the same ports is refused before it starts anything; with
`LUFTPAUSE_TOKEN` set it comes up all the same."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import (
    Ports,
    Service,
    free_port,
    group_alive,
    running,
    start_up,
    started_children,
    stop_up,
    tcp_open,
    up_command,
    wait_until,
    write_config,
)


def listening_ports(ports: Ports) -> list[int]:
    return [ports.grpc, ports.status, ports.dataplane, ports.runtime, ports.fake_mcp, *ports.engines]


def kill_groups(pids: dict[str, int]) -> None:
    """Test clean-up: whatever is left of the children's process groups."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    proc = start_up(conf, log)
    try:
        listening = listening_ports(ports)
        assert all(tcp_open(p) for p in listening)
        assert stop_up(proc) == 0
        assert "stopped all services" in log.read_text()
        wait_until(lambda: not any(tcp_open(p) for p in listening), 10, what="every port to close")
    finally:
        if proc.poll() is None:
            proc.kill()
    # The log: every service's lines behind its name, and no line per health probe or request.
    out = log.read_text()
    names = ("fake-a", "fake-b", "fake-mcp", "scheduler", "dataplane", "runtime")
    uvicorn_lines = [line for line in out.splitlines() if "uvicorn.error" in line]
    assert uvicorn_lines and all(re.match(rf"({'|'.join(names)}) +\| ", line) for line in uvicorn_lines)
    assert "HTTP Request:" not in out and 'HTTP/1.1" 200' not in out


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_request_lines_are_logged_only_at_debug(tmp_path: Path, level: str) -> None:
    port = free_port()
    engine = Service(
        "fake-engine", ["--log-level", level, "fake-engine", "--port", str(port)], tmp_path / "engine.log"
    )
    with running(engine.start()):
        engine.wait_http(f"http://127.0.0.1:{port}/health")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200
        access = '"GET /v1/models HTTP/1.1" 200'
        if level == "DEBUG":
            wait_until(lambda: access in engine.output(), 10, what="the access line")
        else:
            # uvicorn writes an access line before the reply's first byte: it would be there by now.
            assert "Uvicorn running" in engine.output() and access not in engine.output()


def test_a_second_up_is_refused_naming_the_busy_port_and_leaves_the_first_alone(tmp_path: Path) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    first = start_up(conf, log)
    children = started_children(log)
    try:
        second = subprocess.run(up_command(conf), capture_output=True, text=True, timeout=5)
        assert second.returncode == 1
        refusal = second.stderr
        assert "nothing was started" in refusal
        # Each busy port is named with the process that holds it: the first stack's children.
        assert (
            f"port {ports.engines[0]} (fake-a, 127.0.0.1) is already in use by pid {children['fake-a']}"
            in refusal
        )
        assert (
            f"port {ports.runtime} (runtime, 127.0.0.1) is already in use by pid {children['runtime']}"
            in refusal
        )
        assert f"port {ports.grpc} (scheduler" in refusal
        assert "started" not in second.stdout

        # The first stack is untouched: the same children, none restarted, all answering.
        assert first.poll() is None
        assert started_children(log) == children
        assert "exited" not in log.read_text()
        assert httpx.get(f"http://127.0.0.1:{ports.runtime}/status", timeout=5).status_code == 200
    finally:
        assert stop_up(first) == 0


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_a_closed_terminal_or_kill_9_of_up_leaves_no_child_running(tmp_path: Path, sig: int) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    proc = start_up(conf, log)
    children = started_children(log)
    assert set(children) == {"fake-a", "fake-b", "fake-mcp", "scheduler", "dataplane", "runtime"}
    try:
        proc.send_signal(sig)
        proc.wait(timeout=15)
        wait_until(
            lambda: not any(group_alive(pid) for pid in children.values()),
            15,
            what="every child's process group to end",
        )
        wait_until(
            lambda: not any(tcp_open(p) for p in listening_ports(ports)), 10, what="every port to close"
        )
        if sig == signal.SIGHUP:
            assert proc.returncode == 0 and "stopped all services" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_groups(children)


def test_with_a_token_up_comes_up_healthy(tmp_path: Path) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    proc = start_up(conf, log, env={"LUFTPAUSE_TOKEN": "s3cret"})
    try:
        out = log.read_text()
        for child in ("scheduler", "dataplane", "runtime"):
            assert f"{child:<10} healthy" in out, out[-3000:]
        status = f"http://127.0.0.1:{ports.runtime}/status"
        assert httpx.get(status, timeout=5).status_code == 401
        assert httpx.get(status, headers={"authorization": "Bearer s3cret"}, timeout=5).status_code == 200
    finally:
        assert stop_up(proc) == 0


def test_a_child_that_keeps_dying_stops_up_with_its_last_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import luftpause.up as up_module

    # Backoff pauses of a hundredth of a second, so that the limit is reached quickly.
    monkeypatch.setattr(up_module, "RESTART_BACKOFF_S", (0.01,))
    bad = tmp_path / "bad.toml"
    bad.write_text("[dataplane]\nport = 'eighty'\n")
    out = tmp_path / "up.log"
    child = up_module.Child("dataplane", ["dataplane", "--config", str(bad)], "http://127.0.0.1:1/health")
    with out.open("w") as stream:
        sup = up_module.Supervisor([child], out=stream)
        started = time.monotonic()
        sup._start(child)
        try:
            sup.watch()
        finally:
            sup.stop_all()
    text = out.read_text()
    assert sup.gave_up.is_set() and time.monotonic() - started < 30
    assert f"restart #{up_module.MAX_RESTARTS}" in text
    # Why it dies: its own output, relayed behind its name, and repeated when up gives up.
    assert f"dataplane | luftpause: {bad}: invalid configuration" in text
    assert re.search(
        rf"{up_module.MAX_RESTARTS + 1}th death in a row .* giving up\. Its last output:\n\s+luftpause: {re.escape(str(bad))}: invalid"
        r" configuration:\n\s+dataplane\.port:",
        text,
    ), text[-2000:]


def test_bad_config_exits_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[dataplane]\nport = 'eighty'\n")
    done = subprocess.run(
        [sys.executable, "-m", "luftpause", "up", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert str(bad) in done.stderr and "dataplane.port" in done.stderr
