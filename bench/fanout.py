"""Fan-out: 16 sub-agents spawned at once and awaited in one call, against the same 16 one at a time.

Over MCP with the official client, the way a harness would. Two ways to run it:

- against a stack that is already up (`luftpause up`, `--runtime URL`): the arms `sequential`
  and `fan-out`, short river tasks;
- `--start`: it starts its own stacks (`bench.stack`: fake engines with the calibrated KV pool,
  fake-mcp with every tool call taking 2 s, the runtime), one per arm so that no arm's engines
  hold another arm's prefixes, and runs three arms: `sequential` (spawn, await, next) and
  `luftpause` (spawn all, one await) through luftpause, and `router` (spawn all, one await) with
  the runtime straight to the real SGLang router (cache-aware). Tasks carry the flood's contexts (`--context-chars`, 10000
  by default: about 2.8k prompt tokens, as the description's fan-out).

Every arm gets the same task texts, so the fake engine gives each run the same tool calls in all
of them; arms rotate their order from repeat to repeat so that drift on the machine hits each.
Each arm's time is checked for CPU saturation as the fidelity harness does (`--start` only); a
saturated one is reported and not counted. Prints the time for all runs per arm and the ratios
(with `--start` also how evenly each arm's tokens fell on the two engines, from their counters),
and writes the record (and with `--start` a PNG) under bench/results/.

    luftpause bench fanout [--runtime http://127.0.0.1:7000/mcp] [--runs 16] [--repeats 1]
    luftpause bench fanout --start [--runs 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from mcp import Client

from luftpause.bench import results
from luftpause.bench.common import spread, spread_cell
from luftpause.loadgen.subagents import collect, fan_out_summary, spawn, tasks


def _river_tasks(n: int) -> list[dict[str, Any]]:
    return [
        {"task": f"Research river number {i}: its length, its mouth and the countries it crosses."}
        for i in range(n)
    ]


async def sequential(client: Client, work: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    started = time.perf_counter()
    done = []
    for arguments in work:
        done += await collect(client, [await spawn(client, **arguments)])
    return time.perf_counter() - started, done


async def fan_out(client: Client, work: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    started = time.perf_counter()
    handles = [await spawn(client, **arguments) for arguments in work]
    done = await collect(client, handles)
    return time.perf_counter() - started, done


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = fan_out_summary(runs, 0.0)
    return {k: summary[k] for k in ("finished", "tool_calls", "failed_tool_calls")}


async def run(runtime: str, n: int, repeats: int) -> dict[str, Any]:
    work = _river_tasks(n)
    arms: dict[str, list[float]] = {"sequential": [], "fan-out": []}
    details: list[dict[str, Any]] = []
    async with Client(runtime) as client:
        for rep in range(repeats):
            order = [("sequential", sequential), ("fan-out", fan_out)]
            if rep % 2:
                order.reverse()
            for name, arm in order:
                seconds, runs = await arm(client, work)
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


# -- --start: its own stacks, and the router arm --

STARTED_ARMS = ("sequential", "luftpause", "router")
# Each arm runs on a stack of its own (so that an arm's engines carry only that arm's own earlier
# repeats in their prefix caches: the one-at-a-time arm, run on the fan-out's stack, left every
# task cached on one engine, which drew that engine more of the fan-out's new runs; the router's
# engines never had that); what front each arm's stack has, and how the arm drives it.
STACK_FRONT = {"sequential": "luftpause", "luftpause": "luftpause", "router": "sglang-cache-aware"}
ARM_DRIVE = {"sequential": sequential, "luftpause": fan_out, "router": fan_out}
ROUTER_TOLERANCE = 0.10
MIN_SPEEDUP = 5.0


def run_started(n: int, repeats: int, context_chars: int, logs: Path) -> dict[str, Any]:
    from luftpause.bench import stack as stacks
    from luftpause.fake_engine.params import EngineParams

    work = tasks(n, context_chars, seed="fanout")
    rows: list[dict[str, Any]] = []
    with ExitStack() as up:
        # Every stack stays up for the whole run; those not measured idle (health probes only).
        started = {}
        for arm, front in STACK_FRONT.items():
            (logs / arm).mkdir()
            started[arm] = up.enter_context(
                stacks.stack(front, logs / arm, kv_pool_tokens=EngineParams().kv_pool_tokens)
            )
        for rep in range(repeats):
            order = list(STARTED_ARMS[rep % 3 :] + STARTED_ARMS[: rep % 3])
            for arm in order:
                s = started[arm]
                window = stacks.CpuWindow(s)

                async def measure(url: str, arm: str = arm) -> tuple[float, list[dict[str, Any]]]:
                    async with Client(url) as client:
                        return await ARM_DRIVE[arm](client, work)

                before = stacks.generation_tokens(s.engine_urls)
                seconds, runs = asyncio.run(measure(s.runtime_url))
                cpu = window.close()
                generated = [
                    b - a for a, b in zip(before, stacks.generation_tokens(s.engine_urls), strict=True)
                ]
                row = {
                    "repeat": rep,
                    "arm": arm,
                    "seconds": round(seconds, 3),
                    **_summary(runs),
                    # How evenly the arm's work fell on the engines: the busier one's share of the
                    # tokens generated (0.5: even). Runs stay on their engine, so an uneven split
                    # makes the busier engine's decode steps, and its runs, slower.
                    "busier_engine_share": round(max(generated) / sum(generated), 3)
                    if sum(generated)
                    else None,
                    **cpu,
                    "counts": not cpu["saturated"] and all(r["status"] == "finished" for r in runs),
                }
                rows.append(row)
                print(
                    f"  repeat {rep + 1}/{repeats}  {arm:<10} {seconds:7.2f} s  {_summary(runs)}  "
                    f"busier engine {_share(row['busier_engine_share'])} of tokens  CPU {cpu['cpu_busy']:.0%}"
                    + ("" if row["counts"] else "  (does not count)"),
                    flush=True,
                )
    times = {arm: [r["seconds"] for r in rows if r["arm"] == arm and r["counts"]] for arm in STARTED_ARMS}
    med = {arm: statistics.median(v) if v else None for arm, v in times.items()}
    busier = {
        arm: [
            r["busier_engine_share"]
            for r in rows
            if r["arm"] == arm and r["counts"] and r["busier_engine_share"]
        ]
        for arm in STARTED_ARMS
    }
    ratios = started_ratios(rows)
    return {
        "runs": n,
        "repeats": repeats,
        "context_chars": context_chars,
        "rows": rows,
        "times_s": times,
        "median_s": med,
        "busier_engine_share": busier,
        "ratios": ratios,
    }


def started_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fan-out's ratios: each taken within a repeat, the arms side by side, then its median
    (and spread) over the repeats where both arms count."""
    ratios: dict[str, Any] = {}
    over_router = _per_repeat(rows, "luftpause", "router")
    if over_router:
        ratios["luftpause_over_router_time"] = round(statistics.median(over_router), 3)
        ratios["luftpause_over_router_time_spread"] = spread(over_router)
        ratios["within_router_tolerance"] = abs(ratios["luftpause_over_router_time"] - 1) <= ROUTER_TOLERANCE
    speedup = _per_repeat(rows, "sequential", "luftpause")
    if speedup:
        ratios["speedup_over_sequential"] = round(statistics.median(speedup), 2)
        ratios["speedup_over_sequential_spread"] = spread(speedup)
        ratios["speedup_met"] = ratios["speedup_over_sequential"] >= MIN_SPEEDUP
    router_speedup = _per_repeat(rows, "sequential", "router")
    if router_speedup:
        ratios["router_speedup_over_sequential"] = round(statistics.median(router_speedup), 2)
    return ratios


