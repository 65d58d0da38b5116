"""Fan-out: 16 sub-agents spawned at once and awaited in one call, against the same 16 one at a time.

Runs against a stack that is already up (`luftpause up`), over MCP with the official client, the
way a harness would. Both arms use the same task texts, so the fake engine gives every run the
same number of tool calls in both; the arms alternate when repeated, so drift on the machine
hits both. Prints the time for all runs per arm and the ratio, and writes the record under
bench/results/.

    luftpause bench fanout [--runtime http://127.0.0.1:7000/mcp] [--runs 16] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from typing import Any

from mcp import Client

from luftpause.bench import results
from luftpause.loadgen.subagents import collect, spawn


def _tasks(n: int) -> list[str]:
    return [
        f"Research river number {i}: its length, its mouth and the countries it crosses." for i in range(n)
    ]


async def sequential(client: Client, tasks: list[str]) -> tuple[float, list[dict[str, Any]]]:
    started = time.perf_counter()
    done = []
    for task in tasks:
        done += await collect(client, [await spawn(client, task)])
    return time.perf_counter() - started, done


async def fan_out(client: Client, tasks: list[str]) -> tuple[float, list[dict[str, Any]]]:
    started = time.perf_counter()
    handles = [await spawn(client, task) for task in tasks]
    done = await collect(client, handles)
    return time.perf_counter() - started, done


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "finished": sum(r["status"] == "finished" for r in runs),
        "tool_calls": sum(r["toolCalls"] for r in runs),
        "failed_tool_calls": sum(r["failedToolCalls"] for r in runs),
    }


async def run(runtime: str, n: int, repeats: int) -> dict[str, Any]:
    tasks = _tasks(n)
    arms: dict[str, list[float]] = {"sequential": [], "fan-out": []}
    details: list[dict[str, Any]] = []
    async with Client(runtime) as client:
        for rep in range(repeats):
            order = [("sequential", sequential), ("fan-out", fan_out)]
            if rep % 2:
                order.reverse()
            for name, arm in order:
                seconds, runs = await arm(client, tasks)
                arms[name].append(seconds)
                details.append({"repeat": rep, "arm": name, "seconds": round(seconds, 3), **_summary(runs)})
                print(
                    f"  repeat {rep + 1}/{repeats}  {name:<10} {seconds:7.2f} s  {_summary(runs)}", flush=True
                )
    seq, fan = statistics.median(arms["sequential"]), statistics.median(arms["fan-out"])
    return {
        "runs": n,
        "repeats": repeats,
        "runtime": runtime,
        "sequential_s": arms["sequential"],
        "fan_out_s": arms["fan-out"],
        "speedup_median": round(seq / fan, 2),
        "details": details,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench fanout", description=__doc__.splitlines()[0])
    p.add_argument("--runtime", default="http://127.0.0.1:7000/mcp", help="the runtime's MCP URL")
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    # The MCP client logs every HTTP request at INFO; a benchmark's output is its figures.
    for noisy in ("httpx", "httpx2", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(f"fan-out benchmark: {args.runs} sub-agents, {args.repeats} repeat(s), against {args.runtime}")
    record = asyncio.run(run(args.runtime, args.runs, args.repeats))
    seq = statistics.median(record["sequential_s"])
    fan = statistics.median(record["fan_out_s"])
    table = "\n".join(
        [
            f"| {args.runs} sub-agents | time for all (median of {args.repeats}) | vs sequential |",
            "|---|---|---|",
            f"| one at a time (spawn, await, next) | {seq:.1f} s | - |",
            f"| spawn all, one await | {fan:.1f} s | {record['speedup_median']:.1f}x |",
        ]
    )
    path = results.write("fanout", record, table)
    print(table)
    print(f"record: {path}")
    return 0
