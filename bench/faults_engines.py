"""The engine drills: a replica that breaks off every turn, or streams garbage, beside a good one;
and an engine whose usage numbers are out of range.

Each scenario on processes of its own, on loopback: the scheduler and the dataplane with their
default settings (outlier ejection after 5 failed turns in a row, for `ejection_base_s` = 30 s
the first time: scheduler/outliers.py), a fake engine ("good") and the scripted engine
(fake_engine/scripted.py, "bad", first in the config) answering every chat request the
scenario's way:

- `breakoff`: a 200 stream of two chunks, then the connection closed mid-reply;
- `garbage`: a 200 stream of bytes that are not server-sent events.

`--clients` (8) agents send streamed turns back to back for `--seconds` (40), each turn a run of
its own, so nothing pins a turn to a replica; the scheduler's `/status` is read ten times a
second meanwhile. A turn succeeds when its reply is a 200 stream of JSON events ending in
`[DONE]`. The record has, per scenario: the turns and how they ended, the seconds from the
first turn until the bad replica was ejected, the turns it failed first, the share of turns
started after the ejection that succeeded (the acceptance: at least 95 %), and the ejections
seen. The window is longer than the first ejection, so the replica's return (and its next
ejection, for twice as long) is in it.

`usage`: the scripted engine alone, its replies carrying usage out of range (1e30, negative,
2^31, NaN and infinity; a stream's in its last chunk) and, as the control, in range, each case `--usage-turns` (10) times
streamed and as many not. After each reply the drill times how long its run stays
`generating` and its turn counted in flight at the scheduler (the acceptance: never past 5 s;
before issue 29 a count of 1e30 left the turn in flight until the 600 s turn timeout).

JSON and markdown under bench/results/.

    luftpause bench faults --drill engines [--seconds 40] [--clients 8] [--usage-turns 10] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import results, stack_config
from luftpause.bench.common import Processes, free_port, wait_healthy
from luftpause.fake_engine import scripted

MODEL = "drill-llama"
# Each broken replica's script (fake_engine/scripted.py).
SCRIPTS = {"breakoff": "break", "garbage": "garbage"}
# The usage cases: JSON text put verbatim as each reply's `usage`.
USAGE_CASES = {
    # In range: the control, what any healthy turn takes to be let go.
    "valid": '{"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}',
    "1e30": '{"prompt_tokens": 5, "completion_tokens": 1e30, "total_tokens": 1e30}',
    "negative": '{"prompt_tokens": -5, "completion_tokens": -1, "total_tokens": -6}',
    "2^31": '{"prompt_tokens": 2147483648, "completion_tokens": 2147483648, "total_tokens": 4294967296}',
    "nan-inf": '{"prompt_tokens": NaN, "completion_tokens": Infinity, "total_tokens": -Infinity}',
}
# The acceptance's bounds.
SUCCESS_AFTER_EJECTION = 0.95
STUCK_WITHIN_S = 5.0
# How often the scheduler's view is read.
WATCH_EVERY_S = 0.1
# The good engine's time scale: a 16-token turn in about 50 ms.
GOOD_TIME_SCALE = "0.1"


@dataclass
class _Stack:
    dataplane: str
    status: str


@contextmanager
def _stack(directory: Path, bad_args: list[str] | None, good: bool) -> Any:
    """The scheduler and the dataplane in front of the scripted engine ("bad", with `bad_args`)
    and, with `good`, a fake engine beside it; waits until every replica is probed healthy."""
    grpc, status, dataplane = free_port(), free_port(), free_port()
    engines = {"bad": free_port()} | ({"good": free_port()} if good else {})
    replicas = [stack_config.replica(name, port, [MODEL]) for name, port in engines.items()]
    config = stack_config.write(
        directory, stack_config.stack(grpc=grpc, status=status, dataplane=dataplane, replicas=replicas)
    )
    procs = Processes(directory)
    luftpause = [sys.executable, "-m", "luftpause"]
    try:
        procs.start(
            "bad", [sys.executable, scripted.__file__, "--port", str(engines["bad"]), *(bad_args or [])]
        )
        if good:
            procs.start("good", [*luftpause, "fake-engine", "--name", "good", "--model", MODEL,
                                 "--port", str(engines["good"]), "--time-scale", GOOD_TIME_SCALE])  # fmt: skip
        for port in engines.values():
            wait_healthy(f"http://127.0.0.1:{port}/health", procs)
        procs.start("scheduler", [*luftpause, "scheduler", "--config", str(config)])
        procs.start("dataplane", [*luftpause, "dataplane", "--config", str(config)])
        stack = _Stack(f"http://127.0.0.1:{dataplane}", f"http://127.0.0.1:{status}")
        wait_healthy(f"{stack.status}/status", procs)
        wait_healthy(f"{stack.dataplane}/health", procs)
        deadline = time.monotonic() + 60
        while (
            not _all_healthy(stack)
            or httpx.get(f"{stack.dataplane}/health").json()["scheduler"] != "connected"
        ):
            procs.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas were not all probed healthy within 60 s")
            time.sleep(0.2)
        yield stack
    finally:
        procs.stop()


def _all_healthy(stack: _Stack) -> bool:
    replicas = httpx.get(f"{stack.status}/status", timeout=5).json()["replicas"]
    return all(r["healthy"] for r in replicas)


def _served_whole(status: int, text: str) -> bool:
    """A 200 stream of JSON events ending in [DONE]."""
    if status != 200:
        return False
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    try:
        return all(isinstance(json.loads(e), dict) for e in events[:-1])
    except ValueError:
        return False


async def _agent(client: httpx.AsyncClient, url: str, until: float, turns: list[dict[str, Any]]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "drill"}],
        "stream": True,
        "max_tokens": 16,
    }
    while time.monotonic() < until:
        started = time.monotonic()
        headers = {"x-luftpause-run-id": f"drill-{uuid.uuid4().hex[:12]}"}
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            status, text, replica = r.status_code, r.text, r.headers.get("x-luftpause-replica", "")
        except httpx.HTTPError as e:
            status, text, replica = 0, type(e).__name__, ""
        turns.append({"started": started, "ended": time.monotonic(), "status": status, "replica": replica,
                      "ok": _served_whole(status, text)})  # fmt: skip


async def _watch(stack: _Stack, until: float, seen: list[tuple[float, dict[str, Any]]]) -> None:
    """The bad replica's ejection record, as `/status` says it, every WATCH_EVERY_S."""
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < until:
            try:
                replicas = (await client.get(f"{stack.status}/status")).json()["replicas"]
                bad = next(r for r in replicas if r["name"] == "bad")
                seen.append((time.monotonic(), {"in_service": bad["in_service"], **bad["ejection"]}))
            except (httpx.HTTPError, ValueError, KeyError, StopIteration):
                pass
            await asyncio.sleep(WATCH_EVERY_S)


