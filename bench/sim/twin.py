"""The simulated twin's report: `bench sim real-flood` in the figures `bench real_flood` prints.

For each seed and arm: interactive runs/min, interactive run time p50 and p99, batch and all
runs/min, turns served in the window and the engines' prompt-cache share (the engine model's
cached prompt tokens over all prompt tokens in the window, which is what the real bench reads
from llama.cpp's counters). Then the medians over the seeds (lowest-highest), and luftpause over
each of the real bench's baselines (`real_flood.BASELINES`, as the simulator names them) with the
real bench's own spread and verdict (`common.spread`, `real_flood.verdict`), so the two
tables read side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from luftpause.bench import common, real_flood
from luftpause.bench.results import cell
from luftpause.bench.sim.run import ArmResult

SIM_NAMES = {
    "straight": "straight",
    "round-robin": "router-round-robin",
    "sglang-router": "sglang-cache-aware",
}
"""The real bench's arm names -> the simulator's."""

OURS = "luftpause"


def figures(r: ArmResult) -> dict[str, Any]:
    """One arm's figures under the real bench's keys."""
    return {
        "interactive_runs_per_min": r.interactive_runs_per_min,
        "interactive_p50_s": r.interactive_p50_s,
        "interactive_p99_s": r.interactive_p99_s,
        "batch_runs_per_min": r.batch_runs_per_min,
        "all_runs_per_min": round(r.interactive_runs_per_min + r.batch_runs_per_min, 2),
        "turns": r.turns,
        "cache_share": r.prefix_cache_hit_rate,
    }


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def report(
    title: str, by_seed: Mapping[int, Sequence[ArmResult]], host_cache: str
) -> tuple[str, dict[str, Any]]:
    """The twin's tables, as text and as a record; `host_cache` ("on", "off") picks the targets
    its verdicts read (`real_flood.TARGETS`)."""
    seeds = sorted(by_seed)
    rows = {s: {r.name: figures(r) for r in by_seed[s]} for s in seeds}
    arms = [r.name for r in by_seed[seeds[0]]]
    lines = [
        f"Simulated {title} in the real bench's figures (virtual time; seeds {', '.join(map(str, seeds))})",
        "",
        "| seed | arm | interactive runs/min | interactive p50 / p99 s | batch runs/min | all runs/min "
        "| turns | cache share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in seeds:
        for arm in arms:
            f = rows[s][arm]
            lines.append(
                f"| {s} | {arm} | {cell(f['interactive_runs_per_min'])} | {cell(f['interactive_p50_s'])} / "
                f"{cell(f['interactive_p99_s'])} | {cell(f['batch_runs_per_min'])} | "
                f"{cell(f['all_runs_per_min'])} | {f['turns']} | {_share(f['cache_share'])} |"
            )
    keys = (*real_flood.RATIO_KEYS, "interactive_p99_s", "all_runs_per_min", "cache_share")
    medians = {
        arm: {k: common.spread([rows[s][arm][k] for s in seeds if rows[s][arm][k] is not None]) for k in keys}
        for arm in arms
    }
    lines += [
        "",
        "Medians over the seeds (lowest-highest):",
        "",
        "| arm | interactive runs/min | interactive p50 s | interactive p99 s | batch runs/min | turns "
        "| cache share |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, m in medians.items():
        lines.append(
            f"| {arm} | {common.spread_cell(m['interactive_runs_per_min'])} | {common.spread_cell(m['interactive_p50_s'])} | "
            f"{common.spread_cell(m['interactive_p99_s'])} | {common.spread_cell(m['batch_runs_per_min'])} | {common.spread_cell(m['turns'])} | "
            f"{common.spread_cell(m['cache_share'])} |"
        )
    ratios = []
    for baseline in real_flood.BASELINES:
        theirs = SIM_NAMES[baseline]
        if OURS not in arms or theirs not in arms:
            continue
        per_seed = []
        for s in seeds:
            entry: dict[str, Any] = {"seed": s}
            for key in real_flood.RATIO_KEYS:
                a, b = rows[s][OURS][key], rows[s][theirs][key]
                entry[key] = round(a / b, 3) if a is not None and b else None
            per_seed.append(entry)
        summary: dict[str, Any] = {"baseline": theirs, "host_cache": host_cache, "seeds": per_seed}
        for key in real_flood.RATIO_KEYS:
            summary[key] = common.spread([e[key] for e in per_seed if e[key] is not None])
        summary["verdict"] = (
            real_flood.verdict(summary).replace("counted repeat", "seed").replace("the repeats", "the seeds")
        )
        ratios.append(summary)
    if ratios:
        lines += [
            "",
            "luftpause over each baseline, median (lowest-highest) over the seeds (interactive p50: below 1 "
            "is faster):",
            "",
            "| over | interactive runs/min | interactive p50 | batch runs/min | turns | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for r in ratios:
            lines.append(
                f"| {r['baseline']} | {common.spread_cell(r['interactive_runs_per_min'])} | {common.spread_cell(r['interactive_p50_s'])} | "
                f"{common.spread_cell(r['batch_runs_per_min'])} | {common.spread_cell(r['turns'])} | {r['verdict']} |"
            )
    return "\n".join(lines), {
        "figures": {str(s): rows[s] for s in seeds},
        "medians": medians,
        "ratios": ratios,
    }
