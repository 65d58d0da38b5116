"""A screenshot of the scheduler's status page with turns held, for the README.

Starts a real scheduler process on free loopback ports in front of two replicas nobody answers
for (the first probe finds them unhealthy, so every turn is held), admits turns of both classes
for three callers over one Turns stream, one at a time a second apart so that their waits
differ, then renders the page in headless Chromium (its 2 s polls run in virtual time, so the
chart has a few points) and saves bench/results/status-page-<UTC time>.png.

    luftpause bench status_page [--turns 6] [--out bench/results]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx

from luftpause.bench.results import RESULTS_DIR
from luftpause.bench.sim.flood_watch import screenshot
from luftpause.proto import pb, rpc

MODEL = "fake-llama"
CALLERS = ("team-search", "team-code", "nightly-evals")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(directory: Path, grpc_port: int, status_port: int) -> Path:
    replicas = "".join(
        f'[[replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:{_free_port()}"\nmodels = ["{MODEL}"]\n\n'
        for name in ("gpu-a", "gpu-b")
    )
    path = directory / "luftpause.toml"
    path.write_text(
        f"[scheduler]\ngrpc_port = {grpc_port}\nstatus_port = {status_port}\nprobe_period_s = 0.5\n\n{replicas}"
    )
    return path


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"status_page: timed out waiting for {what}")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench status_page", description=__doc__)
    parser.add_argument("--turns", type=int, default=6, help="turns to hold (alternately interactive, batch)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    grpc_port, status_port = _free_port(), _free_port()
    status = f"http://127.0.0.1:{status_port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), grpc_port, status_port)
        log = (Path(tmp) / "scheduler.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "scheduler", "--config", str(config)], stdout=log, stderr=log
        )
        done = threading.Event()
        queue: list[pb.AdmitRequest] = []
        ready = threading.Condition()

        def items() -> Iterator[pb.DataplaneBatch]:
            sent = 0

            def more() -> bool:
                return len(queue) > sent or done.is_set()

            while not done.is_set():
                with ready:
                    ready.wait_for(more, timeout=0.5)
                    fresh, sent = queue[sent:], len(queue)
                for request in fresh:
                    yield pb.DataplaneBatch(items=[pb.DataplaneItem(admit=request)])

        try:
            _wait(
                "both replicas probed unhealthy",
                lambda: all(
                    r["probed"] and not r["healthy"] for r in httpx.get(f"{status}/status").json()["replicas"]
                ),
            )
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                call = rpc.SchedulerStub(channel).Turns(items(), timeout=120)
                try:
                    for i in range(args.turns):
                        with ready:
                            queue.append(
                                pb.AdmitRequest(
                                    turn_id=f"shot-t{i}",
                                    run_id=f"shot-r{i}",
                                    model=MODEL,
                                    caller=CALLERS[i % len(CALLERS)],
                                    service_class=pb.BATCH if i % 2 else pb.INTERACTIVE,
                                )
                            )
                            ready.notify_all()
                        time.sleep(1.0)
                    _wait(
                        f"{args.turns} turns held",
                        lambda: httpx.get(f"{status}/status").json()["held"]["count"] == args.turns,
                    )
                    args.out.mkdir(parents=True, exist_ok=True)
                    path = args.out / f"status-page-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png"
                    why_not = screenshot(f"{status}/", path, Path(tmp) / "profile", virtual_time_ms=12000)
                finally:
                    done.set()
                    with ready:
                        ready.notify_all()
                    call.cancel()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
    if why_not is not None:
        print(f"status_page: no screenshot: {why_not}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
