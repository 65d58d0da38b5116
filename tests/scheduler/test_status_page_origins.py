"""The status page never sends the token to a runtime its scheduler's config does not name.

A crafted link `/?runtime=http://elsewhere` once made the page fetch `elsewhere/status` with the
session's bearer token. Here a real scheduler with `LUFTPAUSE_TOKEN` set serves the page to
headless Chromium (as tests/scheduler/test_status_page.py drives it), and two stand-ins on other
loopback origins record every request and its Authorization header: one named in
`[scheduler] runtime_origins`, one not (it answers every CORS preflight as a hostile server
would). The page refuses the one not named, saying which key allows it, and no request of any
kind reaches it, nor through a redirect from the one named; the one named is read with the token.
Skipped, saying why, where no Chromium is installed (Debian: `apt-get install -y chromium`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import LoopbackServer, Ports, QuietHandler, Service, free_port, running, write_config
from test_status_page import CHROMIUM, _allowing, _render

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium here (Debian: apt-get install -y chromium)"
)

TOKEN = "s3cret-origins"


class _Recorder(LoopbackServer):
    """An HTTP server on its own loopback origin that records each request (method, path and
    Authorization header) and lets any origin read it with any header, as a hostile one would.
    `/moved/status` redirects to `redirect_to`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []
        self.redirect_to = ""
        recorder = self

        class Handler(QuietHandler):
            def _answer(self, status: int, body: bytes = b"", location: str = "") -> None:
                recorder.requests.append((self.command, self.path, self.headers.get("authorization")))
                headers = {
                    "access-control-allow-origin": self.headers.get("origin") or "*",
                    "access-control-allow-headers": "authorization",
                    "access-control-allow-credentials": "true",
                    **({"location": location} if location else {}),
                    "content-type": "application/json",
                }
                self.answer(status, body, headers)

            def do_OPTIONS(self) -> None:  # noqa: N802 (the stdlib's name)
                self._answer(204)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/moved/status":
                    self._answer(302, location=recorder.redirect_to)
                else:
                    self._answer(200, json.dumps({"runs": []}).encode())

        super().__init__(Handler)


@pytest.fixture(scope="module")
def recorders() -> Iterator[tuple[_Recorder, _Recorder]]:
    named, hostile = _Recorder(), _Recorder()
    named.redirect_to = f"{hostile.url}/status"
    yield named, hostile
    named.close()
    hostile.close()


@pytest.fixture(scope="module")
def page_url(
    tmp_path_factory: pytest.TempPathFactory, recorders: tuple[_Recorder, _Recorder]
) -> Iterator[str]:
    """The page of a scheduler with a token whose config names only the first recorder's origin."""
    named, _ = recorders
    tmp = tmp_path_factory.mktemp("status-page-origins")
    ports = Ports(engines=[free_port()])
    path = write_config(tmp, ports)
    _allowing(path, named.url)
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log")
    service.start(env={"LUFTPAUSE_TOKEN": TOKEN})
    with running(service):
        url = f"http://127.0.0.1:{ports.status}"
        service.wait_http(f"{url}/")
        yield url


def test_a_runtime_on_an_origin_not_named_is_refused_and_gets_no_request(
    page_url: str, recorders: tuple[_Recorder, _Recorder], tmp_path: Path
):
    _, hostile = recorders
    page = _render(f"{page_url}/?token={TOKEN}&runtime={hostile.url}", tmp_path / "profile")
    assert hostile.requests == [], "nothing at all reaches an origin the config does not name"
    assert page.texts["error"] == "" and {r[0] for r in page.bodies["replicas"]} == {"fake-a"}, (
        "the page read its own scheduler with the token"
    )
    refusal = page.texts["runtime-error"]
    assert refusal.startswith(f"runtime at {hostile.url} refused: its origin {hostile.url} is neither")
    assert "[scheduler] runtime_origins" in refusal
    assert "runtime-section" in page.visible


def test_a_runtime_on_an_origin_named_in_the_config_is_read_with_the_token(
    page_url: str, recorders: tuple[_Recorder, _Recorder], tmp_path: Path
):
    named, hostile = recorders
    page = _render(f"{page_url}/?token={TOKEN}&runtime={named.url}", tmp_path / "profile")
    assert ("GET", "/status", f"Bearer {TOKEN}") in named.requests
    assert page.texts["runtime-error"] == ""
    assert hostile.requests == []


def test_a_redirect_from_a_named_runtime_does_not_lead_the_token_elsewhere(
    page_url: str, recorders: tuple[_Recorder, _Recorder], tmp_path: Path
):
    named, hostile = recorders
    page = _render(f"{page_url}/?token={TOKEN}&runtime={named.url}/moved", tmp_path / "profile")
    assert ("GET", "/moved/status", f"Bearer {TOKEN}") in named.requests
    assert hostile.requests == [], "the redirect is not followed"
    assert page.texts["runtime-error"].startswith(f"runtime at {named.url}/moved not readable")


def test_the_page_is_served_with_only_its_own_and_the_named_origins_to_connect_to(
    page_url: str, recorders: tuple[_Recorder, _Recorder]
):
    named, _ = recorders
    page = httpx.get(f"{page_url}/")
    policy = page.headers["content-security-policy"]
    assert policy.startswith("connect-src 'self' http://localhost:")
    assert policy.endswith(f" {named.url}")
    assert 'content="[&quot;http://localhost:' in page.text
