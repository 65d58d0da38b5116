"""Fidelity: the same scaled-down flood in real time with real processes, and in the simulator.

For each arm it starts two HTTP fake engines (`luftpause fake-engine`, the calibrated model with
the scaled KV pool), then either the real scheduler and dataplane (`luftpause`) or a class-blind
round-robin proxy (`router-round-robin`), runs two `luftpause loadgen` processes beside each
other (batch and interactive agents, closed loop, 8000-character contexts, 2 s tool calls),
stops everything, and simulates the same scenario with the same parameters. It prints, per arm,
real and simulated runs/min by class and their difference, and records both under
bench/results/. A window in which the machine's CPUs were busy more than 90 % of the time is
marked saturated: the real processes were not keeping up, and the row does not count.

    python -m luftpause.bench.sim.fidelity                      # 24 batch + 4 interactive, 3 min
    python -m luftpause.bench.sim.fidelity --batch 12 --interactive 2 --warmup-s 20 --window-s 40
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx

from luftpause.bench.sim.run import simulate
from luftpause.bench.sim.scenarios import SCENARIOS
from luftpause.config import DEFAULT_MODEL
from luftpause.fake_engine.params import EngineParams

ARMS = ("router-round-robin", "luftpause")
AGREEMENT = 0.15
SATURATED = 0.90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


class _Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def _config(directory: Path, engines: list[int], grpc: int, status: int, dataplane: int) -> Path:
    replicas = "".join(
        f'\n[[replicas]]\nname = "fake-{chr(ord("a") + i)}"\nurl = "http://127.0.0.1:{port}"\nmodels = ["{DEFAULT_MODEL}"]\n'
        for i, port in enumerate(engines)
    )
    path = directory / "luftpause.toml"
    path.write_text(
        f"[scheduler]\ngrpc_port = {grpc}\nstatus_port = {status}\n\n"
        f'[dataplane]\nport = {dataplane}\nscheduler = "127.0.0.1:{grpc}"\n{replicas}'
    )
    return path


def real_arm(arm: str, args: argparse.Namespace, logs: Path) -> dict:
    """Runs the scaled flood through real processes for `arm`; returns runs/min by class and CPU use."""
    py = [sys.executable, "-m", "luftpause"]
    procs = _Processes(logs)
    try:
        engine_ports = [_free_port(), _free_port()]
        timing = {"LUFTPAUSE_FAKE_ENGINE_TIMING": f"kv_pool_tokens={args.kv_pool_tokens}"}
        for i, port in enumerate(engine_ports):
            name = f"fake-{chr(ord('a') + i)}"
            procs.start(f"{arm}-{name}", [*py, "fake-engine", "--name", name, "--port", str(port)], timing)
        for port in engine_ports:
            _wait_healthy(f"http://127.0.0.1:{port}/health")
        front = _free_port()
        if arm == "luftpause":
            grpc, status = _free_port(), _free_port()
            conf = _config(logs, engine_ports, grpc, status, front)
            procs.start(f"{arm}-scheduler", [*py, "scheduler", "--config", str(conf)])
            procs.start(f"{arm}-dataplane", [*py, "dataplane", "--config", str(conf)])
        else:
            urls = ",".join(f"http://127.0.0.1:{p}" for p in engine_ports)
            procs.start(
                f"{arm}-router",
                [
                    sys.executable,
                    "-m",
                    "luftpause.bench.sim.round_robin_proxy",
                    "--port",
                    str(front),
                    "--engines",
                    urls,
                ],
            )
        _wait_healthy(f"http://127.0.0.1:{front}/health")
        common = [
            "--url", f"http://127.0.0.1:{front}", "--duration-s", str(args.window_s),
            "--warmup-s", str(args.warmup_s), "--context-chars", "8000", "--tool-latency-s", "2",
            "--seed", str(args.seed),
        ]  # fmt: skip
        loads = {
            cls: subprocess.Popen(
                [
                    *py,
                    "--log-level",
                    "WARNING",
                    "loadgen",
                    *common,
                    "--agents",
                    str(n),
                    "--class",
                    cls,
                    "--caller",
                    cls,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for cls, n in (("batch", args.batch), ("interactive", args.interactive))
            if n > 0
        }
        time.sleep(args.warmup_s)  # the window starts with loadgen's own count, not before
        busy0, total0 = _cpu_times()
        summaries = {cls: json.loads(p.communicate()[0].strip().splitlines()[-1]) for cls, p in loads.items()}
        busy1, total1 = _cpu_times()
    finally:
        procs.stop()
    cpu = (busy1 - busy0) / max(total1 - total0, 1.0)

    def per_min(cls: str) -> float:
        return summaries[cls]["runs_per_min"] if cls in summaries else 0.0

    return {
        "interactive_runs_per_min": per_min("interactive"),
        "batch_runs_per_min": per_min("batch"),
        "errors": sum(s["errors"] for s in summaries.values()),
        "cpu_busy": round(cpu, 2),
        "saturated": cpu > SATURATED,
        "summaries": summaries,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m luftpause.bench.sim.fidelity", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=24, help="batch agents (default 24, half the flood)")
    parser.add_argument("--interactive", type=int, default=4, help="interactive agents (default 4)")
    parser.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=16384,
        help="each engine's KV pool (default 16384, half the calibrated one)",
    )
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(list(argv) if argv is not None else None)
    arms = [a for a in args.arms.split(",") if a]
    scenario = replace(
        SCENARIOS["flood"],
        name="flood-scaled",
        batch_agents=args.batch,
        interactive_agents=args.interactive,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
    )
    params = replace(EngineParams(), kv_pool_tokens=args.kv_pool_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="luftpause-fidelity-") as tmp:
        for arm in arms:
            print(
                f"{arm}: real processes for {args.warmup_s + args.window_s:.0f} s ...",
                file=sys.stderr,
                flush=True,
            )
            real = real_arm(arm, args, Path(tmp))
            sim = simulate(scenario, arm, args.seed, params)
            row = {"arm": arm, "real": real, "sim": sim.as_dict()}
            for cls in ("interactive", "batch"):
                key = f"{cls}_runs_per_min"
                expected = row["sim"][key]
                row[f"{cls}_gap"] = round(abs(real[key] - expected) / expected, 3) if expected else None
            rows.append(row)
    lines = [
        f"Fidelity, flood scaled to {args.batch} batch + {args.interactive} interactive agents, "
        f"KV pool {args.kv_pool_tokens}, window {args.window_s:.0f} s after {args.warmup_s:.0f} s, seed {args.seed}",
        "",
        "| arm | interactive real / sim | gap | batch real / sim | gap | CPU busy | counts |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        real, sim = row["real"], row["sim"]

        def gap(value: float | None) -> str:
            return "-" if value is None else f"{value:.0%}" + ("" if value <= AGREEMENT else " (over 15 %)")

        lines.append(
            f"| {row['arm']} | {real['interactive_runs_per_min']} / {sim['interactive_runs_per_min']} | "
            f"{gap(row['interactive_gap'])} | {real['batch_runs_per_min']} / {sim['batch_runs_per_min']} | "
            f"{gap(row['batch_gap'])} | {real['cpu_busy']:.0%} | {'no: CPU saturated' if real['saturated'] else 'yes'} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        from luftpause.bench import results as records

        path = records.write("fidelity", {"options": vars(args), "arms": rows}, text)
        print(f"record: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