def _per_repeat(rows: list[dict[str, Any]], top: str, bottom: str) -> list[float]:
    """`top`'s time over `bottom`'s in each repeat where both count."""
    by_repeat: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["counts"]:
            by_repeat.setdefault(row["repeat"], {})[row["arm"]] = row["seconds"]
    return [
        t[top] / t[bottom] for _, t in sorted(by_repeat.items()) if top in t and bottom in t and t[bottom]
    ]


def _range(s: dict[str, Any] | None) -> str:
    """A ratio's spread over the repeats, as the verdict line gives it."""
    if not s or s.get("low") is None:
        return "per repeat: -"
    return f"per repeat {s['low']:.2f}-{s['high']:.2f}x"


def started_table(record: dict[str, Any]) -> str:
    ratios = record["ratios"]
    labels = {
        "sequential": "one at a time through luftpause (spawn, await, next)",
        "luftpause": "spawned together through luftpause, one await",
        "router": "spawned together, runtime straight to the SGLang router, one await",
    }
    lines = [
        f"| {record['runs']} sub-agents | time for all, median (range) of the repeats that count | "
        "repeats counted | vs one at a time | busier engine's share of the tokens |",
        "|---|---|---|---|---|",
    ]
    for arm in STARTED_ARMS:
        values = record["times_s"][arm]
        per_repeat = [] if arm == "sequential" else _per_repeat(record["rows"], "sequential", arm)
        speedup = f"{statistics.median(per_repeat):.1f}x" if per_repeat else "-"
        shares = record.get("busier_engine_share", {}).get(arm) or []
        share = spread(shares)
        share_cell = (
            "-"
            if share["median"] is None
            else f"{share['median']:.0%} ({share['low']:.0%}-{share['high']:.0%})"
        )
        lines.append(
            f"| {labels[arm]} | {spread_cell(spread(values))} s | {len(values)} of {record['repeats']} | "
            f"{speedup} | {share_cell} |"
        )
    verdicts = []
    if "luftpause_over_router_time" in ratios:
        verdicts.append(
            f"luftpause takes {ratios['luftpause_over_router_time']:.2f}x the router's time "
            f"({_range(ratios.get('luftpause_over_router_time_spread'))}; "
            f"{'within' if ratios['within_router_tolerance'] else 'not within'} {ROUTER_TOLERANCE:.0%})"
        )
    if "speedup_over_sequential" in ratios:
        verdicts.append(
            f"{ratios['speedup_over_sequential']:.1f}x faster than one at a time "
            f"({_range(ratios.get('speedup_over_sequential_spread'))}; "
            f"{'met' if ratios['speedup_met'] else 'not met'}: at least {MIN_SPEEDUP:g}x)"
        )
    if verdicts:
        lines += ["", "; ".join(verdicts) + "."]
    return "\n".join(lines)


