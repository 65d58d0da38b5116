"""A screenshot of the scheduler's status page with turns held, for the README.

Starts a real scheduler process on free loopback ports in front of two replicas nobody answers
for (the first probe finds them unhealthy, so every turn is held), and over one Turns stream
lets a queue build up and drain: for the first half of `--seconds` an interactive turn arrives
each second and a batch turn every other second (two teams' interactive agents and a nightly batch caller), then each second the
oldest interactive turn's client leaves. Then it renders the page in headless Chromium, whose
chart draws the scheduler's own samples of the last 3 minutes, and saves
bench/results/status-page-<UTC time>.png.

    luftpause bench status_page [--seconds 40] [--out bench/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx

from luftpause.bench.proxy_overhead import Server, free_port, wait_for
from luftpause.bench.results import RESULTS_DIR
from luftpause.bench.sim.flood_watch import screenshot
from luftpause.proto import pb, rpc

MODEL = "fake-llama"
CALLERS = ("team-search", "team-code", "nightly-evals")


def _config(directory: Path, grpc_port: int, status_port: int) -> Path:
    replicas = "".join(
        f'[[replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:{free_port()}"\nmodels = ["{MODEL}"]\n\n'
        for name in ("gpu-a", "gpu-b")
    )
    path = directory / "luftpause.toml"
    path.write_text(
        f"[scheduler]\ngrpc_port = {grpc_port}\nstatus_port = {status_port}\nprobe_period_s = 0.5\n\n{replicas}"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench status_page", description=__doc__)
    parser.add_argument("--seconds", type=int, default=40, help="how long the queue builds up and drains")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    grpc_port, status_port = free_port(), free_port()
    status = f"http://127.0.0.1:{status_port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), grpc_port, status_port)
        scheduler = Server(
            "scheduler",
            [sys.executable, "-m", "luftpause", "scheduler", "--config", str(config)],
            Path(tmp) / "scheduler.log",
        ).start()
        done = threading.Event()
        queue: list[pb.AdmitRequest] = []
        # Turns admitted, and those whose client has left (their second entry in the queue).
        announced: set[str] = set()
        leaving: set[str] = set()
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
                    if request.turn_id in leaving and request.turn_id in announced:
                        left = pb.TurnEvent(
                            turn_id=request.turn_id, run_id=request.run_id, abandoned=pb.TurnAbandoned()
                        )
                        yield pb.DataplaneBatch(items=[pb.DataplaneItem(event=left)])
                    else:
                        announced.add(request.turn_id)
                        yield pb.DataplaneBatch(items=[pb.DataplaneItem(admit=request)])

        try:
            wait_for(
                "both replicas probed unhealthy",
                lambda: all(
                    r["probed"] and not r["healthy"] for r in httpx.get(f"{status}/status").json()["replicas"]
                ),
                [scheduler],
                timeout_s=30.0,
            )
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                call = rpc.SchedulerStub(channel).Turns(items(), timeout=120)
                try:
                    # A queue that builds up and drains, so that the chart has a shape: each
                    # second an interactive turn arrives (a batch one every other second) for the
                    # first half, then each second the oldest interactive turn's client leaves.
                    interactive: list[pb.AdmitRequest] = []
                    for i in range(args.seconds):
                        with ready:
                            if i < args.seconds // 2:
                                for cls in (pb.INTERACTIVE, pb.BATCH) if i % 2 else (pb.INTERACTIVE,):
                                    n = len(queue)
                                    request = pb.AdmitRequest(
                                        turn_id=f"shot-t{n}",
                                        run_id=f"shot-r{n}",
                                        model=MODEL,
                                        # Two teams' agents and a nightly batch job.
                                        caller=CALLERS[i % 2] if cls == pb.INTERACTIVE else CALLERS[2],
                                        service_class=cls,
                                    )
                                    queue.append(request)
                                    if cls == pb.INTERACTIVE:
                                        interactive.append(request)
                            elif interactive:
                                gone = interactive.pop(0)
                                queue.append(gone)  # marks its place; sent as its abandonment
                                leaving.add(gone.turn_id)
                            ready.notify_all()
                        time.sleep(1.0)
                    wait_for(
                        "the scheduler's samples to reach the drained queue",
                        lambda: (
                            httpx.get(f"{status}/status").json()["held"]["count"]
                            == len(queue) - 2 * len(leaving)
                        ),
                        [scheduler],
                        timeout_s=30.0,
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
            scheduler.stop()
    if why_not is not None:
        print(f"status_page: no screenshot: {why_not}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
