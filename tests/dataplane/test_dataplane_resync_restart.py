"""A scheduler killed behind a dataplane whose view is over gRPC's 4 MiB limit comes back to work.

Real processes on loopback: two fake engines, the scheduler and the dataplane, with a bearer
token set as a deployment would. The dataplane's run book is filled past 4 MiB with turns each
of a run of its own (a 256-byte `x-luftpause-run-id`, the most the header takes, and a 128-byte
caller), then the scheduler is killed (`kill -9`) and started again on the same ports. Its
resync must go through: a new turn is answered within 15 s and the scheduler's status says it
knows every run again. Before the resync was split over messages of 1 MiB, the one message was
refused (RESOURCE_EXHAUSTED) at every reconnect and the dataplane held every turn for good.

The replicas have names of 1 KiB: each run's state in the resync carries its replica's name, so
a few thousand turns pass 4 MiB on a small machine (with short names a busy proxy gets there
with some 10^4 runs inside its 30-minute idle window).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time

import httpx
from support import Ports, Service, free_port, running, wait_until, write_config

from luftpause.proto import pb

MODEL = "fake-llama"
TOKEN = "resync-restart-token-0123456789"
GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024
REPLICA_NAMES = [f"{letter}-{'n' * 1022}" for letter in "ab"]
CALLER = "c" * 128
CONNECTIONS = 24
NEW_TURN_BOUND_S = 15.0


def _run_id(i: int) -> str:
    return f"resync-{i:06d}-".ljust(256, "r")


def _runs_needed() -> int:
    """How many runs make the dataplane's view 10 % larger than gRPC's default limit."""
    state = pb.RunState(
        run_id=_run_id(0),
        replica=REPLICA_NAMES[0],
        phase=pb.IDLE,
        service_class=pb.INTERACTIVE,
        caller=CALLER,
        idle_s=1.5,
    )
    # Each run in the repeated field: its bytes, a tag and a two-byte length.
    return math.ceil(1.1 * GRPC_DEFAULT_LIMIT / (state.ByteSize() + 3))


def _request(port: int, run_id: str) -> bytes:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"authorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\n"
        f"x-luftpause-run-id: {run_id}\r\nx-luftpause-caller: {CALLER}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Reads one HTTP/1.1 response off a kept-alive connection; returns its status code."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    if "content-length" in fields:
        await reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return int(lines[0].split()[1])


async def _fill(port: int, count: int) -> dict[int, int]:
    """`count` turns, each of a run of its own, over kept-alive connections; statuses counted.

    A lean client of its own rather than httpx: on two cores the client would otherwise use as
    much CPU as the dataplane it loads.
    """
    statuses: dict[int, int] = {}
    next_run = iter(range(count))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in next_run:
                writer.write(_request(port, _run_id(i)))
                status = await _read_response(reader)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    await asyncio.wait_for(asyncio.gather(*(connection() for _ in range(CONNECTIONS))), timeout=90)
    return statuses


def test_a_scheduler_restart_resyncs_a_view_over_grpcs_message_limit(tmp_path):
    runs = _runs_needed()
    ports = Ports(engines=[free_port(), free_port()])
    replicas = "".join(
        f'\n[[replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:{port}"\nmodels = ["{MODEL}"]\n'
        for name, port in zip(REPLICA_NAMES, ports.engines, strict=True)
    )
    path = write_config(tmp_path, Ports(**{**ports.__dict__, "engines": []}), extra=replicas)
    env = {"LUFTPAUSE_TOKEN": TOKEN}
    engines = [
        Service(
            f"engine-{i}",
            ["fake-engine", "--name", name, "--port", str(port), "--time-scale", "0.001"],
            tmp_path / f"engine-{i}.log",
        )
        for i, (name, port) in enumerate(zip(REPLICA_NAMES, ports.engines, strict=True))
    ]
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp_path / "dataplane.log")
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"
    status_url = f"http://127.0.0.1:{ports.status}/status"
    auth = {"authorization": f"Bearer {TOKEN}"}

    def status() -> dict:
        r = httpx.get(status_url, headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def scheduler_link() -> str:
        return httpx.get(f"{dataplane_url}/health", timeout=5).json()["scheduler"]

    with running(*engines, scheduler, dataplane):
        for e in engines:
            e.start()
        scheduler.start(env=env)
        dataplane.start(env=env)
        for e, port in zip(engines, ports.engines, strict=True):
            e.wait_http(f"http://127.0.0.1:{port}/health")
        scheduler.wait_http(status_url)
        dataplane.wait_http(f"{dataplane_url}/health")
        wait_until(lambda: scheduler_link() == "connected", what="the dataplane to connect")

        started = time.monotonic()
        statuses = asyncio.run(_fill(ports.dataplane, runs))
        assert statuses == {200: runs}, statuses
        filled_s = time.monotonic() - started
        before = status()
        assert before["runs"]["by_caller"][CALLER] == runs, before["runs"]
        last_run = _run_id(runs - 1)
        replica_of_last = httpx.get(f"{status_url}/runs/{last_run}", headers=auth, timeout=5).json()[
            "replica"
        ]

        scheduler.kill(signal.SIGKILL)
        wait_until(lambda: scheduler_link() == "reconnecting", timeout_s=10, what="the dataplane to notice")
        scheduler.start(env=env)
        scheduler.wait_http(status_url)

        asked = time.monotonic()
        try:
            r = httpx.post(
                f"{dataplane_url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "after the restart"}]},
                headers={**auth, "x-luftpause-run-id": "resync-after"},
                timeout=NEW_TURN_BOUND_S,
            )
        except httpx.TimeoutException:
            raise AssertionError(
                f"no answer within {NEW_TURN_BOUND_S:.0f} s of the scheduler's return "
                f"(the dataplane says {scheduler_link()!r}):\n{dataplane.output()[-2000:]}"
            ) from None
        assert r.status_code == 200, r.text
        answered_s = time.monotonic() - asked

        after = status()
        assert after["runs"]["by_caller"][CALLER] == runs, after["runs"]
        assert after["runs"]["count"] == runs + 1, after["runs"]
        again = httpx.get(f"{status_url}/runs/{last_run}", headers=auth, timeout=5).json()
        assert again["replica"] == replica_of_last
        print(
            f"{runs} runs filled in {filled_s:.1f} s; a new turn answered {answered_s:.1f} s after the restart"
        )
