"""The soak: a whole stack under steady load for minutes, and whether anything in it grows.

`luftpause up --with-fakes` on ports of its own; own-loop agents (`luftpause loadgen`, streamed
turns, one interactive and one batch process) through the proxy, and sub-agents over MCP spawned
in waves and awaited, for `--duration-s` (600). Every `--every-s` (10) the resident memory and
the open file descriptors of every service are read from /proc (Linux). At the end, with the
load stopped: each service's growth from the median of the first minute to the median of the
last, and the scheduler's in-flight and held counts, which must be back to zero. A markdown
table and the JSON under bench/results/, and a PNG of the series.

With `--store`, the runtime keeps its runs in PostgreSQL (`[runtime] store`): a URL, or
`postgresql` for a throwaway server on this machine.

    luftpause bench soak [--duration-s 600] [--every-s 10] [--agents 8] [--spawn 4] [--retention-s S]
                         [--store postgresql|URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from mcp import Client

from luftpause.bench import results, stack_config
from luftpause.bench.common import free_port

SERVICES = ("scheduler", "dataplane", "runtime", "fake-a", "fake-b", "fake-mcp")


def _config(directory: Path, runtime_extra: dict[str, Any] | None = None) -> tuple[Path, dict[str, int]]:
    """The soak's stack on free ports: two fake engines, fake-mcp, and `runtime_extra` (keys of
    `[runtime]`) on top."""
    ports = {name: free_port() for name in ("grpc", "status", "dataplane", "runtime", "mcp", "a", "b")}
    tables = stack_config.stack(
        grpc=ports["grpc"],
        status=ports["status"],
        dataplane=ports["dataplane"],
        runtime=ports["runtime"],
        state_dir=directory / "state",
        tool_server={"name": "fake-mcp", "url": f"http://127.0.0.1:{ports['mcp']}/mcp"},
        replicas=[
            stack_config.replica("fake-a", ports["a"], ["fake-llama"]),
            stack_config.replica("fake-b", ports["b"], ["fake-llama"]),
        ],
    )
    path = stack_config.write(directory, stack_config.merged(tables, {"runtime": runtime_extra or {}}))
    return path, ports


def _pids(log: Path) -> dict[str, int]:
    found = re.findall(r"(?:started|restarted) (\S+) \(pid (\d+)", log.read_text(errors="replace"))
    return {name: int(pid) for name, pid in found}


class LoadedStack:
    """`luftpause up --with-fakes` on ports of its own, and own-loop agents of both classes on it:
    what the soak and the fault drill (bench/faults.py) both run. A context manager: `up` is
    stopped (SIGINT) on the way out."""

    CLI = (sys.executable, "-m", "luftpause")

    def __init__(
        self, prefix: str, env: dict[str, str] | None = None, runtime_extra: dict[str, Any] | None = None
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.config, self.ports = _config(self.workdir, runtime_extra)
        self.log = self.workdir / "up.log"
        self._env = {**os.environ, **(env or {})}
        self.loads: list[subprocess.Popen] = []
        self.dataplane = f"http://127.0.0.1:{self.ports['dataplane']}"
        self.mcp = f"http://127.0.0.1:{self.ports['runtime']}/mcp"

    def __enter__(self) -> LoadedStack:
        with self.log.open("wb") as out:
            self.up = subprocess.Popen(
                [*self.CLI, "up", "--config", str(self.config), "--with-fakes"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env,
            )
        deadline = time.monotonic() + 90
        while "luftpause is up" not in self.log.read_text(errors="replace"):
            if self.up.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"luftpause up did not come up:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def __exit__(self, *_: object) -> None:
        self.up.send_signal(signal.SIGINT)
        try:
            self.up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.up.kill()

    def pids(self) -> dict[str, int]:
        return _pids(self.log)

    def own_loop_agents(self, agents: int, duration_s: float, caller: str) -> None:
        """`agents` own-loop agents of each class, streaming, for `duration_s`, in the background."""
        self.loads = [
            subprocess.Popen(
                [
                    *self.CLI,
                    "loadgen",
                    "--url",
                    self.dataplane,
                    "--agents",
                    str(agents),
                    "--duration-s",
                    str(duration_s),
                    "--class",
                    cls,
                    "--caller",
                    f"{caller}-{cls}",
                    "--stream",
                    "--seed",
                    cls,
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for cls in ("interactive", "batch")
        ]

    def counts_after_load(self, settle_s: float = 30.0) -> dict[str, int]:
        """Once the own-loop agents are done: the scheduler's in-flight and held counts, given
        `settle_s` to reach zero."""
        for p in self.loads:
            p.wait(timeout=180)
        status = f"http://127.0.0.1:{self.ports['status']}/status"
        settle = time.monotonic() + settle_s
        while True:
            doc = httpx.get(status, timeout=5).json()
            after = {"in_flight": sum(r["in_flight"] for r in doc["replicas"]), "held": doc["held"]["count"]}
            if after == {"in_flight": 0, "held": 0} or time.monotonic() > settle:
                return after
            time.sleep(0.5)

    def restarts(self) -> int:
        return len(re.findall(r"restarted ", self.log.read_text(errors="replace")))


def _sample(pid: int) -> tuple[float, int]:
    """(resident MiB, open file descriptors) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def _sub_agents(url: str, per_wave: int, until: float, counts: dict[str, int]) -> None:
    wave = 0
    while time.monotonic() < until:
        wave += 1
        async with Client(url) as client:
            handles = []
            for i in range(per_wave):
                res = await client.call_tool(
                    "spawn", {"task": f"Soak wave {wave}, task {i}: look up a river."}
                )
                if res.is_error:
                    counts["spawn_errors"] += 1
                    continue
                handles.append(res.structured_content["handle"])
            if handles:
                done = await client.call_tool("await", {"handles": handles, "mode": "all", "timeout": 300})
                for run in (done.structured_content or {}).get("runs", []):
                    counts[run["status"]] = counts.get(run["status"], 0) + 1


