"""The port drill's pieces (bench/faults_ports.py) on a small scale: a scheduler alone, its status
port bounded to a 1 s head and 20 connections, 10 trickling and 50 idle connections, the
prober timing `/status` meanwhile. What the record must say: every drill connection closed by
the server within the bound (the trickling ones with a 408, the idle ones past the limit with a
503 to make room, the rest with a 408), `/status` answered every time within a second, and the
markdown table showing it. And 50 idle connections on its gRPC port, bounded to 20: every one
closed by the server within the bound, `/status` answered meanwhile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import Ports, Service, running

from luftpause.bench import faults_ports

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 20


@pytest.fixture(scope="module")
def status_port(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("faults-ports")
    ports = Ports()
    config = tmp / "luftpause.toml"
    config.write_text(
        f"[scheduler]\ngrpc_port = {ports.grpc}\nstatus_port = {ports.status}\n"
        f"header_timeout_s = {HEADER_TIMEOUT_S}\nmax_connections = {MAX_CONNECTIONS}\n"
        f"grpc_max_connections = {MAX_CONNECTIONS}\n"
    )
    scheduler = Service("scheduler", ["scheduler", "--config", str(config)], Path(tmp) / "scheduler.log")
    with running(scheduler.start()):
        scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
        yield ports.status, scheduler.proc.pid, ports.grpc


def test_slowloris_and_idle_phases_are_closed_by_the_server_and_status_keeps_answering(status_port):
    port, pid, _ = status_port
    phases = [
        asyncio.run(faults_ports.drill_phase(port, "/status", kind, n, HEADER_TIMEOUT_S + 3, pid))
        for kind, n in (("slowloris", 10), ("idle", 50))
    ]
    slow, idle = phases
    for phase in phases:
        assert phase["opened"] == phase["connections"] and phase["left_open"] == 0
        assert phase["closed_after_s_max"] < HEADER_TIMEOUT_S + 1.5
        status = phase["status"]
        assert status["failed"] == {} and status["answered_200"] >= 5
        assert status["max_ms"] < 1000 and status["over_1s"] == 0
    assert slow["answers"] == {"408": 10}
    # Past the limit each new connection closed the one waiting longest; those left got a 408.
    assert idle["answers"].get("503", 0) >= 50 - MAX_CONNECTIONS
    assert set(idle["answers"]) <= {"503", "408"}

    record = {"phases": [{"service": "scheduler", "route": "/status", **p} for p in phases],
              "status_answered_within_1s_throughout": True}  # fmt: skip
    text = faults_ports.table(record)
    assert "| scheduler `/status` | slowloris | 10 | 10 (408: 10) |" in text
    assert "answered 200 within 1 s throughout: yes" in text


def test_idle_connections_on_the_grpc_port_are_closed_while_status_keeps_answering(status_port):
    port, pid, grpc_port = status_port
    phase = asyncio.run(
        faults_ports.drill_phase(grpc_port, "/status", "idle", 50, HEADER_TIMEOUT_S + 3, pid, probed=port)
    )
    assert phase["opened"] == 50 and phase["left_open"] == 0
    assert phase["closed_after_s_max"] < HEADER_TIMEOUT_S + 1.5
    status = phase["status"]
    assert status["failed"] == {} and status["answered_200"] >= 5 and status["over_1s"] == 0
