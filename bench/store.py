"""The run store's cost: the journal file and PostgreSQL side by side (`[runtime] store`).

For each store, in this process, with no model and no HTTP (what is measured is the store):

- spawns a second: `--spawners` callers spawn runs through the runtime's registry
  (`Runs.spawn_durably`: acknowledged once the store has the run, as the spawn tool is) for
  `--seconds`; the runs' loops wait, and are stopped at the end without ending their runs;
- journal-write latency: `--writers` runs each journal a tool round (a `round` record of about
  1 KB: an assistant message with one tool call, and its answer) and wait until the store has it,
  again and again for `--seconds`: each write from its append until it is durable, as a run's
  step waits before its results go to the model.

The file store's journal lives in a temporary folder on this machine's disk (each write fsynced,
writes of one moment committed together); PostgreSQL is `--url`, else a throwaway server
(bench/postgres_server.py) on this machine, in a fresh database for each measurement (with
`--url`, that one database, its tables created by the store as a runtime's are). Prints a
table and writes the record under bench/results/ (store-<time>.json and .md).

    luftpause bench store [--seconds 5] [--spawners 8] [--writers 8] [--url postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from luftpause.bench import results
from luftpause.config import RuntimeSettings
from luftpause.runtime.journal import Journal, new_counters
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.store import RunStore

# A tool round as a sub-agent journals one: about 1 KB.
ROUND: list[dict[str, Any]] = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"query": "' + "q" * 100 + '"}'},
            }
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_0", "content": "fact " * 160},
]


def _ms(values: list[float]) -> dict[str, float]:
    """p50 and p99 of durations in seconds, in milliseconds."""
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50_ms": round(cuts[49] * 1000, 3), "p99_ms": round(cuts[98] * 1000, 3)}


async def spawns(store: RunStore, seconds: float, spawners: int) -> dict[str, Any]:
    """Runs spawned through the registry for `seconds` by `spawners` callers at once."""
    hold = asyncio.Event()

    async def idle(runs: Runs, run: Run) -> None:
        await hold.wait()

    async def no_end(handle: str) -> None:
        return None

    settings = RuntimeSettings(max_running_per_caller=10**9)
    runs = Runs(store, idle, no_end, settings=settings)
    took: list[float] = []
    deadline = time.perf_counter() + seconds

    async def spawner(i: int) -> None:
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            await runs.spawn_durably(RunSpec(task=f"bench {i}", model="m"), f"caller-{i}")
            took.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(spawner(i) for i in range(spawners)))
    elapsed = time.perf_counter() - began
    await runs.shutdown()
    return {"spawns": len(took), "spawns_per_s": round(len(took) / elapsed, 1), **_ms(took)}


async def writes(store: RunStore, seconds: float, writers: int) -> dict[str, Any]:
    """Tool rounds journaled for `seconds` by `writers` runs at once, each waited for."""
    handles = [f"run-bench-{i}" for i in range(writers)]
    for h in handles:
        store.spawned(h, RunSpec(task="bench", model="m").model_dump(), None)
    await store.durable()
    took: list[float] = []
    deadline = time.perf_counter() + seconds

    async def writer(handle: str) -> None:
        counters = new_counters()
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            store.round(handle, ROUND, counters)
            await store.durable()
            took.append(time.perf_counter() - began)

    await asyncio.gather(*(writer(h) for h in handles))
    return {"writes": len(took), "writes_per_s": round(len(took) / seconds, 1), **_ms(took)}


# One of the two measurements: a store, how long, how many at once.
Measurement = Callable[[RunStore, float, int], Coroutine[Any, Any, dict[str, Any]]]


@contextlib.contextmanager
def _postgres(url: str | None) -> Iterator[Callable[[], str]]:
    """A fresh database's URL each call: on `url`'s server, or on a throwaway one."""
    if url is not None:
        yield lambda: url
        return
    from luftpause.bench.postgres_server import start_postgres

    server = start_postgres()
    try:
        yield server.new_database
    finally:
        server.remove()


def measure(seconds: float, spawners: int, writers: int, url: str | None) -> dict[str, dict[str, Any]]:
    """Both measurements on both stores, each on a fresh store."""
    from luftpause.runtime.postgres_store import PostgresStore

    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="luftpause-store-") as tmp, _postgres(url) as database:
        opens: dict[str, Callable[[str], RunStore]] = {
            "file": lambda what: Journal(Path(tmp) / what),
            "postgresql": lambda what: PostgresStore(database(), owner="bench"),
        }
        for name, open_store in opens.items():
            row: dict[str, Any] = {}
            measurements: tuple[tuple[str, Measurement, int], ...] = (
                ("spawn", spawns, spawners),
                ("write", writes, writers),
            )
            for what, run, count in measurements:
                store = open_store(what)
                try:
                    got = asyncio.run(run(store, seconds, count))
                finally:
                    store.close()
                row.update({f"{what}_{k}" if not k.startswith(what) else k: v for k, v in got.items()})
            out[name] = row
    return out


def table(rows: dict[str, dict[str, Any]], spawners: int, writers: int) -> str:
    lines = [
        f"| store | spawns/s ({spawners} callers) | spawn p50 ms | spawn p99 ms | "
        f"journal writes/s ({writers} runs) | write p50 ms | write p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['spawns_per_s']:,} | {r['spawn_p50_ms']} | {r['spawn_p99_ms']} | "
            f"{r['writes_per_s']:,} | {r['write_p50_ms']} | {r['write_p99_ms']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench store", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="how long each measurement runs, per store")
    p.add_argument("--spawners", type=int, default=8, help="callers spawning at once")
    p.add_argument("--writers", type=int, default=8, help="runs journaling tool rounds at once")
    p.add_argument(
        "--url", default=None, help="a PostgreSQL database to measure (default: a throwaway server)"
    )
    p.add_argument("--no-record", action="store_true", help="print only; write nothing under bench/results/")
    p.add_argument("--out", type=Path, default=results.RESULTS_DIR, help="where the record goes")
    args = p.parse_args(argv)
    logging.getLogger("luftpause.runtime").setLevel(logging.WARNING)
    rows = measure(args.seconds, args.spawners, args.writers, args.url)
    shown = table(rows, args.spawners, args.writers)
    print(shown)
    if not args.no_record:
        record = {"seconds": args.seconds, "spawners": args.spawners, "writers": args.writers, "stores": rows}
        print(f"\nrecord: {results.write('store', record, shown, args.out)}")
    return 0
