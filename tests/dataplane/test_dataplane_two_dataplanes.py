"""Two dataplanes on one scheduler, each under a name of its own: one's restart leaves the other's runs.

Real processes on loopback: a fake engine, the scheduler, and two single-worker dataplanes on
two ports with nothing set but their ports. Each gives itself a name of its own
(`scheduler_client.dataplane_name`), so the restarted one's resync, which knows none of the runs
its last life carried, replaces only what came through it: the other's runs stay at the
scheduler, as its /status says before and after. (Both once called themselves "", and the
restart of one wiped the other's runs from the scheduler.)
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support import Ports, Service, free_port, running, wait_until, write_config

from luftpause import config as lp_config
from luftpause.dataplane.scheduler_client import dataplane_name

MODEL = "fake-llama"
RUNS_A, RUNS_B = 12, 5


@dataclass
class TwoDataplanes:
    ports: Ports
    a: Service
    b: Service
    b_port: int
    names: tuple[str, str]

    def status(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.ports.status}/status", timeout=5).json()

    def seen(self) -> dict[str, tuple[int, int]]:
        """Each dataplane the scheduler knows, by name: (its resyncs, its Turns streams open)."""
        return {d["name"]: (d["resyncs"], d["streams"]) for d in self.status()["dataplanes"]}

    def run_known(self, run_id: str) -> bool:
        reply = httpx.get(f"http://127.0.0.1:{self.ports.status}/status/runs/{run_id}", timeout=5)
        return reply.status_code == 200


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[TwoDataplanes]:
    ports = Ports()
    ports.engines = ports.engines[:1]
    path_a = write_config(tmp_path, ports)
    (tmp_path / "b").mkdir()
    b_port = free_port()
    path_b = write_config(
        tmp_path / "b", Ports(grpc=ports.grpc, status=ports.status, dataplane=b_port, engines=ports.engines)
    )
    engine = Service(
        "engine",
        ["fake-engine", "--name", "fake-a", "--port", str(ports.engines[0]), "--time-scale", "0.1"],
        tmp_path / "engine.log",
    )
    scheduler = Service("scheduler", ["scheduler", "--config", str(path_a)], tmp_path / "scheduler.log")
    a = Service("dataplane-a", ["dataplane", "--config", str(path_a)], tmp_path / "dataplane-a.log")
    b = Service("dataplane-b", ["dataplane", "--config", str(path_b)], tmp_path / "dataplane-b.log")
    names = (
        dataplane_name(lp_config.load(path_a).dataplane),
        dataplane_name(lp_config.load(path_b).dataplane),
    )
    with running(engine.start(), scheduler.start(), a.start(), b.start()):
        engine.wait_tcp(ports.engines[0])
        scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
        a.wait_http(f"http://127.0.0.1:{ports.dataplane}/health")
        b.wait_http(f"http://127.0.0.1:{b_port}/health")
        s = TwoDataplanes(ports, a, b, b_port, names)
        wait_until(
            lambda: s.seen() == {n: (1, 1) for n in names}, what="both dataplanes resynced, each by name"
        )
        yield s


def _turns(port: int, prefix: str, runs: int) -> list[str]:
    """One turn for each of `runs` runs through the dataplane on `port`; the run ids."""
    ids = [f"{prefix}-{i}" for i in range(runs)]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for run_id in ids:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "a fact"}], "max_tokens": 4}
            reply = client.post("/v1/chat/completions", json=body, headers={"x-luftpause-run-id": run_id})
            assert reply.status_code == 200, reply.text
    return ids


def test_restarting_one_dataplane_leaves_the_others_runs_at_the_scheduler(stack: TwoDataplanes):
    a_name, b_name = stack.names
    assert a_name != b_name
    runs_a = _turns(stack.ports.dataplane, "via-a", RUNS_A)
    runs_b = _turns(stack.b_port, "via-b", RUNS_B)
    wait_until(
        lambda: stack.status()["runs"]["count"] == RUNS_A + RUNS_B,
        timeout_s=10,
        what="every run at the scheduler",
    )
    before = stack.status()["runs"]["count"]

    stack.b.kill(signal.SIGKILL)
    stack.b.start()
    wait_until(
        lambda: stack.seen().get(b_name) == (2, 1), timeout_s=20, what="the restarted dataplane's resync"
    )

    after = stack.status()
    # Its last life's runs were its own to replace (its new book knows none of them); the other's stay.
    assert (before, after["runs"]["count"]) == (RUNS_A + RUNS_B, RUNS_A)
    assert all(stack.run_known(r) for r in runs_a), "the other dataplane's runs are held at the scheduler"
    assert not any(stack.run_known(r) for r in runs_b)
    assert stack.seen() == {a_name: (1, 1), b_name: (2, 1)}, "the other dataplane neither resynced nor left"