def _growth(series: list[float], every_s: float) -> dict[str, float]:
    window = max(1, int(60 / every_s))
    first, last = statistics.median(series[:window]), statistics.median(series[-window:])
    return {"first_min": round(first, 1), "last_min": round(last, 1), "growth": round(last - first, 1)}


def _plot(samples: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (rss, fds) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in SERVICES:
        t = [s["t"] for s in samples if name in s["services"]]
        rss.plot(t, [s["services"][name]["rss_mib"] for s in samples if name in s["services"]], label=name)
        fds.plot(t, [s["services"][name]["fds"] for s in samples if name in s["services"]], label=name)
    rss.set_ylabel("resident MiB")
    fds.set_ylabel("open fds")
    fds.set_xlabel("seconds")
    rss.legend(loc="upper left", fontsize=8)
    rss.set_title("luftpause bench soak: every service under steady load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(
    duration_s: float,
    every_s: float,
    agents: int,
    spawn: int,
    retention_s: float | None = None,
    store: str | None = None,
) -> dict[str, Any]:
    extra: dict[str, Any] = {"retention_s": retention_s} if retention_s is not None else {}
    if store is not None:
        extra["store"] = store
    with LoadedStack("luftpause-soak-", runtime_extra=extra) as stack:
        stack.own_loop_agents(agents, duration_s, "soak")
        counts: dict[str, int] = {"spawn_errors": 0}
        started = time.monotonic()
        samples: list[dict[str, Any]] = []

        async def drive() -> None:
            agents_task = asyncio.create_task(_sub_agents(stack.mcp, spawn, started + duration_s, counts))
            while time.monotonic() - started < duration_s:
                pids = stack.pids()
                entry: dict[str, Any] = {"t": round(time.monotonic() - started, 1), "services": {}}
                for name in SERVICES:
                    if name in pids:
                        rss, fds = _sample(pids[name])
                        entry["services"][name] = {"rss_mib": round(rss, 1), "fds": fds}
                samples.append(entry)
                line = "  ".join(
                    f"{n} {v['rss_mib']:.0f}M/{v['fds']}fd" for n, v in entry["services"].items()
                )
                print(f"\r[{entry['t']:>5.0f}/{duration_s:.0f} s] {line}", end="", flush=True)
                await asyncio.sleep(every_s)
            await agents_task

        asyncio.run(drive())
        print()
        after = stack.counts_after_load()
        growth = {
            name: {
                "rss_mib": _growth(
                    [s["services"][name]["rss_mib"] for s in samples if name in s["services"]], every_s
                ),
                "fds": _growth(
                    [s["services"][name]["fds"] for s in samples if name in s["services"]], every_s
                ),
            }
            for name in SERVICES
            if any(name in s["services"] for s in samples)
        }
        return {"duration_s": duration_s, "every_s": every_s, "agents": agents, "spawn": spawn,
                "retention_s": retention_s,
                "samples": samples, "growth": growth, "after": after, "sub_agents": counts,
                "restarts": stack.restarts()}  # fmt: skip


def _table(record: dict[str, Any]) -> str:
    lines = [
        "| service | RSS first min MiB | RSS last min MiB | growth MiB | fds first min | fds last min |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, g in record["growth"].items():
        r, f = g["rss_mib"], g["fds"]
        lines.append(
            f"| {name} | {r['first_min']} | {r['last_min']} | {r['growth']:+} | {f['first_min']} | {f['last_min']} |"
        )
    a = record["after"]
    lines.append("")
    lines.append(
        f"After the load: {a['in_flight']} in flight, {a['held']} held at the scheduler; sub-agents "
        f"{record['sub_agents']}; {record['restarts']} restarts by up."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--every-s", type=float, default=10.0)
    p.add_argument("--agents", type=int, default=8, help="own-loop agents per class")
    p.add_argument("--spawn", type=int, default=4, help="sub-agents per wave over MCP")
    p.add_argument(
        "--retention-s", type=float, help="the runtime's retention window (default: the config's, 120 s)"
    )
    p.add_argument(
        "--store",
        help='the runtime\'s run store: a PostgreSQL URL, or "postgresql" for a throwaway server '
        "(bench/postgres_server.py); default the config's, the journal file",
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if not Path("/proc/self/status").exists():
        raise SystemExit("luftpause bench soak reads /proc: it runs on Linux")
    with contextlib.ExitStack() as stack:
        store = args.store
        if store == "postgresql":
            from luftpause.bench.postgres_server import start_postgres

            server = start_postgres()
            stack.callback(server.remove)
            store = server.new_database()
        record = run(args.duration_s, args.every_s, args.agents, args.spawn, args.retention_s, store)
    if store is not None:
        record["store"] = "postgresql" if store.startswith("postgres") else store
    table = _table(record)
    print(table)
    if not args.no_record:
        path = results.write("soak", record, table)
        plot = _plot(record["samples"], path.with_suffix(".png"))
        print(f"\nrecord: {path}" + (f", plot: {plot}" if plot else ""))
    return 0 if record["after"] == {"in_flight": 0, "held": 0} else 1
