"""`luftpause bench sim SCENARIO`: every arm of a scenario, side by side, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from luftpause.bench.sim.arms import ARMS
from luftpause.bench.sim.run import ArmResult, simulate
from luftpause.bench.sim.scenarios import SCENARIOS


def table(scenario: str, seed: int, results: Sequence[ArmResult]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    lines = [
        f"Simulated {scenario}, seed {seed} (virtual time; runs ending in the measurement window)",
        "",
        "| arm | interactive runs/min | interactive p50 s | batch runs/min | batch p50 s | prefix cache hit | runs moved |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {cell(r.interactive_runs_per_min)} | {cell(r.interactive_p50_s)} | "
            f"{cell(r.batch_runs_per_min)} | {cell(r.batch_p50_s)} | {r.prefix_cache_hit_rate:.1%} | "
            f"{r.runs_moved} of {r.runs} |"
        )
    return "\n".join(lines)


def record(scenario: str, seed: int, results: Sequence[ArmResult]) -> dict:
    return {"scenario": scenario, "seed": seed, "arms": [r.as_dict() for r in results]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench sim", description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated arms (default all: {','.join(ARMS)})"
    )
    parser.add_argument("--no-record", action="store_true", help="do not write a record under bench/results/")
    args = parser.parse_args(list(argv) if argv is not None else None)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(
            f"luftpause bench sim: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}",
            file=sys.stderr,
        )
        return 2
    results = [simulate(SCENARIOS[args.scenario], arm, args.seed) for arm in arms]
    text = table(args.scenario, args.seed, results)
    if args.json:
        print(json.dumps(record(args.scenario, args.seed, results)))
    else:
        print(text)
    if not args.no_record:
        from luftpause.bench import results as records

        path = records.write(f"sim-{args.scenario}", record(args.scenario, args.seed, results), text)
        print(f"record: {path}", file=sys.stderr)
    return 0
