"""The port drills: slowloris and 10,000 idle connections on each of the three HTTP ports, and
10,000 idle ones on the scheduler's gRPC port, with the operator's route timed throughout.

`luftpause up --with-fakes` on ports of its own (bench/soak.py's stack, the default bounds of
luftpause/http_server.py: a request head within 10 s, at most 1024 connections on the runtime
and the status port, 2048 on the dataplane). For each port in turn (the scheduler's status port,
the dataplane's, the runtime's), two phases:

- slowloris: `--slowloris` (300) connections each send the start of a request head and then one
  more byte a second, for the header timeout and a few seconds more;
- idle: `--idle` (10,000) connections opened as fast as the machine takes them, which send
  nothing, held until the server closes them (or a few seconds past the header timeout).

Last, the idle phase on the scheduler's gRPC port (at most `grpc_max_connections`, 256, each
closed unless it begins HTTP/2 within the header timeout), the scheduler's `/status` probed.

Throughout each phase a prober (a process of its own) asks the port's operator route (`GET /status`; the dataplane's
`GET /health`) ten times a second, each time on a new connection, as `curl` would, and each
answer's latency is kept (a 2 s client timeout counts as a failure). The record has, per port
and phase: the latency's p50, p99 and max and the probes not answered 200; the drill
connections opened, closed by the server (and with what: 408, 503 or nothing), the seconds from
opening to that close (p50, max), those left open at the end; and the most descriptors the
service held. The client raises its own descriptor limit for the idle connections. JSON and
markdown under bench/results/.

    luftpause bench faults --drill ports [--idle 10000] [--slowloris 300] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import socket
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from luftpause.bench import results

# How often the prober asks, and how long it waits for an answer.
PROBE_EVERY_S = 0.1
PROBE_TIMEOUT_S = 2.0
# The operator may wait this long for an answer (the acceptance).
ANSWER_WITHIN_S = 1.0
# Connections opened at once while opening a flood (the rest wait for a free place).
OPENING_AT_ONCE = 512
# Descriptors the client keeps for itself besides the drill's connections.
CLIENT_SPARE_FDS = 256


@dataclass
class _Drilled(asyncio.Protocol):
    """One drill connection: when it opened, when the server closed it, what it was sent."""

    opened: float = 0.0
    closed_at: float | None = None
    answer: bytes = b""
    transport: asyncio.Transport | None = field(default=None, repr=False)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.opened = transport, time.monotonic()

    def data_received(self, data: bytes) -> None:
        if len(self.answer) < 64:
            self.answer += data[:64]

    def eof_received(self) -> bool:
        self._closed()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()

    def _closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()

    def status(self) -> str:
        """What the server answered before closing: its status code, or "none"."""
        parts = self.answer.split(b" ", 2)
        return (
            parts[1].decode(errors="replace")
            if len(parts) > 1 and self.answer.startswith(b"HTTP/")
            else "none"
        )


def _ask(port: int, route: str) -> str:
    """One `GET route` on a new connection, as curl would ask it: the status code, or why none."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.sendall(f"GET {route} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return type(e).__name__
    parts = answer.split(b" ", 2)
    return parts[1].decode(errors="replace") if answer.startswith(b"HTTP/") and len(parts) > 1 else "garbled"


def _probe(port: int, route: str, pid: int | None, ready: Any, stop: Any, out: Any) -> None:
    """The prober's process: sets `ready` once it has asked, asks until `stop` is set, then puts
    (latencies, failures, most fds) on `out`."""
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    max_fds = 0
    while not stop.is_set():
        asked = time.monotonic()
        status = _ask(port, route)
        if status == "200":
            latencies.append(time.monotonic() - asked)
        else:
            failures[status] += 1
        if pid is not None:
            try:
                max_fds = max(max_fds, len(os.listdir(f"/proc/{pid}/fd")))
            except OSError:
                pass
        ready.set()
        stop.wait(max(0.0, asked + PROBE_EVERY_S - time.monotonic()))
    out.put((latencies, dict(failures), max_fds))


