"""The failure-semantics table, row by row, end to end with real processes on loopback.

Each test drives one row of the table through a real dataplane and scheduler against a scripted
engine process, and checks what the client sees, what luftpause did (the engine's own log of
what reached it, the dataplane's turn counts on /metrics, the run's phase on the scheduler), and
that the failed turn freed its slot: afterwards the scheduler's /status shows nothing in flight
and nothing held. The stack is `real_stack.py`'s.
"""

from __future__ import annotations

import json
import signal
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from real_stack import TOKEN, RealStack, replica
from support import Ports, Service, running, wait_until, write_config


@pytest.fixture(autouse=True)
def nothing_left_in_flight(real_stack: RealStack) -> Iterator[None]:
    yield
    wait_until(real_stack.settled, timeout_s=10, what="the scheduler to show no turn in flight or held")


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _body(model: str, tag: str, script: str = "reply", stream: bool = True, **extra: object) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "script": script,
        "tag": tag,
        **extra,
    }


def _raw_request(port: int, body: dict, run_id: str) -> socket.socket:
    """Sends a chat completion over a bare socket, so the test decides when the client leaves."""
    content = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TOKEN}\r\nx-luftpause-run-id: {run_id}\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head + content)
    return sock


def test_client_gone_while_held_abandons_the_turn_and_no_engine_request_is_made(real_stack: RealStack):
    tag = _tag()
    abandoned = real_stack.turns_counted("chat", "abandoned")
    sock = _raw_request(real_stack.ports.dataplane, _body("busy-llama", tag), f"held-{tag}")
    try:
        wait_until(
            lambda: real_stack.status()["held"]["count"] == 1, timeout_s=10, what="the turn to be held"
        )
    finally:
        sock.close()
    wait_until(
        lambda: real_stack.status()["held"]["count"] == 0, timeout_s=10, what="the turn to leave the queue"
    )
    wait_until(
        lambda: real_stack.turns_counted("chat", "abandoned") == abandoned + 1,
        timeout_s=10,
        what="the dataplane to count the turn abandoned",
    )
    busy_log = httpx.get(f"http://127.0.0.1:{_busy_port(real_stack)}/_log", timeout=5).json()
    assert [e for e in busy_log if e["tag"] == tag] == [], (
        "a held turn whose client left never reaches an engine"
    )


def _busy_port(stack: RealStack) -> int:
    busy = next(r for r in stack.status()["replicas"] if r["name"] == "busy")
    return int(busy["url"].rsplit(":", 1)[1])


def test_client_gone_mid_stream_closes_the_engine_request(real_stack: RealStack):
    tag = _tag()
    failed = real_stack.turns_counted("chat", "failed")
    with real_stack.client() as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json=_body("scripted-llama", tag, "hang"),
            headers={"x-luftpause-run-id": f"gone-{tag}"},
        ) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())
            assert first.startswith(b"data: ")
        # Leaving the block closes the connection with the reply unfinished.
    wait_until(
        lambda: real_stack.engine_log(tag) and real_stack.engine_log(tag)[0]["disconnected"],
        timeout_s=10,
        what="the engine to see its request closed",
    )
    wait_until(
        lambda: real_stack.turns_counted("chat", "failed") == failed + 1, timeout_s=10, what="a failed turn"
    )
    assert real_stack.run_phase(f"gone-{tag}") == "idle"


def test_engine_unreachable_is_a_502_naming_the_replica(real_stack: RealStack):
    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "ghost-llama", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-luftpause-run-id": "ghost-run"},
        )
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert message.startswith("engine ghost: ") and len(message) > len("engine ghost: ")
    assert r.headers["x-luftpause-run-id"] == "ghost-run"
    assert real_stack.run_phase("ghost-run") == "idle"


