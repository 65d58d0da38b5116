"""The scheduler's gRPC port with `LUFTPAUSE_TOKEN` set takes only calls that carry the token.

Without it anyone who could reach the port could hold every slot with rogue admissions, wipe the
in-flight counts with an empty Resync, or inject ghost turns. Real processes on loopback: two
fake engines, the scheduler and the dataplane, all with the token; a rogue gRPC client without
it (and one with a wrong one) is refused UNAUTHENTICATED and changes nothing, while the
dataplane, which has the token, resyncs and serves turns as always.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import httpx
from support import Ports, Service, running, wait_until, write_config

from luftpause.proto import pb, rpc

TOKEN = "s3cret-for-the-scheduler"
MODEL = "fake-llama"


def _status(ports: Ports) -> dict:
    # The status documents want the token too when the scheduler has one.
    r = httpx.get(
        f"http://127.0.0.1:{ports.status}/status", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    r.raise_for_status()
    return r.json()


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    async for _ in call:
        pass


async def _refused(target: str, metadata: tuple[tuple[str, str], ...] | None) -> tuple[list[str], list[str]]:
    """Tries each call a rogue client would; returns the status code names it got, and what
    each error said."""
    codes: list[str] = []
    details: list[str] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rpc.SchedulerStub(channel)

        def turns(item: pb.DataplaneItem):  # noqa: ANN202
            return _drain(stub.Turns(iter([pb.DataplaneBatch(items=[item])]), metadata=metadata))

        ghost = pb.InFlightTurn(turn_id="ghost", replica="fake-a", model=MODEL)
        abandon = pb.TurnEvent(turn_id="x", run_id="y", abandoned=pb.TurnAbandoned())
        calls = (
            lambda: turns(
                pb.DataplaneItem(admit=pb.AdmitRequest(turn_id="rogue-1", run_id="rogue", model=MODEL))
            ),
            lambda: stub.Resync(iter([pb.ResyncRequest()]), metadata=metadata),
            lambda: stub.Resync(iter([pb.ResyncRequest(turns=[ghost])]), metadata=metadata),
            lambda: turns(pb.DataplaneItem(event=abandon)),
        )
        for call in calls:
            try:
                await asyncio.wait_for(call(), timeout=5)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code().name)
                details.append(f"{e.code().name}: {e.details()}")
            else:
                codes.append("OK")
    return codes, details


def test_without_the_token_every_call_is_refused_and_the_dataplane_still_serves(tmp_path: Path):
    ports = Ports()
    path = write_config(tmp_path, ports)
    env = {"LUFTPAUSE_TOKEN": TOKEN}
    engines = [
        # Slowed down, so the turn the test opens is still running when the rogue calls come.
        Service(
            name,
            ["fake-engine", "--name", name, "--port", str(port), "--time-scale", "50"],
            tmp_path / f"{name}.log",
        )  # fmt: skip
        for name, port in zip(("fake-a", "fake-b"), ports.engines, strict=True)
    ]
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp_path / "dataplane.log")
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"

    def in_flight() -> list[int]:
        return [r["in_flight"] for r in _status(ports)["replicas"]]

    with running(*engines, scheduler, dataplane):
        for service in (*engines, scheduler, dataplane):
            service.start(env)
        dataplane.wait_http(f"{dataplane_url}/health")
        wait_until(
            lambda: httpx.get(f"{dataplane_url}/health", timeout=5).json()["scheduler"] == "connected",
            what="the dataplane, which has the token, to connect",
        )
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST",
                f"{dataplane_url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
                headers={"authorization": f"Bearer {TOKEN}"},
            ) as turn,
        ):
            # Admitted through the scheduler, so the dataplane's own calls carry the token.
            assert turn.status_code == 200
            wait_until(lambda: sum(in_flight()) == 1, what="the turn to be in flight")
            before = _status(ports)

            target = f"127.0.0.1:{ports.grpc}"
            for metadata in (None, (("authorization", "Bearer not-the-token"),)):
                codes, details = asyncio.run(_refused(target, metadata))
                assert codes == ["UNAUTHENTICATED"] * 4, details

            after = _status(ports)
            assert (after["held"], after["runs"]) == (before["held"], before["runs"])
            assert in_flight() == [r["in_flight"] for r in before["replicas"]]
        # The client left: the dataplane says so on its Turns stream, which the scheduler takes.
        wait_until(lambda: sum(in_flight()) == 0, what="the turn's end to reach the scheduler")
        # Its status documents need the token as well; its page holds no data and stays open.
        status = f"http://127.0.0.1:{ports.status}"
        assert httpx.get(f"{status}/status", timeout=5).status_code == 401
        assert httpx.get(f"{status}/status/runs/x", timeout=5).status_code == 401
        assert httpx.get(f"{status}/", timeout=5).status_code == 200
        # And it answers only to the names the config knows (no DNS rebinding).
        assert httpx.get(f"{status}/", headers={"host": "evil.example"}, timeout=5).status_code == 403
    assert "the scheduler's gRPC port takes calls from anyone" not in scheduler.output()


def test_without_a_token_set_the_scheduler_says_its_port_is_open(tmp_path: Path):
    ports = Ports()
    path = write_config(tmp_path, ports)
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    with running(scheduler):
        scheduler.start({"LUFTPAUSE_TOKEN": ""})
        scheduler.wait_http(f"http://127.0.0.1:{ports.status}/status")
        wait_until(lambda: "the scheduler's gRPC port takes calls from anyone" in scheduler.output(),
                   what="the warning")  # fmt: skip
