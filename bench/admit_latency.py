"""Admission round trip on loopback: how long the dataplane waits for the scheduler when there is room.

Starts a real scheduler process (`python -m luftpause scheduler`) on free loopback ports in front
of one stand-in replica (a tiny HTTP server in this process answering /health, and reporting no
load, so every turn is placed at once), then admits turns with the dataplane's own scheduler
client over its Turns stream: one turn at a time (`--concurrency` at once, if asked), each turn
reported completed right after its placement so the state stays small. Prints p50, p90, p99 and
the mean of the admission alone (admit sent to placement read), as the client sees it, and
writes the record under bench/results/.

    luftpause bench admit_latency [--turns 3000] [--concurrency 1] [--warmup 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from luftpause.bearer import token_from_env
from luftpause.bench import results, stack_config
from luftpause.bench.common import free_port
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.proto import pb

MODEL = "bench-model"


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        status = 200 if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _scheduler(tmp: Path):
    replica = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    grpc_port, status_port = free_port(), free_port()
    stand_in = stack_config.replica("stand-in", replica.server_address[1], [MODEL], metrics="none")
    config = stack_config.write(
        tmp, stack_config.stack(grpc=grpc_port, status=status_port, replicas=[stand_in])
    )
    log = (tmp / "scheduler.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "luftpause", "--log-level", "WARNING", "scheduler", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the scheduler exited: {(tmp / 'scheduler.log').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                doc = httpx.get(f"http://127.0.0.1:{status_port}/status", timeout=1).json()
                if doc["replicas"][0]["probed"]:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not come up within 30 s")
            time.sleep(0.05)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
        replica.shutdown()
        log.close()


async def _measure(target: str, turns: int, warmup: int, concurrency: int) -> list[float]:
    # The scheduler started here inherits LUFTPAUSE_TOKEN, and then asks for it.
    client = SchedulerClient(target, token_from_env())
    await client.start()
    try:
        deadline = time.monotonic() + 10
        while not client.connected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Turns stream to the scheduler at {target} within 10 s")
            await asyncio.sleep(0.01)
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        latencies: list[float] = []
        counter = iter(range(warmup + turns))

        async def worker() -> None:
            for n in counter:
                request = pb.AdmitRequest(
                    turn_id=f"t{n}", run_id=f"r{n % 1000}", model=MODEL, caller=f"c{n % 10}"
                )
                started = time.perf_counter()
                reply = await client.admit(request, never)
                elapsed = time.perf_counter() - started
                if reply is None or reply.outcome != pb.AdmitReply.PLACED:
                    raise RuntimeError(f"turn t{n} not placed: {reply}")
                if n >= warmup:
                    latencies.append(elapsed)
                completed = pb.TurnCompleted(finish_reason="stop", prompt_tokens=10, completion_tokens=5)
                client.report(
                    pb.TurnEvent(turn_id=request.turn_id, run_id=request.run_id, completed=completed)
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return latencies


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench admit_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=3000, help="admissions measured")
    p.add_argument("--warmup", type=int, default=200, help="admissions made first and not measured")
    p.add_argument("--concurrency", type=int, default=1, help="admissions in flight at once")
    p.add_argument("--no-record", action="store_true", help="print only; write nothing under bench/results/")
    args = p.parse_args(argv)
    # Waiting for the scheduler polls its /status; each poll is not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="luftpause-admit-") as tmp, _scheduler(Path(tmp)) as target:
        latencies = asyncio.run(_measure(target, args.turns, args.warmup, args.concurrency))
    ms = [x * 1000 for x in latencies]
    row: dict[str, Any] = {
        "turns": len(ms),
        "concurrency": args.concurrency,
        "p50_ms": round(_quantile(ms, 0.50), 3),
        "p90_ms": round(_quantile(ms, 0.90), 3),
        "p99_ms": round(_quantile(ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "max_ms": round(max(ms), 3),
    }
    table = (
        "| admissions | concurrency | p50 ms | p90 ms | p99 ms | mean ms | max ms |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {row['turns']:,} | {row['concurrency']} | {row['p50_ms']} | {row['p90_ms']} | {row['p99_ms']} | "
        f"{row['mean_ms']} | {row['max_ms']} |"
    )
    print(table)
    if not args.no_record:
        print(f"\nrecord: {results.write('admit_latency', row, table)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
