"""What the end-to-end tests share: free ports, config files, and services as real processes.

Every service a test talks to is started here as `python -m luftpause <service> ...` on loopback
ports picked at random, and stopped (SIGTERM, then SIGKILL) when the test is done. Readiness is
waited for by polling a URL or a TCP port until it answers, never by sleeping a fixed time; every
test that waits for a condition polls it with `wait_until` (blocking) or `until` (in the event
loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import stack_config
from luftpause.bench.common import free_port as free_port  # re-exported: the tests' one way to pick a port

# A real PostgreSQL server for the run store's tests (tests/conftest.py), re-exported.
from luftpause.bench.postgres_server import PostgresServer as PostgresServer
from luftpause.bench.postgres_server import PostgresUnavailable as PostgresUnavailable
from luftpause.bench.postgres_server import start_postgres as start_postgres

START_TIMEOUT_S = 30.0


def _polls(timeout_s: float, interval_s: float, what: str) -> Iterator[float]:
    """The pauses between the polls of one wait for a condition: each one, until `timeout_s` has
    passed, then TimeoutError saying `what` was waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        yield interval_s
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float = START_TIMEOUT_S,
    interval_s: float = 0.05,
    what: str = "condition",
) -> Any:
    """Polls `predicate` until it returns a truthy value, which is returned; fails after `timeout_s`."""
    for pause in _polls(timeout_s, interval_s, what):
        if value := predicate():
            return value
        time.sleep(pause)


async def until(
    predicate: Callable[[], Any],
    timeout_s: float = 10.0,
    what: str = "condition",
    interval_s: float = 0.01,
) -> Any:
    """`wait_until` in the event loop, which runs on between polls: `predicate` may return an
    awaitable (an async function), whose result is the condition."""
    for pause in _polls(timeout_s, interval_s, what):
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(pause)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code < 500
    except httpx.HTTPError:
        return False