def broken_replica(scenario: str, seconds: float, clients: int) -> dict[str, Any]:
    """One scenario of a broken replica beside a good one, as the record says it."""
    with tempfile.TemporaryDirectory(prefix=f"luftpause-faults-engines-{scenario}-") as tmp:
        with _stack(Path(tmp), ["--always", SCRIPTS[scenario]], good=True) as stack:
            turns: list[dict[str, Any]] = []
            seen: list[tuple[float, dict[str, Any]]] = []

            async def drill() -> float:
                start = time.monotonic()
                until = start + seconds
                async with httpx.AsyncClient(timeout=30) as client:
                    await asyncio.gather(
                        _watch(stack, until, seen),
                        *(_agent(client, stack.dataplane, until, turns) for _ in range(clients)),
                    )
                return start

            start = asyncio.run(drill())
    return summarise(scenario, start, turns, seen)


def summarise(
    scenario: str, start: float, turns: list[dict[str, Any]], seen: list[tuple[float, dict[str, Any]]]
) -> dict[str, Any]:
    """The scenario's figures from its turns and the ejection records watched (both timed on one clock)."""
    ejected_at = next((at for at, r in seen if r["ejected_for_s"] is not None), None)
    before = [t for t in turns if ejected_at is None or t["started"] < ejected_at]
    after = [t for t in turns if ejected_at is not None and t["started"] >= ejected_at]
    ejections = max((r["ejections"] for _, r in seen), default=0)
    statuses: dict[str, int] = {}
    for t in turns:
        key = "ok" if t["ok"] else f"{t['status'] or 'no answer'} from {t['replica'] or 'none'}"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "scenario": scenario,
        "script": SCRIPTS.get(scenario),
        "turns": len(turns),
        "succeeded": sum(t["ok"] for t in turns),
        "outcomes": statuses,
        "time_to_eject_s": None if ejected_at is None else round(ejected_at - start, 2),
        "failed_before_ejection": sum(not t["ok"] for t in before),
        "turns_after_ejection": len(after),
        "success_after_ejection": round(sum(t["ok"] for t in after) / len(after), 4) if after else None,
        "failed_after_ejection": sum(not t["ok"] for t in after),
        "ejections": ejections,
        "turn_ms_p50": round(statistics.median((t["ended"] - t["started"]) * 1000 for t in turns), 1)
        if turns
        else None,
    }


async def _usage_turn(
    client: httpx.AsyncClient, stack: _Stack, usage_raw: str, stream: bool
) -> dict[str, Any]:
    run_id = f"usage-{uuid.uuid4().hex[:12]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "stream": stream,
            "max_tokens": 4, "script": "reply", "usage_raw": usage_raw}  # fmt: skip
    r = await client.post(
        f"{stack.dataplane}/v1/chat/completions", json=body, headers={"x-luftpause-run-id": run_id}
    )
    answered = time.monotonic()
    # How long the run stays generating and its turn in flight, once the client has the reply.
    while True:
        run = await client.get(f"{stack.status}/status/runs/{run_id}")
        replicas = (await client.get(f"{stack.status}/status")).json()["replicas"]
        generating = run.status_code == 200 and run.json()["phase"] == "generating"
        stuck_s = time.monotonic() - answered
        if not generating and sum(x["in_flight"] for x in replicas) == 0:
            break
        if stuck_s > 2 * STUCK_WITHIN_S:
            break
        await asyncio.sleep(0.02)
    return {"status": r.status_code, "stuck_s": stuck_s, "stream": stream}


