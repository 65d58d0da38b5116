"""A scheduler restart, end to end: the dataplane's resync keeps runs on their replicas.

Real processes on loopback: two fake engines, the scheduler and the dataplane. Runs pause on a
tool call; the scheduler is killed and a turn arrives while it is down; the scheduler comes
back empty. The dataplane must hold that turn, resync its view of the runs (so each paused run
is pinned to its replica again), then admit the held turn, which lands where its run was.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
from support import Ports, Service, running, wait_until, write_config

MODEL = "fake-llama"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


def _turn(dataplane: str, run_id: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(
        f"{dataplane}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": [LOOKUP]},
        headers={"x-luftpause-run-id": run_id},
        timeout=30,
    )


def _with_tool_results(messages: list[dict], reply: dict) -> list[dict]:
    message = reply["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": "found it"} for c in message["tool_calls"]
    ]
    return [*messages, message, *results]


def test_paused_runs_keep_their_replicas_through_a_scheduler_restart(tmp_path):
    ports = Ports()
    path = write_config(tmp_path, ports)
    engines = [
        Service(name, ["fake-engine", "--name", name, "--port", str(port)], tmp_path / f"{name}.log")
        for name, port in zip(("fake-a", "fake-b"), ports.engines, strict=True)
    ]
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp_path / "dataplane.log")
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"
    status = f"http://127.0.0.1:{ports.status}/status"

    with running(*engines, scheduler, dataplane):
        for e in engines:
            e.start()
        scheduler.start()
        dataplane.start()
        for e, port in zip(engines, ports.engines, strict=True):
            e.wait_http(f"http://127.0.0.1:{port}/health")
        scheduler.wait_http(status)
        dataplane.wait_http(f"{dataplane_url}/health")

        # Six runs, each paused on its first tool call.
        runs = {f"restart-{i}": [{"role": "user", "content": f"restart task {i}"}] for i in range(6)}
        with ThreadPoolExecutor(len(runs)) as pool:
            first = dict(zip(runs, pool.map(lambda r: _turn(dataplane_url, r, runs[r]), runs), strict=True))
        replica_of = {}
        for run_id, r in first.items():
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
            replica_of[run_id] = r.headers["x-luftpause-replica"]
            runs[run_id] = _with_tool_results(runs[run_id], r.json())

        scheduler.kill(signal.SIGKILL)
        with ThreadPoolExecutor(len(runs)) as pool:
            # Sent while the scheduler is down: held by the dataplane until it is back.
            pending = {r: pool.submit(_turn, dataplane_url, r, runs[r]) for r in runs}
            wait_until(
                lambda: httpx.get(f"{dataplane_url}/health").json()["scheduler"] == "reconnecting",
                timeout_s=10,
                what="the dataplane to notice the scheduler is gone",
            )
            assert not any(f.done() for f in pending.values()), "no turn may go out without the scheduler"
            scheduler.start()
            second = {r: f.result(timeout=30) for r, f in pending.items()}

        for run_id, r in second.items():
            assert r.status_code == 200, r.text
            assert r.headers["x-luftpause-run-id"] == run_id
            assert r.headers["x-luftpause-replica"] == replica_of[run_id], f"{run_id} moved"
            assert r.json()["system_fingerprint"] == replica_of[run_id]

        def settled() -> bool:
            doc = httpx.get(status).json()
            return sum(r["in_flight"] for r in doc["replicas"]) == 0 and doc["held"]["count"] == 0

        wait_until(settled, timeout_s=10, what="nothing in flight after the restart")
