"""The scheduler core's cost: decisions per second with many held turns, and how it grows with them.

A saturated pool, driven in-process through `decide` with no I/O: four replicas whose engines
each run `--slots` of our turns and hold their lookahead of them waiting (admission.py), so
everything beyond is held. 1,000 runs of 100 callers (every fifth run batch) keep `--held` turns waiting.
Each cycle then does what a busy stack does: the oldest running turn completes (every other one
in tool calls, so runs pause); its engine starts the next of ours waiting there, whose first
token makes room for the next held turn that may go there, which is placed and reported
started; new turns arrive until the held count is back where it was. A probe every 100 events and a clock tick every 1,000 go through as well.
Every `decide` call counts as one decision, whatever its event.

The run is repeated for each held count in `--sizes` (default 100, 1,000, 10,000); the growth
column is the time per decision relative to the smallest size, beside log2(n) relative to the
same, which is what an O(log n) core should stay within.

Decisions a second depend on the machine and on what else it runs: the same core has measured
2.6 times faster on one day than on another here. `--instructions` also counts what a decision
costs in instructions, which they do not change: each size is run twice more under valgrind's
callgrind, for `INSTRUCTION_EVENTS` decisions each, and the difference of the two counts over the
difference of the decisions is what the decisions cost, the setup (the same in both) dropping
out. The hash seed is fixed for those runs (`PYTHONHASHSEED=0`): the maps' layout follows the
strings' hashes, and with random seeds the same core counted up to 6 % apart. It needs valgrind
on PATH (Debian: `apt-get install valgrind`) and takes about a minute a size at 10,000.

    luftpause bench scheduler_core [--sizes 100,1000,10000] [--events 60000] [--runs 1000] [--instructions]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from luftpause.bench import results
from luftpause.scheduler.actions import Place
from luftpause.scheduler.core import decide
from luftpause.scheduler.events import (
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    Tick,
    TurnArrived,
    TurnCompleted,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, ServiceClass, State

REPLICAS = ("r0", "r1", "r2", "r3")
MODEL = "m"


class _Workload:
    """A saturated pool and the bookkeeping a dataplane would keep to drive it.

    Each replica's engine runs `slots` of our turns (confirmed by their first tokens) and has
    its lookahead of them waiting unconfirmed; everything beyond is held.
    """

    def __init__(self, held: int, runs: int, callers: int, slots: int) -> None:
        self.runs, self.callers, self.slots, self.target = runs, callers, slots, held
        self.now = 0.0
        self.decisions = 0
        self.next_turn = 0
        self.running: deque[tuple[str, str, str]] = deque()  # (turn, run, replica), oldest first
        self.waiting: dict[str, deque[tuple[str, str]]] = {n: deque() for n in REPLICAS}
        self.placed = 0
        self.state = State()
        self._feed(
            PoolConfigured(tuple(ReplicaSpec(n, f"http://{n}", Kind.GENERATIVE, (MODEL,)) for n in REPLICAS))
        )
        for name in REPLICAS:
            self._probe(name)
        lookahead = self.state.replicas[REPLICAS[0]].lookahead
        while sum(len(w) for w in self.waiting.values()) < lookahead * len(REPLICAS) or self.held() < held:
            self._arrive()
            for name in REPLICAS:
                # The engine starts what it has room for: a first token each.
                while self.waiting[name] and sum(1 for r in self.running if r[2] == name) < slots:
                    self._start_next(name)
        assert len(self.running) == slots * len(REPLICAS), "the pool should be full"
        assert self.held() == held, "the rest should be held"

    def _feed(self, event: Any) -> None:
        self.state, actions = decide(self.state, event)
        self.decisions += 1
        for action in actions:
            if isinstance(action, Place):
                self.placed += 1
                self.waiting[action.replica].append((action.turn_id, action.run_id))
                self.state, _ = decide(self.state, TurnStarted(action.turn_id, action.run_id, self.now, True))
                self.decisions += 1

    def _start_next(self, name: str) -> None:
        turn, run = self.waiting[name].popleft()
        self.running.append((turn, run, name))
        self._feed(FirstToken(turn, run, self.now))

    def _probe(self, name: str) -> None:
        # The engine runs our turns and queues our lookahead of them, as under load.
        waiting = len(self.waiting[name])
        self._feed(ReplicaProbed(name, True, self.slots, waiting, self.now))

    def _arrive(self) -> None:
        n = self.next_turn
        self.next_turn += 1
        run = n % self.runs
        cls = ServiceClass.BATCH if run % 5 == 0 else ServiceClass.INTERACTIVE
        self._feed(
            TurnArrived(
                f"t{n}", f"run{run}", cls, f"caller{run % self.callers}", MODEL, Kind.GENERATIVE, self.now
            )
        )

    def held(self) -> int:
        return len(self.state.turns) - len(self.running) - sum(len(w) for w in self.waiting.values())

    def cycle(self, i: int) -> None:
        """The oldest turn running completes; its engine starts the next of ours waiting there,
        whose first token makes room for a held one; arrivals top up."""
        self.now += 0.001
        if self.running:
            turn, run, name = self.running.popleft()
            tool_calls = i % 2 == 0
            reason, ids = ("tool_calls", ("call",)) if tool_calls else ("stop", ())
            self._feed(TurnCompleted(turn, run, reason, 500, 50, ids, self.now))
            if self.waiting[name]:
                self._start_next(name)
        while self.held() < self.target:
            self._arrive()
        if i % 20 == 0:
            self._probe(REPLICAS[(i // 20) % len(REPLICAS)])
        if i % 200 == 0:
            self._feed(Tick(self.now))


def measure(held: int, events: int, runs: int, callers: int, slots: int) -> dict[str, Any]:
    work = _Workload(held, runs, callers, slots)
    gc.collect()
    start_decisions = work.decisions
    started = time.perf_counter()
    i = 0
    while work.decisions - start_decisions < events:
        work.cycle(i)
        i += 1
    elapsed = time.perf_counter() - started
    decisions = work.decisions - start_decisions
    assert work.held() == held, f"held count drifted to {work.held()}"
    return {
        "held": held,
        "runs": len(work.state.runs),
        "in_flight": len(work.running) + sum(len(w) for w in work.waiting.values()),
        "decisions": decisions,
        "seconds": round(elapsed, 4),
        "decisions_per_s": round(decisions / elapsed),
        "us_per_decision": round(elapsed / decisions * 1e6, 2),
    }


# Decisions each size is run for under callgrind, once each (see the module docstring).
INSTRUCTION_EVENTS = (2_000, 6_000)


def count_instructions(held: int, events: int, runs: int, callers: int, slots: int) -> tuple[int, int]:
    """(instructions, decisions) of one run of this benchmark at `held` turns for `events`
    decisions, under callgrind with the hash seed fixed; the instructions include the setup."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit(
            "bench scheduler_core --instructions: valgrind is not on PATH (Debian: apt-get install valgrind)"
        )
    with tempfile.TemporaryDirectory(prefix="luftpause-callgrind-") as tmp:
        command = [
            valgrind, "--tool=callgrind", f"--callgrind-out-file={Path(tmp) / 'out'}",
            sys.executable, "-m", "luftpause.bench.scheduler_core", "--sizes", str(held), "--events", str(events),
            "--runs", str(runs), "--callers", str(callers), "--slots", str(slots), "--no-record",
        ]  # fmt: skip
        done = subprocess.run(
            command, env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=False
        )
    counted = re.search(r"Collected : (\d+)", done.stderr)
    decided = re.search(r"^\| [\d,]+ \| [\d,]+ \| ([\d,]+) \|", done.stdout, re.MULTILINE)
    if done.returncode != 0 or counted is None or decided is None:
        raise RuntimeError(f"callgrind run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return int(counted.group(1)), int(decided.group(1).replace(",", ""))


def instructions_per_decision(
    held: int, runs: int, callers: int, slots: int, events: tuple[int, int] = INSTRUCTION_EVENTS
) -> float:
    """What one decision costs in instructions at `held` turns: two callgrind runs' counts apart,
    over their decisions apart."""
    (low, low_decisions), (high, high_decisions) = (
        count_instructions(held, n, runs, callers, slots) for n in events
    )
    return (high - low) / (high_decisions - low_decisions)


def _table(rows: list[dict[str, Any]]) -> str:
    counted = all("instructions_per_decision" in r for r in rows)
    lines = [
        "| held turns | runs | decisions | decisions/s | µs/decision | growth | log2 n growth |"
        + (" instructions/decision |" if counted else ""),
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if counted else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['held']:,} | {r['runs']:,} | {r['decisions']:,} | {r['decisions_per_s']:,} | "
            f"{r['us_per_decision']} | {r['growth']:.2f}x | {r['log_growth']:.2f}x |"
            + (f" {r['instructions_per_decision']:,.0f} |" if counted else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench scheduler_core", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000,10000", help="held-turn counts, comma-separated")
    p.add_argument("--events", type=int, default=60_000, help="decisions measured per size")
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--callers", type=int, default=100)
    p.add_argument("--slots", type=int, default=32, help="turns each replica's engine runs")
    p.add_argument("--no-record", action="store_true", help="print only; write nothing under bench/results/")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions a decision under valgrind's callgrind, which the machine's speed does not change",
    )
    args = p.parse_args(argv)

    rows = []
    for held in (int(s) for s in args.sizes.split(",")):
        row = measure(held, args.events, args.runs, args.callers, args.slots)
        rows.append(row)
        print(
            f"held={row['held']:>6,}  runs={row['runs']:>5,}  {row['decisions_per_s']:>8,} decisions/s  "
            f"{row['us_per_decision']:>6} µs/decision",
            flush=True,
        )
        if args.instructions:
            row["instructions_per_decision"] = round(
                instructions_per_decision(held, args.runs, args.callers, args.slots)
            )
            print(
                f"held={held:>6,}  {row['instructions_per_decision']:>8,} instructions/decision", flush=True
            )
    base = rows[0]
    for r in rows:
        r["growth"] = r["us_per_decision"] / base["us_per_decision"]
        r["log_growth"] = math.log2(r["held"]) / math.log2(base["held"])
    table = _table(rows)
    print()
    print(table)
    if not args.no_record:
        path = results.write(
            "scheduler_core",
            {
                "runs": args.runs,
                "callers": args.callers,
                "slots": args.slots,
                "replicas": len(REPLICAS),
                # Under callgrind, with PYTHONHASHSEED=0 (rows' instructions_per_decision).
                "instruction_events": list(INSTRUCTION_EVENTS) if args.instructions else None,
                "rows": rows,
            },
            table,
        )
        print(f"\nrecord: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