def usage_overflow(turns: int) -> dict[str, Any]:
    """Each usage case `turns` times streamed and as many not, one turn at a time."""
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="luftpause-faults-engines-usage-") as tmp:
        with _stack(Path(tmp), None, good=False) as stack:

            async def drill() -> None:
                async with httpx.AsyncClient(timeout=30) as client:
                    for case, raw in USAGE_CASES.items():
                        done = [
                            await _usage_turn(client, stack, raw, stream)
                            for stream in (True, False)
                            for _ in range(turns)
                        ]
                        cases.append({
                            "case": case,
                            "usage": raw,
                            "turns": len(done),
                            "statuses": sorted({d["status"] for d in done}),
                            "stuck_s_max": round(max(d["stuck_s"] for d in done), 3),
                            "stuck_past_5s": sum(d["stuck_s"] > STUCK_WITHIN_S for d in done),
                        })  # fmt: skip
                        c = cases[-1]
                        print(f"usage {case}: {c['turns']} turns, answered {c['statuses']}, "
                              f"longest in flight after the reply {c['stuck_s_max']} s", flush=True)  # fmt: skip

            asyncio.run(drill())
    return {"turns_per_case": 2 * turns, "cases": cases,
            "no_turn_stuck_past_5s": all(c["stuck_past_5s"] == 0 for c in cases)}  # fmt: skip


def run(seconds: float, clients: int, usage_turns: int) -> dict[str, Any]:
    scenarios = []
    for scenario in SCRIPTS:
        s = broken_replica(scenario, seconds, clients)
        scenarios.append(s)
        print(f"{scenario}: {s['turns']} turns, {s['succeeded']} succeeded; ejected after {s['time_to_eject_s']} s "
              f"({s['failed_before_ejection']} failed first); after it {s['success_after_ejection']} of "
              f"{s['turns_after_ejection']} succeeded; {s['ejections']} ejections", flush=True)  # fmt: skip
    usage = usage_overflow(usage_turns)
    ok = usage["no_turn_stuck_past_5s"] and all(
        s["success_after_ejection"] is not None and s["success_after_ejection"] >= SUCCESS_AFTER_EJECTION
        for s in scenarios
    )
    return {
        "seconds": seconds,
        "clients": clients,
        "broken_replica": scenarios,
        "usage": usage,
        "acceptance_met": ok,
    }


def table(record: dict[str, Any]) -> str:
    """The record as markdown: a row per broken-replica scenario, then one per usage case."""
    lines = [
        f"{record['clients']} agents, streamed turns back to back for {record['seconds']} s, each turn a new run; "
        "a broken replica (`bad`) beside a good one, default ejection settings.",
        "",
        "| scenario | turns | succeeded | time to eject s | failed before | after ejection: succeeded of turns "
        "| failed after | ejections | turn p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in record["broken_replica"]:
        share = results.cell(
            None if s["success_after_ejection"] is None else 100 * s["success_after_ejection"]
        )
        lines.append(
            f"| {s['scenario']} (`{s['script']}`) | {s['turns']} | {s['succeeded']} | {results.cell(s['time_to_eject_s'])} "
            f"| {s['failed_before_ejection']} | {share} % of {s['turns_after_ejection']} | {s['failed_after_ejection']} "
            f"| {s['ejections']} | {results.cell(s['turn_ms_p50'])} |"
        )
    usage = record["usage"]
    lines += [
        "",
        f"Usage out of range, {usage['turns_per_case']} turns a case (half streamed), the scripted engine alone:",
        "",
        "| usage | client saw | longest in flight after the reply s | stuck past 5 s |",
        "|---|---|---:|---:|",
    ]
    for c in usage["cases"]:
        lines.append(
            f"| `{c['usage']}` | {', '.join(map(str, c['statuses']))} | {c['stuck_s_max']} | {c['stuck_past_5s']} |"
        )
    lines += [
        "",
        f"Acceptance (≥ 95 % after ejection, no turn stuck past 5 s): {'met' if record['acceptance_met'] else 'NOT met'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="luftpause bench faults --drill engines", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seconds", type=float, default=40.0, help="how long each broken-replica scenario runs")
    p.add_argument("--clients", type=int, default=8, help="agents sending turns at once")
    p.add_argument(
        "--usage-turns", type=int, default=10, help="turns per usage case and way (streamed, whole)"
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.usage_turns < 1:
        p.error("--seconds must be above 0, --clients and --usage-turns at least 1")
    record = run(args.seconds, args.clients, args.usage_turns)
    text = table(record)
    print(text)
    if not args.no_record:
        print(f"\nrecord: {results.write('faults-engines', record, text)}")
    return 0 if record["acceptance_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
