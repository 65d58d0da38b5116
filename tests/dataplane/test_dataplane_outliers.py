"""A broken replica beside a good one: its turns fail with a clear error, it is ejected, it comes back.

Real processes on loopback: the scheduler, the dataplane, a fake engine ("good") and a scripted
engine ("bad", first in the config) that answers every chat request with the script `--always` names: "headers" closes
each stream after its headers, "garbage" streams bytes that are not server-sent events. Before
issue 29 both stayed in rotation, the garbage relayed as a 200 and counted completed.

What the client sees of a turn on the bad replica is a 502 naming it, never a 200; after five
of them in a row the scheduler ejects it (scheduler/outliers.py), /status and /metrics say so,
and every later turn is served by the good one. Told to behave again (`POST /_always`), the bad
replica comes back once its ejection is over and its probe passes, and serves turns again.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from real_stack import SCRIPTED_ENGINE, ScriptProcess, replica
from support import Ports, Service, amend_config, free_port, running, scrape, wait_until, write_config

MODEL = "shared-llama"


@dataclass
class Pair:
    dataplane: str
    status_url: str
    bad_url: str
    scheduler: Service

    def turn(self, client: httpx.Client) -> httpx.Response:
        return client.post(
            f"{self.dataplane}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 4,
            },
            headers={"x-luftpause-run-id": f"outlier-{uuid.uuid4().hex[:12]}"},
        )

    def bad(self) -> dict:
        doc = httpx.get(self.status_url, timeout=5).json()
        return next(r for r in doc["replicas"] if r["name"] == "bad")


@contextlib.contextmanager
def _pair(tmp: Path, script: str, ejection_base_s: float) -> Iterator[Pair]:
    ports = Ports(engines=[])
    good_port, bad_port = free_port(), free_port()
    replicas = replica("bad", bad_port, MODEL, f"ejection_base_s = {ejection_base_s}\n") + replica(
        "good", good_port, MODEL
    )
    path = write_config(tmp, ports, extra=replicas)
    amend_config(path, "[scheduler]\nprobe_period_s = 0.2")
    bad = ScriptProcess(
        "bad", [str(SCRIPTED_ENGINE), "--port", str(bad_port), "--always", script], tmp / "bad.log"
    )
    good = Service(
        "good",
        ["fake-engine", "--name", "good", "--model", MODEL, "--port", str(good_port), "--time-scale", "0.02"],
        tmp / "good.log",
    )
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp / "dataplane.log")
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"
    status_url = f"http://127.0.0.1:{ports.status}/status"
    with running(bad, good, scheduler, dataplane):
        bad.start()
        good.start()
        bad.wait_http(f"http://127.0.0.1:{bad_port}/health")
        good.wait_http(f"http://127.0.0.1:{good_port}/health")
        scheduler.start()
        dataplane.start()
        scheduler.wait_http(status_url)
        dataplane.wait_http(f"{dataplane_url}/health")
        wait_until(
            lambda: httpx.get(f"{dataplane_url}/health").json()["scheduler"] == "connected",
            what="the dataplane to connect to the scheduler",
        )
        yield Pair(dataplane_url, status_url, f"http://127.0.0.1:{bad_port}", scheduler)


def _served_whole(r: httpx.Response) -> bool:
    """A 200 stream from the good replica, ending in [DONE], each event JSON."""
    if r.status_code != 200 or r.headers.get("x-luftpause-replica") != "good":
        return False
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return bool(events) and events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])


@pytest.mark.parametrize("script", ["headers", "garbage"])
def test_a_broken_replica_fails_its_turns_clearly_and_is_ejected(tmp_path: Path, script: str):
    with _pair(tmp_path, script, ejection_base_s=120) as pair, httpx.Client(timeout=30) as client:
        failures = 0
        # Turns one at a time, until the bad replica is ejected (the first of them all go to it).
        for _ in range(40):
            r = pair.turn(client)
            if r.status_code == 200:
                assert _served_whole(r), f"a 200 not served whole by the good replica: {r.text[:300]!r}"
            else:
                assert r.status_code == 502, r.text
                assert r.headers["x-luftpause-replica"] == "bad"
                assert r.json()["error"]["message"].startswith("engine bad: ")
                failures += 1
            if pair.bad()["ejection"]["ejected_for_s"] is not None:
                break
        assert failures == 5, "the bad replica should be ejected after five failures in a row"
        bad = pair.bad()
        assert not bad["in_service"] and bad["healthy"], bad
        assert bad["ejection"]["ejections"] == 1 and 100 < bad["ejection"]["ejected_for_s"] <= 120
        samples = scrape(pair.status_url.removesuffix("/status"))
        assert samples["luftpause_scheduler_replica_ejected", frozenset({("replica", "bad")})] == 1.0
        assert samples["luftpause_scheduler_replica_ejections_total", frozenset({("replica", "bad")})] == 1.0
        served = sum(_served_whole(pair.turn(client)) for _ in range(40))
        assert served >= 0.95 * 40, f"{served}/40 turns served after the ejection"
        assert "replica bad ejected" in pair.scheduler.output()


def test_an_ejected_replica_comes_back_after_its_interval_when_it_is_good_again(tmp_path: Path):
    with _pair(tmp_path, "headers", ejection_base_s=1.0) as pair, httpx.Client(timeout=30) as client:
        for _ in range(40):
            pair.turn(client)
            if pair.bad()["ejection"]["ejected_for_s"] is not None:
                break
        assert pair.bad()["ejection"]["ejections"] == 1
        # Good again: it answers its chat requests as each one's body says (a reply).
        httpx.post(f"{pair.bad_url}/_always", content=b"", timeout=5).raise_for_status()
        wait_until(lambda: pair.bad()["in_service"], timeout_s=10, what="the bad replica back in service")
        # In rotation again beside the good one: within a few turns one goes there, and is served.
        for _ in range(10):
            r = pair.turn(client)
            assert r.status_code == 200, r.text
            if r.headers["x-luftpause-replica"] == "bad":
                break
        assert r.headers["x-luftpause-replica"] == "bad"
        assert r.text.rstrip().endswith("data: [DONE]")
        bad = pair.bad()
        assert bad["ejection"]["ejections"] == 1 and bad["ejection"]["failures_in_a_row"] == 0