def tcp_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def end_process(proc: subprocess.Popen, sig: int, timeout_s: float = 10.0) -> None:
    """Sends `sig` to a process still running and waits for it to exit; SIGKILL after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Service:
    """One service running as a child process; its output goes to `log`."""

    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> Service:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the service without waiting (SIGSTOP, SIGCONT)."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the service and waits for it to exit."""
        if self.proc is not None:
            end_process(self.proc, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_http(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.output()[-3000:]}")
            return http_ok(url)

        wait_until(ready, timeout_s, what=f"{self.name} at {url}")

    def wait_tcp(self, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.output()[-3000:]}")
            return tcp_open(port)

        wait_until(ready, timeout_s, what=f"{self.name} on port {port}")


@dataclass
class Ports:
    """One set of ports for a whole stack, all free when picked."""

    grpc: int = field(default_factory=free_port)
    status: int = field(default_factory=free_port)
    dataplane: int = field(default_factory=free_port)
    runtime: int = field(default_factory=free_port)
    fake_mcp: int = field(default_factory=free_port)
    engines: list[int] = field(default_factory=lambda: [free_port(), free_port()])


def write_config(
    directory: Path,
    ports: Ports,
    extra: str = "",
    models: tuple[str, ...] = ("fake-llama",),
    tool_server: str | None = None,
    replica_extra: str = "",
) -> Path:
    """Writes a config file for a stack on `ports` (two fake engines) and returns its path.

    The runtime's one tool server is fake-mcp on `ports.fake_mcp`, unless `tool_server` gives the
    body of another `[[runtime.mcp_servers]]` table (e.g. `name = ...` and `command = [...]`).
    `replica_extra` goes into every `[[replicas]]` table (e.g. `lookahead = 1`).
    """
    tool = (
        {"name": "fake-mcp", "url": f"http://127.0.0.1:{ports.fake_mcp}/mcp"}
        if tool_server is None
        else tomllib.loads(tool_server)
    )
    each = tomllib.loads(replica_extra) if replica_extra else {}
    replicas = [
        stack_config.replica(f"fake-{chr(ord('a') + i)}", port, models, **each)
        for i, port in enumerate(ports.engines)
    ]
    tables = stack_config.stack(
        grpc=ports.grpc,
        status=ports.status,
        dataplane=ports.dataplane,
        runtime=ports.runtime,
        state_dir=directory / "state",
        tool_server=tool,
        replicas=replicas,
    )
    return stack_config.write(directory, stack_config.merged(tables, extra))


# A key or a table added to a config file written already (bench/stack_config.py).
amend_config = stack_config.amend


def write_runtime_config(directory: Path, port: int, dataplane_port: int, mcp_port: int, state: Path) -> Path:
    """A config for a runtime alone on `port`: its dataplane on `dataplane_port` (often a fake
    engine standing in), the fake MCP server on `mcp_port` as its one tool server."""
    tool = {"name": "fake-mcp", "url": f"http://127.0.0.1:{mcp_port}/mcp"}
    runtime = {"port": port, "dataplane": f"http://127.0.0.1:{dataplane_port}", "state_dir": str(state)}
    return stack_config.write(directory, {"runtime": runtime | {"mcp_servers": [tool]}})


@dataclass
class RuntimeBesideFakes:
    """`luftpause runtime` with a fake engine standing in for its dataplane and the fake MCP server
    as its one tool server: three services on free ports, not started."""

    port: int
    engine_port: int
    mcp_port: int
    engine: Service
    tools: Service
    runtime: Service


def runtime_beside_fakes(directory: Path, state: Path, tool_latency_s: float) -> RuntimeBesideFakes:
    """Writes the runtime's config (state under `state`) into `directory` and makes the services;
    every tool call of the fake MCP server takes `tool_latency_s`."""
    engine_port, mcp_port, port = free_port(), free_port(), free_port()
    config = write_runtime_config(directory, port, engine_port, mcp_port, state)
    engine = Service(
        "engine", ["fake-engine", "--name", "fake-a", "--port", str(engine_port)], directory / "e.log"
    )
    latency = ["--fixed-latency-s", f"{tool_latency_s:g}"]
    tools = Service("fake-mcp", ["fake-mcp", "--port", str(mcp_port), *latency], directory / "m.log")
    runtime = Service("runtime", ["runtime", "--config", str(config)], directory / "runtime.log")
    return RuntimeBesideFakes(port, engine_port, mcp_port, engine, tools, runtime)


@contextlib.contextmanager
def running(*services: Service) -> Iterator[tuple[Service, ...]]:
    """Stops every service on the way out, even when the test failed."""
    try:
        yield services
    finally:
        for s in reversed(services):
            s.stop()


def up_command(config_path: Path, log_level: str = "INFO") -> list[str]:
    return [sys.executable, "-m", "luftpause", "--log-level", log_level, "up", "--config", str(config_path),
            "--with-fakes"]  # fmt: skip


def start_up(
    config_path: Path,
    log: Path,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    log_level: str = "INFO",
) -> subprocess.Popen:
    """Starts `luftpause up --config F --with-fakes` and waits for its banner; fails if it exits."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            up_command(config_path, log_level),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    wait_until(
        lambda: "luftpause is up" in log.read_text(errors="replace") or proc.poll() is not None,
        timeout_s,
        what="luftpause up to print its banner",
    )
    if proc.poll() is not None:
        raise RuntimeError(f"luftpause up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    return proc


def started_children(log: Path) -> dict[str, int]:
    """The pid of each child `luftpause up` reports started (the latest, after a restart)."""
    pids: dict[str, int] = {}
    for name, pid in re.findall(r"(?:started|restarted) (\S+) \(pid (\d+)", log.read_text(errors="replace")):
        pids[name] = int(pid)
    return pids


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still runs (zombies count as gone)."""
    proc = Path("/proc")
    if not proc.exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def stop_up(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """Ctrl-C for `luftpause up`; returns its exit code (killed if it does not stop in time)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# -- Prometheus expositions -----------------------------------------------------------------------

# A scrape's samples by (name, labels).
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, **kw: Any) -> Samples:
    """`GET {url}/metrics` (kw go to httpx, e.g. headers), parsed as Prometheus text; asserts a 200 of that type."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = httpx.get(f"{url}/metrics", timeout=5, **kw)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of one sample, by its name and its whole label set."""
    return samples[name, frozenset(labels.items())]


# -- MCP tools of the runtime -----------------------------------------------------------------------


def task_planning(calls: int, prefix: str) -> str:
    """A task for which the fake engine plans exactly `calls` tool calls."""
    from luftpause.fake_engine.replies import planned_tool_calls

    for i in range(1000):
        task = f"{prefix} {i}"
        if planned_tool_calls([{"role": "user", "content": task}]) == calls:
            return task
    raise AssertionError(f"no task starting {prefix!r} makes the fake engine plan {calls} tool calls")


async def call(client: Any, tool: str, **arguments: Any) -> dict[str, Any]:
    """Calls a runtime tool over MCP (`client`: an `mcp.Client`); asserts it succeeded and that its
    text carries the same object as its structuredContent, for clients that ignore the latter."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


def machine_settings(examples: int) -> Any:
    """Settings for a stateful property test of the scheduler core: a fixed set of `examples`
    sequences (derandomized), so a run of the suite is never flaky; with
    LUFTPAUSE_PROPERTY_EXAMPLES=5000 it explores that many fresh random sequences instead."""
    from hypothesis import HealthCheck, settings

    explore = os.environ.get("LUFTPAUSE_PROPERTY_EXAMPLES")
    return settings(
        max_examples=int(explore or examples),
        stateful_step_count=60,
        deadline=None,
        derandomize=not explore,
        database=None if not explore else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow],
    )


def attained_as_each_was_placed(
    before: Any, after: Any, placed: list[Any], tracks: Callable[[Any], bool] = lambda turn: True
) -> list[dict[str, float]]:
    """Each caller's attained service (scheduler/fairness.py) as each turn of `placed` (in the
    order the decision placed them) was chosen: the state `before` the decision, plus what each
    earlier placement charged its caller: its run's working set as the decision saw it (`after`,
    else `before`), or for a turn outside a run (`tracks` false) or of a run not yet sized, its
    request's estimate (scheduler/gate.py). For the property tests' fairness invariants."""
    from luftpause.scheduler import fairness, gate

    attained = dict(before.attained)
    seen = []
    for turn in placed:
        seen.append(dict(attained))
        run = (after.runs.get(turn.run_id) or before.runs.get(turn.run_id)) if tracks(turn) else None
        if run is not None and run.working_set > 0:
            tokens = run.working_set
        else:
            tokens = gate.estimated_working_set(
                turn.request_bytes, turn.max_tokens, before.tokens_per_byte.get(turn.model)
            )
        attained[turn.caller] = fairness.attain(attained.get(turn.caller, fairness.NONE), tokens, after.now)
    return seen


class QuietHandler(BaseHTTPRequestHandler):
    """A stand-in's request handler: no log line per request, and one call for a whole answer."""

    def answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class HealthOnly(QuietHandler):
    """Answers every GET with 200 and an empty body: enough for a replica to pass its first probe
    (a stand-in that serves nothing after it, as the dataplane tests' "ghost" replica)."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.answer(200)


class LoopbackServer:
    """A stdlib HTTP server for a test's stand-in (a runtime, an engine, a hostile origin) on
    127.0.0.1 (`port` 0: a free one), serving `handler` on a thread of its own until `close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
