"""What the dataplane takes in one request: bounded bodies and run ids, and run ids in UTF-8.

Against the real stack (real processes on loopback). A body over `[dataplane] max_body_bytes`
(16 MiB by default) is a 413 that says how to allow more, whether or not the client declared its
length, and no engine sees it; a run id over 256 bytes, or not UTF-8, is a 400; a run id in
UTF-8 is stored under its real name and echoed in the bytes the client sent, on turns and on
`DELETE /v1/runs/{id}`.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import Iterator

import httpx
from real_stack import RealStack
from support import wait_until

from luftpause.config import MAX_BODY_BYTES

MODEL = "scripted-llama"


def _body(tag: str, padding: int = 0) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"[{tag}] " + "x" * padding}],
        "metadata": {"script": "reply"},
    }


def _run_id_header(response: httpx.Response) -> bytes | None:
    return next((v for k, v in response.headers.raw if k.lower() == b"x-luftpause-run-id"), None)


def test_a_body_over_the_limit_is_a_413_that_says_how_to_allow_more(real_stack: RealStack):
    tag = uuid.uuid4().hex
    content = json.dumps(_body(tag, padding=MAX_BODY_BYTES)).encode()
    assert len(content) > MAX_BODY_BYTES
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert f"{MAX_BODY_BYTES:,} bytes" in message and "max_body_bytes" in message
    assert real_stack.engine_log(tag) == []


def test_a_body_over_the_limit_without_a_length_is_refused_too(real_stack: RealStack):
    tag = uuid.uuid4().hex
    content = json.dumps(_body(tag, padding=MAX_BODY_BYTES)).encode()

    def chunks() -> Iterator[bytes]:  # sent chunked: no Content-Length to go by
        for start in range(0, len(content), 1 << 20):
            yield content[start : start + (1 << 20)]

    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert r.status_code == 413
    assert "max_body_bytes" in r.json()["error"]["message"]
    assert real_stack.engine_log(tag) == []


def test_a_body_within_the_limit_goes_through(real_stack: RealStack):
    tag = uuid.uuid4().hex
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", json=_body(tag, padding=1 << 20))
    assert r.status_code == 200, r.text


def test_a_run_id_over_256_bytes_is_a_400_naming_the_limit(real_stack: RealStack):
    tag = uuid.uuid4().hex
    with real_stack.client() as client:
        r = client.post("/v1/chat/completions", json=_body(tag), headers={"x-luftpause-run-id": "r" * 1000})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the run id is 1,000 bytes long; at most 256 are allowed"
        assert _run_id_header(r) is None, "the run id that was wrong is not echoed"
        r = client.post(
            "/v1/chat/completions", json=_body(tag), headers={"x-luftpause-run-id": b"run-\xff\xfe"}
        )
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "x-luftpause-run-id must be UTF-8 text"
        r = client.delete(f"/v1/runs/{'r' * 300}")
        assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]
        # Found by the fuzzer: a CR in a path's run id broke the response that echoes it.
        r = client.delete("/v1/runs/0%0D0")
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the run id must not contain control characters"
        r = client.post("/v1/chat/completions", json=_body(tag), headers={"x-luftpause-run-id": b"run\x01"})
        assert r.status_code == 400
    assert real_stack.engine_log(tag) == []


def test_a_utf8_run_id_is_kept_and_echoed_in_the_bytes_the_client_sent(real_stack: RealStack):
    run_id = f"läuft-🚀-{uuid.uuid4().hex[:8]}"
    sent = run_id.encode("utf-8")
    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions", json=_body(uuid.uuid4().hex), headers={"x-luftpause-run-id": sent}
        )
        assert r.status_code == 200, r.text
        assert _run_id_header(r) == sent
        # The scheduler knows the run by its real name, not by its bytes read as latin-1 (the
        # turn's end reaches it with the dataplane's next message or within moments).
        wait_until(
            lambda: real_stack.run_phase(urllib.parse.quote(run_id)) == "idle",
            timeout_s=5,
            what="the scheduler to have the run, by its real name, idle",
        )

        r = client.delete(f"/v1/runs/{urllib.parse.quote(run_id)}")
        assert r.status_code == 204
        assert _run_id_header(r) == sent


def test_a_foreign_host_or_a_page_of_another_site_is_refused(real_stack: RealStack):
    """DNS rebinding (a page whose own name resolves to 127.0.0.1) and cross-site calls from a
    browser: whatever the bind address, only the hosts the config knows are answered."""
    with real_stack.client() as client:
        rebound = client.post(
            "/v1/chat/completions", json=_body(uuid.uuid4().hex), headers={"host": "evil.example"}
        )
        assert rebound.status_code == 403
        assert "'evil.example'" in rebound.json()["error"]["message"]
        assert "allowed_hosts" in rebound.json()["error"]["message"]
        cross_site = client.get("/v1/models", headers={"origin": "https://evil.example"})
        assert cross_site.status_code == 403
        assert client.get("/v1/models", headers={"host": "localhost:1234"}).status_code == 200
        assert client.get("/v1/models", headers={"origin": "http://127.0.0.1:5001"}).status_code == 200
