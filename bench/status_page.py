"""A screenshot of the scheduler's status page during a flood, for the README.

Starts a whole stack (`luftpause up --with-fakes`, two fake engines) on ports of its own and
floods it as the flood benchmarks do, in the open: `--batch` (24) streaming batch agents of a
nightly job through the proxy for the whole of `--seconds` (70); from a tenth of the way in, two
teams' interactive agents (`--interactive`, 4 each) for 40 % of it, and a fan-out of sub-agents
over MCP (`--spawn`, 4) that the page's run tree shows. Held turns rise while the interactive wave
competes with the batch flood and drain when it leaves; the picture is taken near the end, with
the batch flood still on, so that both replicas are busy and the chart (the scheduler's own
samples of the last 3 minutes) shows the wave come and go. Each second it reads the scheduler's
`/status`, and prints the most turns held by class and the busiest in-flight counts it saw, so
that the picture's claim is checked, not assumed. Saves bench/results/status-page-<UTC time>.png.

    luftpause bench status_page [--seconds 70] [--batch 24] [--interactive 4] [--spawn 4] [--out bench/results]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench.results import RESULTS_DIR
from luftpause.bench.sim.flood_watch import screenshot
from luftpause.bench.soak import LoadedStack

TEAMS = ("team-search", "team-code")


def _loadgen(stack: LoadedStack, agents: int, duration_s: float, cls: str, caller: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*stack.CLI, "loadgen", "--url", stack.dataplane, "--agents", str(agents), "--duration-s",
         str(duration_s), "--class", cls, "--caller", caller, "--stream", "--seed", caller],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


class Watch:
    """The scheduler's /status read each second: the peaks the picture should show."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peaks: dict[str, Any] = {"held_interactive": 0, "held_batch": 0, "waiting_for_room": 0}
        self.in_flight: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                doc = httpx.get(self.url, timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            by_class = doc["held"]["by_class"]
            for cls in ("interactive", "batch"):
                key = f"held_{cls}"
                self.peaks[key] = max(self.peaks[key], by_class.get(cls, {}).get("count", 0))
            room = doc.get("waiting_for_room", {}).get("runs", 0)
            self.peaks["waiting_for_room"] = max(self.peaks["waiting_for_room"], room)
            for r in doc["replicas"]:
                self.in_flight[r["name"]] = max(self.in_flight.get(r["name"], 0), r["in_flight"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench status_page", description=__doc__)
    parser.add_argument("--seconds", type=int, default=70, help="how long the batch flood runs")
    parser.add_argument("--batch", type=int, default=24, help="batch agents for the whole time")
    parser.add_argument("--interactive", type=int, default=4, help="interactive agents of each team")
    parser.add_argument("--spawn", type=int, default=4, help="sub-agents fanned out over MCP")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    wave_at, wave_s = args.seconds * 0.1, args.seconds * 0.4
    with LoadedStack("luftpause-status-page-") as stack:
        status = f"http://127.0.0.1:{stack.ports['status']}"
        runtime = f"http://127.0.0.1:{stack.ports['runtime']}"
        started = time.monotonic()
        loads = [_loadgen(stack, args.batch, args.seconds, "batch", "nightly-evals")]
        with Watch(f"{status}/status") as watch:
            time.sleep(wave_at)  # the batch flood alone first: the chart's baseline
            loads += [_loadgen(stack, args.interactive, wave_s, "interactive", team) for team in TEAMS]
            loads.append(
                subprocess.Popen(
                    [
                        *stack.CLI,
                        "loadgen",
                        "--runtime",
                        stack.mcp,
                        "--spawn",
                        str(args.spawn),
                        "--class",
                        "batch",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            while time.monotonic() - started < args.seconds - 8:
                print(
                    f"\r{time.monotonic() - started:4.0f}s  held interactive {watch.peaks['held_interactive']}"
                    f" batch {watch.peaks['held_batch']} (peaks)",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(1.0)
            print(file=sys.stderr)
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"status-page-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png"
            why_not = screenshot(
                f"{status}/?runtime={runtime}", path, stack.workdir / "profile", virtual_time_ms=6000
            )
        for p in loads:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    print(
        f"peaks while it ran: held interactive {watch.peaks['held_interactive']}, held batch "
        f"{watch.peaks['held_batch']}, runs waiting for room {watch.peaks['waiting_for_room']}; in flight "
        + ", ".join(f"{name} {n}" for name, n in sorted(watch.in_flight.items()))
    )
    if why_not is not None:
        print(f"status_page: no screenshot: {why_not}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