class Prober:
    """Asks `GET route` on `port` every PROBE_EVERY_S, each time on a new connection, in a process
    of its own (so neither the drill's event loop nor its lock on the interpreter delays it); keeps
    each answer's latency, and the most descriptors process `pid` (the service) held, from /proc."""

    def __init__(self, port: int, route: str, pid: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._ready, self._stop, self._out = context.Event(), context.Event(), context.Queue()
        self._process = context.Process(
            target=_probe, args=(port, route, pid, self._ready, self._stop, self._out)
        )
        self.latencies_s: list[float] = []
        self.failures: dict[str, int] = {}
        self.max_fds = 0

    def __enter__(self) -> Prober:
        self._process.start()
        if not self._ready.wait(timeout=30):
            self._process.kill()
            raise RuntimeError("the prober did not start within 30 s")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.latencies_s, self.failures, self.max_fds = self._out.get(timeout=PROBE_TIMEOUT_S + 10)
        self._process.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        """The latencies' p50, p99 and max, the failures by kind, the most descriptors."""
        lat = sorted(self.latencies_s)

        def ms(q: float) -> float | None:
            return round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

        return {
            "probes": len(lat) + sum(self.failures.values()),
            "answered_200": len(lat),
            "failed": self.failures,
            "p50_ms": ms(0.5),
            "p99_ms": ms(0.99),
            "max_ms": round(1000 * lat[-1], 1) if lat else None,
            "over_1s": sum(1 for x in lat if x > ANSWER_WITHIN_S),
            "service_fds_max": self.max_fds or None,
        }


async def _open(port: int, n: int, first_bytes: bytes) -> tuple[list[_Drilled], Counter[str]]:
    """`n` connections to the port, OPENING_AT_ONCE at a time, each sent `first_bytes`; and the
    errors of those that could not be opened, by kind."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(OPENING_AT_ONCE)
    opened: list[_Drilled] = []
    errors: Counter[str] = Counter()

    async def one() -> None:
        async with gate:
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(_Drilled, "127.0.0.1", port), timeout=10
                )
            except (TimeoutError, OSError) as e:
                errors[type(e).__name__] += 1
                return
            if first_bytes and conn.transport is not None:
                conn.transport.write(first_bytes)
            opened.append(conn)

    await asyncio.gather(*(one() for _ in range(n)))
    return opened, errors


async def _hold(conns: list[_Drilled], until: float, trickle: bytes = b"") -> None:
    """Until every connection is closed by the server or `until` passes; sends `trickle` on each
    open one once a second."""
    while time.monotonic() < until and any(c.closed_at is None for c in conns):
        if trickle:
            for c in conns:
                if c.closed_at is None and c.transport is not None and not c.transport.is_closing():
                    c.transport.write(trickle)
        await asyncio.sleep(min(1.0, max(0.0, until - time.monotonic())))


def _connections(conns: list[_Drilled], errors: Counter[str]) -> dict[str, Any]:
    closed = [c for c in conns if c.closed_at is not None]
    after = sorted(c.closed_at - c.opened for c in closed if c.closed_at is not None)
    return {
        "opened": len(conns),
        "open_errors": dict(errors),
        "closed_by_server": len(closed),
        "answers": dict(Counter(c.status() for c in closed)),
        "closed_after_s_p50": round(statistics.median(after), 2) if after else None,
        "closed_after_s_max": round(after[-1], 2) if after else None,
        "left_open": len(conns) - len(closed),
    }


async def drill_phase(
    port: int, route: str, kind: str, n: int, hold_s: float, pid: int | None = None, probed: int | None = None
) -> dict[str, Any]:
    """One phase on one port: `n` connections of `kind` ("slowloris" or "idle") held up to
    `hold_s` past their opening, the operator's route probed meanwhile (on `probed`, another port
    of the same service, where given: the scheduler's gRPC port has no route of its own)."""
    head = f"GET {route} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-drill: ".encode() if kind == "slowloris" else b""
    with Prober(port if probed is None else probed, route, pid) as prober:
        started = time.monotonic()
        conns, errors = await _open(port, n, head)
        opened_s = time.monotonic() - started
        try:
            await _hold(conns, time.monotonic() + hold_s, trickle=b"x" if kind == "slowloris" else b"")
            held = _connections(conns, errors)  # before the drill closes those left
        finally:
            for c in conns:
                if c.transport is not None:
                    c.transport.abort()
    return {
        "kind": kind,
        "connections": n,
        "opening_s": round(opened_s, 2),
        "drill_s": round(time.monotonic() - started, 2),
        **held,
        "status": prober.summary(),
    }


def raise_own_fd_limit(wanted: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE towards `wanted` (as far as the hard limit
    allows); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


# The ports flooded: their key in bench/soak.py's ports, the key of the port probed, the service's
# name in `up`'s log, the route probed, the phases. The scheduler's gRPC port speaks no HTTP/1.1
# head, so it is flooded with idle connections only, its status port probed.
PORTS = (
    ("status", "status", "scheduler", "/status", ("slowloris", "idle")),
    ("dataplane", "dataplane", "dataplane", "/health", ("slowloris", "idle")),
    ("runtime", "runtime", "runtime", "/status", ("slowloris", "idle")),
    ("grpc", "status", "scheduler", "/status", ("idle",)),
)


def run(idle: int = 10_000, slowloris: int = 300, header_timeout_s: float = 10.0) -> dict[str, Any]:
    """The drill on a fresh stack (see the module); the record."""
    # Here, not at the top: the prober's process imports this module, and needs none of the stack.
    from luftpause.bench.soak import LoadedStack

    limit = raise_own_fd_limit(idle + slowloris + CLIENT_SPARE_FDS)
    usable = max(0, limit - CLIENT_SPARE_FDS)
    if usable < idle:
        print(f"only {limit} descriptors may be open here (the hard RLIMIT_NOFILE): {usable} idle "
              f"connections instead of {idle}", flush=True)  # fmt: skip
    hold_s = header_timeout_s + 3
    ports: list[dict[str, Any]] = []
    with LoadedStack("luftpause-faults-ports-") as stack:
        pids = stack.pids()

        async def drill() -> None:
            for key, probed, service, route, kinds in PORTS:
                sizes = {"slowloris": slowloris, "idle": min(idle, usable)}
                for kind in kinds:
                    n = sizes[kind]
                    phase = await drill_phase(stack.ports[key], route, kind, n, hold_s, pids.get(service),
                                              stack.ports[probed])  # fmt: skip
                    name = service if key == probed else f"{service} {key}"
                    ports.append({"service": name, "route": route, **phase})
                    s = phase["status"]
                    print(f"{name} {kind} x{n}: {phase['closed_by_server']} closed by the server "
                          f"{phase['answers']}, {phase['left_open']} left open; {route} p50 {s['p50_ms']} ms, "
                          f"p99 {s['p99_ms']} ms, max {s['max_ms']} ms, failed {s['failed']}", flush=True)  # fmt: skip

        asyncio.run(drill())
    ok = all(p["status"]["failed"] == {} and p["status"]["over_1s"] == 0 for p in ports)
    return {
        "idle": idle,
        "slowloris": slowloris,
        "header_timeout_s": header_timeout_s,
        "client_fd_limit": limit,
        "phases": ports,
        "status_answered_within_1s_throughout": ok,
    }


def table(record: dict[str, Any]) -> str:
    """The record as markdown: a row per port and phase."""
    lines = [
        "| port | drill | connections | closed by the server (answers) | closed after s (p50 / max) "
        "| left open | status p50 / p99 / max ms | probes failed | service fds max |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in record["phases"]:
        s = p["status"]
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(p["answers"].items()))
        lines.append(
            f"| {p['service']} `{p['route']}` | {p['kind']} | {p['opened']} | {p['closed_by_server']} ({answers}) "
            f"| {results.cell(p['closed_after_s_p50'])} / {results.cell(p['closed_after_s_max'])} "
            f"| {p['left_open']} | {results.cell(s['p50_ms'])} / {results.cell(s['p99_ms'])} / "
            f"{results.cell(s['max_ms'])} | {sum(s['failed'].values())} of {s['probes']} "
            f"| {results.cell(s['service_fds_max'])} |"
        )
    verdict = "yes" if record["status_answered_within_1s_throughout"] else "NO"
    lines += ["", f"The operator's route answered 200 within 1 s throughout: {verdict}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="luftpause bench faults --drill ports", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--idle", type=int, default=10_000, help="idle connections per port")
    p.add_argument("--slowloris", type=int, default=300, help="trickling connections per port")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    record = run(args.idle, args.slowloris)
    text = table(record)
    print(text)
    if not args.no_record:
        print(f"\nrecord: {results.write('faults-ports', record, text)}")
    return 0 if record["status_answered_within_1s_throughout"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
