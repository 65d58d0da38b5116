"""`free_port`: a port nothing listens on, never the same one twice in a process, even when the
kernel hands a port just closed out again (which gave two services of one test stack one port),
nor one another process (a second test worker, a benchmark) was handed in the last
`PORT_CLAIM_S`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from luftpause.bench import common


class _Kernel:
    """Stands in for `socket.socket`: each bind to port 0 gets the next of `ports`."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self) -> _Kernel:
        return self

    def __enter__(self) -> _Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_gives_again_is_not_handed_out_twice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(common, "PORT_CLAIMS", tmp_path)
    monkeypatch.setattr(common, "_handed_out", set())
    monkeypatch.setattr(common, "socket", SimpleNamespace(socket=_Kernel([41000, 41000, 41000, 41001])))
    assert [common.free_port(), common.free_port()] == [41000, 41001]


def test_free_ports_are_distinct_and_nothing_listens_on_them() -> None:
    ports = [common.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_port_another_process_was_handed_is_not_handed_out_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "from luftpause.bench.common import free_port; print(free_port())"],
        env={**os.environ, "LUFTPAUSE_PORT_CLAIMS": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    theirs = int(child.stdout)
    # The kernel gives this process the port the other was handed (nothing listens on it yet).
    monkeypatch.setattr(common, "PORT_CLAIMS", tmp_path)
    monkeypatch.setattr(common, "_handed_out", set())
    monkeypatch.setattr(common, "socket", SimpleNamespace(socket=_Kernel([theirs, theirs, 41003])))
    assert common.free_port() == 41003


def test_a_claim_older_than_the_claim_time_no_longer_holds_its_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "41004").write_text("1\n")
    long_ago = time.time() - common.PORT_CLAIM_S - 1
    os.utime(tmp_path / "41004", (long_ago, long_ago))
    monkeypatch.setattr(common, "PORT_CLAIMS", tmp_path)
    monkeypatch.setattr(common, "_handed_out", set())
    monkeypatch.setattr(common, "socket", SimpleNamespace(socket=_Kernel([41004])))
    assert common.free_port() == 41004
