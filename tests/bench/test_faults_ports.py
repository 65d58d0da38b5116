"""The port drill's pieces (bench/faults_ports.py) on a small scale: a scheduler alone, its status
port bounded to a 1 s head and 20 connections, 10 trickling and 50 idle connections, the
prober timing `/status` meanwhile. What the record must say: every drill connection closed by
the server while watched (the trickling ones with a 408, the idle ones past the limit with a
503 to make room, the rest with a 408), `/status` answered every time (within 2.5 s here, a
loaded test machine's slack; the drill itself reports those over 1 s), and the markdown table
showing it. And 50 idle connections on its gRPC port, bounded to 20: every one closed by the
server within the bound, `/status` answered meanwhile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import Ports, Service, running

from luftpause.bench import faults_ports, stack_config

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 20
# Each phase is watched this long; a connection still open after it is counted left open.
WATCH_S = HEADER_TIMEOUT_S + 3
# The longest `/status` may take during a phase on a loaded machine. Without its room made, a
# new connection would wait for a slot; that room was made, the idle phase's 503s show.
STATUS_BOUND_MS = 2500


@pytest.fixture(scope="module")
def status_port(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("faults-ports")
    ports = Ports()
    bounds = {
        "scheduler": {
            "header_timeout_s": HEADER_TIMEOUT_S,
            "max_connections": MAX_CONNECTIONS,
            "grpc_max_connections": MAX_CONNECTIONS,
        }
    }
    config = stack_config.write(
        tmp, stack_config.merged(stack_config.stack(grpc=ports.grpc, status=ports.status), bounds)
    )
    scheduler = Service("scheduler", ["scheduler", "--config", str(config)], Path(tmp) / "scheduler.log")
    with running(scheduler.start()):
        scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
        yield ports.status, scheduler.proc.pid, ports.grpc


def test_slowloris_and_idle_phases_are_closed_by_the_server_and_status_keeps_answering(status_port):
    port, pid, _ = status_port
    phases = [
        asyncio.run(faults_ports.drill_phase(port, "/status", kind, n, WATCH_S, pid))
        for kind, n in (("slowloris", 10), ("idle", 50))
    ]
    slow, idle = phases
    for phase in phases:
        assert phase["opened"] == phase["connections"] and phase["left_open"] == 0
        # Closed by the bound (the 408s below say which), before the watch ended.
        assert phase["closed_after_s_max"] < WATCH_S
        status = phase["status"]
        assert status["failed"] == {} and status["answered_200"] >= 5
        assert status["max_ms"] < STATUS_BOUND_MS
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
    phase = asyncio.run(faults_ports.drill_phase(grpc_port, "/status", "idle", 50, WATCH_S, pid, probed=port))
    # Closed by the server while watched (without the bound they stay open), /status answering.
    assert phase["opened"] == 50 and phase["left_open"] == 0
    assert phase["closed_after_s_max"] < WATCH_S
    status = phase["status"]
    assert status["failed"] == {} and status["answered_200"] >= 5
    assert status["max_ms"] < STATUS_BOUND_MS
