"""Ctrl-C on `luftpause up` stops every service it started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import Ports, start_up, stop_up, tcp_open, wait_until, write_config


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    proc = start_up(conf, log)
    try:
        listening = [ports.grpc, ports.status, ports.dataplane, ports.runtime, ports.fake_mcp, *ports.engines]
        assert all(tcp_open(p) for p in listening)
        assert stop_up(proc) == 0
        assert "stopped all services" in log.read_text()
        wait_until(lambda: not any(tcp_open(p) for p in listening), 10, what="every port to close")
    finally:
        if proc.poll() is None:
            proc.kill()


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
