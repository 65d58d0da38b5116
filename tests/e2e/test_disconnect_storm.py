"""A disconnect storm: 200 clients that leave at random points of their turns, for a while.

`luftpause up --with-fakes` (the real scheduler, dataplane and two fake engines). 200 clients
send streamed turns one after another for `LUFTPAUSE_STORM_S` seconds (10 by default; the
issue's storm is 60), so that most turns are held by the scheduler behind the engines'
lookahead, and leave each turn after a random time: at once, while held, just as it is placed,
before the first token, in the middle of the stream, or not at all. What a user must see: once
the last client is gone, the scheduler counts nothing in flight and nothing held within a
second (no slot leaked until the 600 s turn timeout), and a turn sent afterwards is served.
The exact race of a client leaving as its turn is placed is driven deterministically in
tests/dataplane/test_dataplane_admission_race.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
from support import Ports, start_up, stop_up, wait_until, write_config

CLIENTS = 200
SPREAD_S = 4.0
STORM_S = float(os.environ.get("LUFTPAUSE_STORM_S", "10"))


async def _turn(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> str:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        async for _ in r.aiter_raw():
            pass
    return "finished"


async def _client(
    url: str, index: int, rng: random.Random, client: httpx.AsyncClient, until: float
) -> list[str]:
    await asyncio.sleep(rng.uniform(0, SPREAD_S))  # arrivals spread over the first seconds
    outcomes = []
    turn_number = 0
    while time.monotonic() < until:
        turn_number += 1
        leave_after = rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 3.0), rng.uniform(0, 8.0), None])
        body = {
            "model": "fake-llama",
            "messages": [
                {
                    "role": "user",
                    "content": f"storm {index}.{turn_number}: " + "words " * rng.randint(10, 400),
                }
            ],
            "stream": True,
            "max_tokens": 64,
        }
        headers = {
            "x-luftpause-run-id": f"storm-{index}",
            "x-luftpause-class": rng.choice(["interactive", "batch"]),
        }

        try:
            work = _turn(client, url, body, headers)
            outcomes.append(
                await asyncio.wait_for(work, leave_after) if leave_after is not None else await work
            )
        except TimeoutError:
            outcomes.append("left")
    return outcomes


async def _storm(url: str) -> tuple[list[str], float]:
    rng = random.Random(11)
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        until = time.monotonic() + STORM_S
        per_client = await asyncio.gather(*(_client(url, i, rng, client, until) for i in range(CLIENTS)))
    return [o for outcomes in per_client for o in outcomes], time.monotonic()


def test_after_200_clients_leave_at_random_nothing_is_in_flight_within_a_second(tmp_path):
    ports = Ports()
    log = tmp_path / "up.log"
    up = start_up(write_config(tmp_path, ports), log)
    dataplane = f"http://127.0.0.1:{ports.dataplane}"
    status = f"http://127.0.0.1:{ports.status}/status"

    def counts() -> tuple[int, int]:
        doc = httpx.get(status, timeout=5).json()
        return sum(r["in_flight"] for r in doc["replicas"]), doc["held"]["count"]

    try:
        outcomes, last_left = asyncio.run(_storm(dataplane))
        assert outcomes.count("left") > CLIENTS // 2 and outcomes.count("finished") > 0
        print(
            f"{len(outcomes)} turns: {outcomes.count('left')} left early, {outcomes.count('finished')} finished"
        )
        wait_until(
            lambda: counts() == (0, 0), timeout_s=1.0, interval_s=0.02, what="nothing in flight or held"
        )
        settled_after = time.monotonic() - last_left
        r = httpx.post(
            f"{dataplane}/v1/chat/completions",
            json={"model": "fake-llama", "messages": [{"role": "user", "content": "after the storm"}]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        assert stop_up(up) == 0
    assert settled_after < 1.0
