"""Proxy overhead: what the dataplane adds to a streamed turn, beside the SGLang router, in one run.

Three arms against one fast engine (32 one-token chunks, no delay), at 1 and at 64 concurrent
streams, each stream a client with its own kept-alive connection sending one turn after another:

    direct     straight to the engine
    router     through the real SGLang router (`pip install sglang-router`; round_robin)
    luftpause  through the dataplane, with the scheduler admitting every turn

Per arm: time to the first byte of the reply body and to its last byte (p50, p99), turns per
second, and CPU milliseconds per turn of each server process, read from /proc (utime + stime of
the process and its children) around the measured turns only. Arms are interleaved: every
concurrency level runs all arms in turn, rotated per repeat, so drift on the machine hits all.
The load generator is a bare asyncio HTTP/1.1 client, so that it is cheap next to the servers.

The engine is `luftpause fake-engine` with its timing overridden to no delay (`--engine fake`),
or `proxy_canned_engine` (`--engine canned`), which replays one prepared stream and costs far
less CPU a turn, so that the engine does not bound the arms on a small machine.
With `--workers 1,2`, the luftpause arm is run once per worker count, each its own dataplane
(`luftpause dataplane --workers N`, arms `luftpause` and `luftpause-2w`) beside the others, all
sharing the one scheduler. With `--profile`, one more luftpause pass runs under py-spy (dataplane
and scheduler) and the functions the dataplane spends its time in are printed. With `--tracing`,
two arms run beside them, each on a scheduler and a dataplane of its own exporting its spans
(OTEL_EXPORTER_OTLP_ENDPOINT) to an OTLP sink of its own on loopback (otlp_sink.py):
`luftpause-traced` every span, `luftpause-sampled` with the sampler a busy deployment would set
(`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, `_ARG=0.1`: a tenth of the turns' traces); the
spans each sink received are counted in the record.

    luftpause bench proxy_overhead [--engine fake|canned] [--turns 2000] [--concurrency 1,64]
                                   [--repeats 1] [--arms direct,router,luftpause] [--workers 1]
                                   [--profile] [--tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import results, stack_config
from luftpause.bench.common import free_port

MODEL = "fake-llama"
TOKEN = "proxy-overhead-bench"
# No delay anywhere in the fake engine, and room for every stream at once: the arms must measure
# the proxies, not the engine's queue. Field names as in fake_engine/params.py.
FAST_FAKE_ENGINE = (
    "prefill_base_s=0,prefill_per_token_s=0,decode_base_s=0,decode_per_seq_s=0,"
    "reply_tokens=32,slots=1024,kv_pool_tokens=100000000"
)
EVENTS_PER_TURN = 35  # role chunk, 32 tokens, finish chunk, [DONE]
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- processes --


@dataclass
class Server:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited:\n{tail}")

    def cpu_s(self) -> float:
        """CPU seconds used so far by the process and every process below it."""
        assert self.proc is not None
        return sum(_own_cpu_s(pid) for pid in _tree(self.proc.pid))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces; the fields after it are plain.
    return text[text.rindex(")") + 2 :].split()


def _own_cpu_s(pid: int) -> float:
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # utime and stime are fields 14 and 15 of stat; 11 and 12 after the name.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def wait_for(what: str, check: Any, servers: list[Server], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for server in servers:
            server.check_alive()
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _chat_ok(url: str, headers: dict[str, str] | None = None) -> bool:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 4},
        headers=headers or {},
        timeout=5,
    )
    return r.status_code == 200


# -- the load --


def _request(path: str, host: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _one_turn(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[float, float]:
    """Sends one streamed turn and reads its reply to the end; (first body byte, last byte) in seconds."""
    started = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head[9:12]
    if status != b"200":
        rest = await reader.read(2000)
        raise RuntimeError(f"turn answered {status.decode()}: {(head + rest)[:500]!r}")
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:
        raise RuntimeError(f"expected a chunked stream, got {head[:300]!r}")
    first = 0.0
    events = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        data = await reader.readexactly(size + 2)
        if not first:
            first = time.perf_counter() - started
        events += data.count(b"data:")
    last = time.perf_counter() - started
    if events != EVENTS_PER_TURN:
        raise RuntimeError(f"a turn brought {events} events, not {EVENTS_PER_TURN}")
    return first, last


async def _stream_worker(
    url: str, turns: int, worker: int, headers: dict[str, str], out: list[tuple[float, float]]
) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Stream {worker}: tell me something."}],
            "stream": True,
            "max_tokens": 32,
        }
    ).encode()
    request = _request("/v1/chat/completions", f"{host}:{port}", body, headers)
    try:
        for _ in range(turns):
            out.append(await _one_turn(reader, writer, request))
    finally:
        writer.close()


async def _load(
    url: str, concurrency: int, turns: int, headers_of: Any
) -> tuple[list[tuple[float, float]], float]:
    per_stream = [turns // concurrency + (1 if i < turns % concurrency else 0) for i in range(concurrency)]
    out: list[tuple[float, float]] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(_stream_worker(url, n, i, headers_of(i), out) for i, n in enumerate(per_stream) if n)
    )
    return out, time.perf_counter() - started


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Arm:
    name: str
    url: str
    servers: list[Server]
    headers_of: Any


def measure(arm: Arm, everyone: list[Server], concurrency: int, turns: int, warmup: int) -> dict[str, Any]:
    asyncio.run(_load(arm.url, concurrency, max(warmup, concurrency), arm.headers_of))
    before = {s.name: s.cpu_s() for s in everyone}
    client_before = time.process_time()
    samples, wall = asyncio.run(_load(arm.url, concurrency, turns, arm.headers_of))
    client_cpu = time.process_time() - client_before
    after = {s.name: s.cpu_s() for s in everyone}
    n = len(samples)
    cpu = {name: 1000 * (after[name] - before[name]) / n for name in before}
    cpu["client"] = 1000 * client_cpu / n
    firsts, lasts = [f * 1000 for f, _ in samples], [last * 1000 for _, last in samples]
    return {
        "arm": arm.name,
        "concurrency": concurrency,
        "turns": n,
        "wall_s": wall,
        "turns_per_s": n / wall,
        "ttfb_ms": {"p50": _percentile(firsts, 0.5), "p99": _percentile(firsts, 0.99)},
        "last_byte_ms": {"p50": _percentile(lasts, 0.5), "p99": _percentile(lasts, 0.99)},
        "cpu_ms_per_turn": cpu,
    }


# -- profile --


def profile_dataplane(
    arm: Arm, dataplane: Server, scheduler: Server, concurrency: int, turns: int, work: Path
) -> str:
    """Runs the luftpause arm once under py-spy; a summary of where the dataplane's time goes."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "py-spy is not installed (pip install py-spy): no profile"
    recorders = []
    for server in (dataplane, scheduler):
        assert server.proc is not None
        out = work / f"{server.name}.pyspy.txt"
        recorders.append(
            (
                server.name,
                out,
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(server.proc.pid),
                        "--format",
                        "raw",
                        "--rate",
                        "200",
                        "--nonblocking",
                        "--output",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    time.sleep(1.0)
    asyncio.run(_load(arm.url, concurrency, turns, arm.headers_of))
    lines = []
    for name, out, proc in recorders:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        lines.append(summarise_profile(name, out))
    return "\n".join(lines)


# Frames under which all the work runs, which say nothing about what bounds it.
_FRAMEWORK = (
    "<frozen runpy>",
    "asyncio/runners.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
    "uvicorn/main.py",
    "uvicorn/server.py",
    "uvicorn/_compat.py",
    "luftpause/cli.py",
    "luftpause/__main__.py",
    "threading.py",
    "serve (",
)


def summarise_profile(name: str, path: Path, top: int = 14) -> str:
    """Where a process spent its busy time, from py-spy's raw (collapsed stacks) output.

    Samples waiting in the event loop's select are idle and left out; the inclusive table
    leaves out the frames every busy sample sits under (the loop, the server's main).
    """
    if not path.exists():
        return f"{name}: py-spy wrote no profile (is ptrace allowed here?)"
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    busy = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        function, _, where = frames[-1].partition(" (")
        if function.endswith("select") and where.startswith("selectors.py"):
            idle += count
            continue
        busy += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
    if not busy:
        return f"{name}: no busy samples"

    def table(title: str, counts: dict[str, int]) -> list[str]:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [f"  {title}:"] + [f"    {100 * c / busy:5.1f}%  {_short(frame)}" for frame, c in rows]

    telling = {f: c for f, c in inclusive.items() if not any(where in f for where in _FRAMEWORK)}
    return "\n".join(
        [f"{name}: {busy} busy samples ({100 * busy / (busy + idle):.0f}% of all), shares of the busy ones"]
        + table("own time", own)
        + table("inclusive time", telling)
    )


def _short(frame: str) -> str:
    function, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{function} ({where})"


# -- the run --


def _config(
    work: Path,
    engine_port: int,
    grpc_port: int,
    status_port: int,
    dataplane_port: int,
    name: str = "luftpause.toml",
) -> Path:
    tables = stack_config.stack(
        grpc=grpc_port,
        status=status_port,
        dataplane=dataplane_port,
        replicas=[stack_config.replica("engine", engine_port, [MODEL])],
    )
    return stack_config.write(work, tables, name)


def luftpause_arm(workers: int) -> str:
    return "luftpause" if workers == 1 else f"luftpause-{workers}w"


def _dataplane_of(arm: str) -> str:
    return arm.replace("luftpause", "dataplane", 1)


@contextlib.contextmanager
def stack(
    engine: str, arms: list[str], work: Path, workers: list[int]
) -> Iterator[tuple[dict[str, Arm], list[Server]]]:
    py = sys.executable
    engine_port, router_port, prom_port = free_port(), free_port(), free_port()
    grpc_port, status_port = free_port(), free_port()
    dataplane_ports = {w: free_port() for w in workers}
    configs = {
        w: _config(work, engine_port, grpc_port, status_port, port, f"luftpause-{w}.toml")
        for w, port in dataplane_ports.items()
    }
    config = configs[workers[0]]
    if engine == "canned":
        engine_server = Server(
            "engine",
            [py, "-m", "luftpause.bench.proxy_canned_engine", "--port", str(engine_port)],
            work / "engine.log",
        )
    else:
        engine_server = Server(
            "engine",
            [
                py,
                "-m",
                "luftpause",
                "--log-level",
                "WARNING",
                "fake-engine",
                "--name",
                "engine",
                "--port",
                str(engine_port),
            ],
            work / "engine.log",
            env={"LUFTPAUSE_FAKE_ENGINE_TIMING": FAST_FAKE_ENGINE},
        )
    servers = [engine_server]
    engine_url = f"http://127.0.0.1:{engine_port}"
    made: dict[str, Arm] = {}
    try:
        engine_server.start()
        wait_for("the engine", lambda: _chat_ok(engine_url), servers)
        made["direct"] = Arm("direct", engine_url, [engine_server], lambda i: {})
        if "router" in arms:
            router = Server(
                "router",
                [
                    py,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(router_port),
                    "--worker-urls",
                    engine_url,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "warn",
                    "--prometheus-port",
                    str(prom_port),
                ],
                work / "router.log",
            )
            servers.append(router.start())
            router_url = f"http://127.0.0.1:{router_port}"
            wait_for("the SGLang router to take its worker", lambda: _chat_ok(router_url), servers)
            made["router"] = Arm("router", router_url, [router], lambda i: {})
        if any(a.startswith("luftpause") and a not in TRACING_ARMS for a in arms):
            scheduler = Server(
                "scheduler",
                [py, "-m", "luftpause", "--log-level", "WARNING", "scheduler", "--config", str(config)],
                work / "scheduler.log",
            )
            servers.append(scheduler.start())
            auth = {"authorization": f"Bearer {TOKEN}"}
            for w in workers:
                arm = luftpause_arm(w)
                dataplane = Server(
                    _dataplane_of(arm),
                    [
                        py,
                        "-m",
                        "luftpause",
                        "--log-level",
                        "WARNING",
                        "dataplane",
                        "--config",
                        str(configs[w]),
                        "--workers",
                        str(w),
                    ],  # fmt: skip
                    work / f"{_dataplane_of(arm)}.log",
                    env={"LUFTPAUSE_TOKEN": TOKEN},
                )
                servers.append(dataplane.start())
                dataplane_url = f"http://127.0.0.1:{dataplane_ports[w]}"
                wait_for(
                    f"the dataplane ({w} workers)", lambda url=dataplane_url: _chat_ok(url, auth), servers
                )
                made[arm] = Arm(
                    arm,
                    dataplane_url,
                    [dataplane, scheduler],
                    # One run per stream, as agents with their own loop would send.
                    lambda i: {**auth, "x-luftpause-run-id": f"bench-stream-{i}"},
                )
        for arm in TRACING_ARMS:
            if arm in arms:
                made[arm] = _tracing_arm(arm, work, engine_port, servers)
        yield made, servers
    finally:
        for server in reversed(servers):
            server.stop()


# The arms with tracing on: each a scheduler and a dataplane of its own, exporting spans over
# OTLP/HTTP (batched, as luftpause/tracing.py sets it up) to a sink of its own on loopback; the
# second samples a tenth of the traces, as the SDK's variables say.
TRACED = "luftpause-traced"
SAMPLED = "luftpause-sampled"
TRACING_ARMS: dict[str, dict[str, str]] = {
    TRACED: {},
    SAMPLED: {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
}


def _suffix(arm: str) -> str:
    """What a tracing arm's processes are named after: scheduler-traced, otlp-sink-sampled."""
    return arm.removeprefix("luftpause-")


def _scheduler_of(arm: str) -> str:
    return f"scheduler-{_suffix(arm)}" if arm in TRACING_ARMS else "scheduler"


def _tracing_arm(arm: str, work: Path, engine_port: int, servers: list[Server]) -> Arm:
    py = sys.executable
    suffix = _suffix(arm)
    sink_port, grpc_port, status_port, dataplane_port = free_port(), free_port(), free_port(), free_port()
    config = _config(work, engine_port, grpc_port, status_port, dataplane_port, f"{arm}.toml")
    sink = Server(
        f"otlp-sink-{suffix}",
        [py, "-m", "luftpause.bench.otlp_sink", "--port", str(sink_port)],
        work / f"sink-{suffix}.log",
    )
    servers.append(sink.start())
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", "LUFTPAUSE_TOKEN": TOKEN,
           **TRACING_ARMS[arm]}  # fmt: skip
    scheduler, dataplane = (
        Server(
            f"{role}-{suffix}",
            [py, "-m", "luftpause", "--log-level", "WARNING", role, "--config", str(config)],
            work / f"{role}-{suffix}.log",
            env=env,
        )
        for role in ("scheduler", "dataplane")
    )
    servers.extend((scheduler.start(), dataplane.start()))
    url = f"http://127.0.0.1:{dataplane_port}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    wait_for(f"the {suffix} dataplane", lambda: _chat_ok(url, auth), servers)
    return Arm(
        arm, url, [dataplane, scheduler], lambda i: {**auth, "x-luftpause-run-id": f"bench-stream-{i}"}
    )


def spans_exported(servers: list[Server], arm: str) -> int:
    """What the sink of the tracing arm `arm` has received."""
    port = next(s for s in servers if s.name == f"otlp-sink-{_suffix(arm)}").argv[-1]
    # The exporters send a batch every 5 s (OTEL_BSP_SCHEDULE_DELAY): the count is taken once two
    # readings a batch period apart agree, or after 30 s.
    deadline = time.monotonic() + 30.0
    last = -1
    while True:
        spans = int(httpx.get(f"http://127.0.0.1:{port}/count", timeout=5).json()["spans"])
        if (spans == last and spans > 0) or time.monotonic() > deadline:
            return spans
        last = spans
        time.sleep(6.0)


def run(
    engine: str,
    arms: list[str],
    concurrency: list[int],
    turns: int,
    repeats: int,
    warmup: int,
    profile: bool,
    workers: list[int] | None = None,
    tracing: bool = False,
) -> dict[str, Any]:
    workers = workers or [1]
    if "luftpause" in arms:
        at = arms.index("luftpause")
        arms = [*arms[:at], *(luftpause_arm(w) for w in workers), *arms[at + 1 :]]
    if tracing:
        arms = [*arms, *TRACING_ARMS]
    work = Path(tempfile.mkdtemp(prefix="luftpause-proxy-overhead-"))
    record: dict[str, Any] = {
        "engine": engine,
        "turns_per_arm": turns,
        "repeats": repeats,
        "arms": arms,
        "concurrency": concurrency,
        "workers": workers,
        "runs": [],
        "logs": str(work),
    }
    with stack(engine, arms, work, workers) as (made, servers):
        for repeat in range(repeats):
            order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
            for c in concurrency:
                for name in order:
                    result = measure(made[name], servers, c, turns, warmup)
                    result["repeat"] = repeat
                    record["runs"].append(result)
                    print(_line(result), flush=True)
        if tracing:
            # Every span each tracing arm exported, once its last batches are in.
            record["spans_exported"] = {arm: spans_exported(servers, arm) for arm in TRACING_ARMS}
            for arm, spans in record["spans_exported"].items():
                print(f"{arm}: {spans} spans received by its OTLP sink", flush=True)
        if profile and "luftpause" in made and "dataplane" in {s.name for s in servers}:
            dataplane = next(s for s in servers if s.name == "dataplane")
            scheduler = next(s for s in servers if s.name == "scheduler")
            summary = profile_dataplane(
                made["luftpause"], dataplane, scheduler, max(concurrency), turns, work
            )
            record["profile"] = summary
            print(summary)
    return record


def _line(r: dict[str, Any]) -> str:
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_turn"].items() if v >= 0.005)
    return (
        f"{r['arm']:>12} x{r['concurrency']:<3} {r['turns']} turns: "
        f"ttfb p50 {r['ttfb_ms']['p50']:.2f} p99 {r['ttfb_ms']['p99']:.2f} ms, "
        f"last p50 {r['last_byte_ms']['p50']:.2f} p99 {r['last_byte_ms']['p99']:.2f} ms, "
        f"{r['turns_per_s']:.0f} turns/s; CPU ms/turn: {cpu}"
    )


def table(record: dict[str, Any]) -> str:
    rows = [
        f"Proxy overhead, engine `{record['engine']}`, {record['turns_per_arm']} turns per arm, "
        f"median over {record['repeats']} repeat(s)",
        "",
        "| arm | streams | TTFB p50 | TTFB p99 | last byte p50 | last byte p99 | added p50 (TTFB / last byte) "
        "| turns/s | CPU ms/turn (server processes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in record["concurrency"]:
        summary: dict[str, dict[str, Any]] = {}
        for arm in record["arms"]:
            runs = [r for r in record["runs"] if r["arm"] == arm and r["concurrency"] == c]
            if not runs:
                continue

            def med(path: tuple[str, ...], runs: list[dict[str, Any]] = runs) -> float:
                values = []
                for r in runs:
                    value: Any = r
                    for key in path:
                        value = value[key]
                    values.append(value)
                return statistics.median(values)

            summary[arm] = {
                "ttfb50": med(("ttfb_ms", "p50")),
                "ttfb99": med(("ttfb_ms", "p99")),
                "last50": med(("last_byte_ms", "p50")),
                "last99": med(("last_byte_ms", "p99")),
                "tps": med(("turns_per_s",)),
                "cpu": {k: med(("cpu_ms_per_turn", k)) for k in runs[0]["cpu_ms_per_turn"]},
            }
        direct = summary.get("direct")
        for arm, s in summary.items():
            servers = {"direct": ["engine"], "router": ["router", "engine"]}.get(
                arm, [_dataplane_of(arm), _scheduler_of(arm), "engine"]
            )
            cpu = ", ".join(f"{name} {s['cpu'][name]:.2f}" for name in servers if name in s["cpu"])
            added = (
                "-"
                if direct is None or arm == "direct"
                else f"{s['ttfb50'] - direct['ttfb50']:+.2f} / {s['last50'] - direct['last50']:+.2f} ms"
            )
            rows.append(
                f"| {arm} | {c} | {s['ttfb50']:.2f} ms | {s['ttfb99']:.2f} ms | {s['last50']:.2f} ms | "
                f"{s['last99']:.2f} ms | {added} | {s['tps']:.0f} | {cpu} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench proxy_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["fake", "canned"], default="fake")
    p.add_argument("--turns", type=int, default=2000, help="measured turns per arm and concurrency")
    p.add_argument("--warmup", type=int, default=50, help="turns before each measurement, not counted")
    p.add_argument("--concurrency", default="1,64", help="comma-separated stream counts")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--arms", default="direct,router,luftpause")
    p.add_argument(
        "--workers",
        default="1",
        help="comma-separated dataplane worker counts, one luftpause arm each (default 1)",
    )
    p.add_argument("--profile", action="store_true", help="profile the dataplane with py-spy afterwards")
    p.add_argument(
        "--tracing",
        action="store_true",
        help=f"add arms {', '.join(TRACING_ARMS)}: each its own scheduler and dataplane exporting spans "
        "to an OTLP sink, every span or a tenth of the traces",
    )
    args = p.parse_args(argv)
    # Readiness checks go through httpx, which logs every request at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - {"direct", "router", "luftpause"}
    if unknown:
        p.error(f"unknown arms: {', '.join(sorted(unknown))}")
    if "router" in arms and importlib.util.find_spec("sglang_router") is None:
        print("sglang-router is not installed (pip install sglang-router): the router arm is left out")
        arms.remove("router")
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    print(
        f"proxy overhead: engine {args.engine}, arms {', '.join(arms)}, streams {concurrency}, {args.turns} turns each"
    )
    try:
        workers = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        p.error(f"--workers takes comma-separated whole numbers, got {args.workers!r}")
    if not workers or any(w < 1 for w in workers) or len(set(workers)) != len(workers):
        p.error(f"--workers takes distinct worker counts of 1 or more, got {args.workers!r}")
    record = run(
        args.engine,
        arms,
        concurrency,
        args.turns,
        args.repeats,
        args.warmup,
        args.profile,
        workers,
        args.tracing,
    )
    text = table(record)
    path = results.write("proxy_overhead", record, text)
    print(text)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