def test_engine_failing_mid_stream_sends_the_chunks_so_far_then_closes_without_done(real_stack: RealStack):
    tag = _tag()
    received = b""
    with real_stack.client() as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json=_body("scripted-llama", tag, "break"),
            headers={"x-luftpause-run-id": f"broken-{tag}"},
        ) as r:
            assert r.status_code == 200
            assert r.headers["x-luftpause-run-id"] == f"broken-{tag}"
            with pytest.raises(httpx.RemoteProtocolError):
                for piece in r.iter_raw():
                    received += piece
    events = [line for line in received.split(b"\n\n") if line]
    assert len(events) == 2 and all(e.startswith(b"data: {") for e in events)
    assert b"[DONE]" not in received
    wait_until(
        lambda: real_stack.run_phase(f"broken-{tag}") == "idle", timeout_s=10, what="the run to be idle"
    )
    log = real_stack.dataplane_service.output()
    assert "broke off" in log
    assert "ASGI callable returned without completing response" not in log


@pytest.mark.parametrize(("status", "retry_after"), [(429, "7"), (503, "2"), (500, None)])
def test_engine_refusing_at_once_passes_status_body_and_retry_after(
    real_stack: RealStack, status: int, retry_after: str | None
):
    tag = _tag()
    extra = {"status": status} | ({"retry_after": retry_after} if retry_after else {})
    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions",
            json=_body("scripted-llama", tag, "refuse", **extra),
            headers={"x-luftpause-run-id": f"refused-{tag}"},
        )
    assert r.status_code == status
    assert r.json() == {"error": {"message": "scripted refusal", "type": "scripted"}}
    assert r.headers.get("retry-after") == retry_after
    assert r.headers["x-luftpause-run-id"] == f"refused-{tag}"
    assert r.headers["x-luftpause-replica"] == "scripted"
    assert len(real_stack.engine_log(tag)) == 1
    assert real_stack.run_phase(f"refused-{tag}") == "idle"


def test_unknown_model_is_a_404_at_once_without_any_turn(real_stack: RealStack):
    refused = real_stack.turns_counted("chat", "refused")
    runs = real_stack.status()["runs"]["count"]
    # Refused before queueing, not held: a held turn waits for a replica that never comes until
    # the client's timeout ends the request, so the 404 answering it at all says so, and the
    # scheduler never counted a run for it (below); no bound on the clock is needed.
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", json=_body("no-such-model", _tag(), stream=False))
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no Generative replica serves model 'no-such-model'"}}
    assert r.headers["x-luftpause-run-id"]
    assert real_stack.turns_counted("chat", "refused") == refused + 1
    assert real_stack.status()["runs"]["count"] == runs


def test_scheduler_unreachable_holds_the_turn_until_it_is_back(real_stack: RealStack, tmp_path: Path):
    """A dataplane of its own, with its own scheduler, in front of the shared scripted engine."""
    ports = Ports(engines=[])
    path = write_config(tmp_path, ports, extra=replica("plain", real_stack.scripted_port, "plain-llama"))
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp_path / "dataplane.log")
    url = f"http://127.0.0.1:{ports.dataplane}"
    status = f"http://127.0.0.1:{ports.status}/status"

    def health() -> str:
        return httpx.get(f"{url}/health", timeout=5).json()["scheduler"]

    with running(scheduler, dataplane):
        dataplane.start(env={"LUFTPAUSE_TOKEN": ""})
        dataplane.wait_http(f"{url}/health")
        assert health() == "reconnecting"
        tag = _tag()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.post,
                f"{url}/v1/chat/completions",
                json=_body("plain-llama", tag, stream=False),
                headers={"x-luftpause-run-id": f"outage-{tag}"},
                timeout=60,
            )
            # Held while the scheduler is away: no answer, no engine request, and retried meanwhile.
            wait_until(
                lambda: dataplane.output().count("not reachable") >= 1,
                timeout_s=10,
                what="the outage warning",
            )
            assert not pending.done()
            assert real_stack.engine_log(tag) == []
            scheduler.start()
            r = pending.result(timeout=60)
        assert r.status_code == 200
        assert r.headers["x-luftpause-run-id"] == f"outage-{tag}"
        assert r.json()["choices"][0]["message"]["content"] == "hello"
        assert len(real_stack.engine_log(tag)) == 1
        doc = httpx.get(status, timeout=5).json()
        assert sum(rep["in_flight"] for rep in doc["replicas"]) == 0 and doc["held"]["count"] == 0
        # Without a token the dataplane lets everyone in, and said so when it started.
        assert "LUFTPAUSE_TOKEN is not set" in dataplane.output()
        scheduler.kill(signal.SIGTERM)