def _share(share: float | None) -> str:
    """A share of the tokens as a percentage; "-" when the engines generated none (every run failed)."""
    return "-" if share is None else f"{share:.0%}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench fanout", description=__doc__.splitlines()[0])
    p.add_argument("--runtime", default="http://127.0.0.1:7000/mcp", help="the runtime's MCP URL")
    p.add_argument("--start", action="store_true", help="start its own stacks and add the router arm")
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--context-chars", type=int, default=10000, help="with --start: each task's context")
    args = p.parse_args(argv)
    # The MCP client logs every HTTP request at INFO; a benchmark's output is its figures.
    for noisy in ("httpx", "httpx2", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.start:
        print(
            f"fan-out benchmark: {args.runs} sub-agents, {args.repeats} repeat(s), arms {', '.join(STARTED_ARMS)}"
        )
        logs = Path(tempfile.mkdtemp(prefix="luftpause-fanout-"))
        record = run_started(args.runs, args.repeats, args.context_chars, logs)
        shutil.rmtree(logs, ignore_errors=True)
        table = started_table(record)
        print(table)
        results.write_with_bars(
            "fanout-start",
            record,
            table,
            f"Fan-out of {args.runs} sub-agents over MCP: time for all (median, range, each repeat)",
            "seconds",
            {arm: record["times_s"][arm] for arm in STARTED_ARMS},
        )
        return 0
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
