"""Logs a collector can read: a stack under `luftpause up` with `[logging] format = "json"` writes
one JSON object a line, every service and `up` itself, and a turn's lines carry the run and turn
ids and the trace and span ids its span has at the OTLP receiver (tests/otlp_receiver.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from otlp_receiver import OtlpReceiver
from support import Ports, start_up, stop_up, until, write_config

from luftpause import logs, up

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
RUN_ID = "logged-run"


def lines(text: str) -> list[dict]:
    """Every line of `text` as the JSON object it must be (json.loads fails the test otherwise)."""
    parsed = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(p, dict) for p in parsed)
    return parsed


@pytest.mark.timeout(120)
async def test_every_line_is_a_json_object_and_a_turns_lines_carry_its_trace(tmp_path):
    ports = Ports()
    config = write_config(tmp_path, ports, extra='[logging]\nformat = "json"\n')
    log = tmp_path / "up.log"
    with OtlpReceiver() as receiver:
        # The format comes from the config alone (an empty variable chooses none); at DEBUG the
        # dataplane writes a line as each turn ends.
        env = {**receiver.env, "OTEL_BSP_SCHEDULE_DELAY": "100", "LUFTPAUSE_LOG_FORMAT": ""}
        up = start_up(config, log, env=env, log_level="DEBUG")
        try:
            body = {
                "model": "fake-llama",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
            }
            async with httpx.AsyncClient(timeout=30) as client:
                reply = await client.post(
                    f"http://127.0.0.1:{ports.dataplane}/v1/chat/completions",
                    json=body,
                    headers={"traceparent": TRACEPARENT, "x-luftpause-run-id": RUN_ID},
                )
            assert reply.status_code == 200, reply.text

            def dataplane_span() -> list:
                return [
                    s
                    for s in receiver.received()
                    if s.service == "luftpause-dataplane" and s.trace_id == TRACE_ID
                ]

            await until(lambda: bool(dataplane_span()), timeout_s=30, what="the turn's span at the receiver")
        finally:
            assert stop_up(up) == 0

    records = lines(log.read_text())
    for r in records:
        assert {"time", "level", "service", "logger", "message"} <= set(r), r
        assert r["time"].endswith("Z") and r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR")
    services = {r["service"] for r in records}
    assert {"luftpause-up", "luftpause-scheduler", "luftpause-dataplane", "luftpause-runtime"} <= services
    assert any("luftpause is up" in r["message"] for r in records if r["service"] == "luftpause-up")
    # Every line about the turn (its end, and the engine client's request at DEBUG) is the
    # dataplane's, with the ids of the turn's span.
    (span,) = dataplane_span()
    about = [r for r in records if r.get("run_id") == RUN_ID]
    assert any(r["message"].startswith(f"turn {span.attributes['luftpause.turn_id']} of run {RUN_ID} ended")
               for r in about), about  # fmt: skip
    for r in about:
        assert r["service"] == "luftpause-dataplane"
        assert (r["trace_id"], r["span_id"]) == (TRACE_ID, span.span_id)
        assert r["turn_id"] == span.attributes["luftpause.turn_id"]


def test_an_unknown_log_format_is_refused_naming_it():
    env = {**os.environ, "LUFTPAUSE_LOG_FORMAT": "yaml"}
    got = subprocess.run(
        [sys.executable, "-m", "luftpause", "scheduler"], env=env, capture_output=True, text=True
    )
    assert got.returncode == 2
    assert "log format 'yaml' is not one of text, json (--log-format, LUFTPAUSE_LOG_FORMAT)" in got.stderr


class Writes(io.StringIO):
    """An output that keeps each write apart, as the file it stands for would receive them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_up_writes_each_line_whole_so_no_other_line_can_land_inside_it(monkeypatch):
    # With PYTHONUNBUFFERED (as CI sets it) each write is a write(2) of its own; `up`'s own log
    # goes to stderr, the same file, from another thread. A line written as text and then its
    # newline once let an `up` log line in between: two objects on one line.
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    out = Writes()
    supervisor = up.Supervisor([], out=out)
    supervisor.say("started fake-a (pid 1)")
    child = up.Child("fake-mcp", [], "http://127.0.0.1:1/health")
    stream = io.BytesIO(b'{"service": "luftpause-fake-mcp", "message": "ok"}\na traceback line\n')
    child._relay(SimpleNamespace(stdout=stream), out, supervisor._out_lock)  # type: ignore[arg-type]
    assert len(out.writes) == 3
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in out.writes), out.writes
    assert [r["service"] for r in lines(out.getvalue())] == ["luftpause-up", "luftpause-fake-mcp", "fake-mcp"]
