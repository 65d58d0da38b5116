"""Ctrl-C on `luftpause up` stops every service it started."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from support import Ports, tcp_open, wait_until, write_config


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    ports = Ports()
    conf = write_config(tmp_path, ports)
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "up", "--config", str(conf), "--with-fakes"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: "luftpause is up" in log.read_text() or proc.poll() is not None, 60, what="the banner"
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        listening = [ports.grpc, ports.status, ports.dataplane, ports.runtime, ports.fake_mcp, *ports.engines]
        assert all(tcp_open(p) for p in listening)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
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
