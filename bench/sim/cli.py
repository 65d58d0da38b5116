"""`luftpause bench sim SCENARIO`: every arm of a scenario, side by side, over one or more seeds.

With one seed it prints that seed's table. With several (`--seeds 1-5`) it prints each seed's
table, then the median over the seeds with the range, and the verdicts the issues ask for:
luftpause's interactive runs a minute against the best class-blind router arm of the same seed
and against each peer a user could pick without luftpause (`PEER_RATIO`), its interactive plus
batch runs a minute against every peer's, and its engines' continuation prefix hit; then a line
on what bounds the first ratio while the engines' work per run is fixed. The record
(JSON and markdown) goes under bench/results/, with a PNG of interactive and batch runs a minute
per arm when matplotlib is installed (the `bench` extra).

Knobs change the named scenario for one invocation (`KNOBS`): the engines' KV pool and slots, the
tool calls' latency and most number, the contexts' size and the agents of each class. They apply
on top of the scenario, go into the record (`knobs`) and into every table's title; the verdicts of
`flood` and `mcp-flood` apply to their knob variants too. `--host-cache on|off` sets the host
tier of a scenario of llama.cpp engines (`real-flood`): on as its preset, off as
`--cache-ram 0`. A scenario names its own default arms (`real-flood`: the real bench's), and
`real-flood` also prints its figures as the real bench does (`twin`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from luftpause.bench.results import cell
from luftpause.bench.sim import twin
from luftpause.bench.sim.arms import ARMS
from luftpause.bench.sim.peers import PEERS as PEER_ARMS
from luftpause.bench.sim.run import ArmResult, simulate
from luftpause.bench.sim.scenarios import SCENARIOS, Scenario
from luftpause.fake_engine.params import EngineParams

# The arms that route without looking at a turn's class: what "straight to the router" means.
CLASS_BLIND = ("router-round-robin", "sglang-cache-aware", "sglang-sticky")
# What a user could run without luftpause that does look at the class (`peers`).
PEERS = tuple(PEER_ARMS)
OURS = "luftpause"
# The issues' targets, for the verdict lines: interactive runs/min over the best class-blind arm
# (own-loop agents 2x, sub-agents over MCP 2.5x), batch at most 5 % lower.
TARGET_RATIO = {"flood": 2.0, "mcp-flood": 2.5}
BATCH_TOLERANCE = 0.05
# Interactive runs/min luftpause must reach over each peer, batch within the same tolerance
# (flow-control: at least as many of both, as before). Against the fixed run gate it must do
# better (a ratio over 1): that gate is what one number, not chosen per scenario, gets.
PEER_RATIO = {
    "router-plus-engine-priority": 1.4,
    "router-plus-engine-priority-preempt": 1.4,
    "router-plus-engine-priority-host-tier": 1.4,
    "flow-control": 1.0,
    "run-gate-fixed": 1.0,
}
PEER_BATCH_TOLERANCE = {"flow-control": 0.0}
ABOVE = ("run-gate-fixed",)
# Of continuation turns' own-run prompt tokens, the share luftpause's engines must find cached.
CONTINUATION_HIT_TARGET = 0.80
TIE_TOLERANCE = 0.05
# Which scenarios the ratios apply to, and which should tie.
RATIO_SCENARIOS = tuple(TARGET_RATIO)
TIE_SCENARIOS = ("light", "mcp-light")


def against(ours: Sequence[ArmResult], others: Sequence[ArmResult]) -> tuple[list[float], list[float]]:
    """Seed by seed, our interactive runs/min over the other arm's (inf where it served none), and
    our batch runs/min against its, minus 1 (0 where it served none)."""
    ratios = [
        o.interactive_runs_per_min / t.interactive_runs_per_min if t.interactive_runs_per_min else math.inf
        for o, t in zip(ours, others, strict=True)
    ]
    changes = [
        o.batch_runs_per_min / t.batch_runs_per_min - 1 if t.batch_runs_per_min else 0.0
        for o, t in zip(ours, others, strict=True)
    ]
    return ratios, changes


def meets(
    ratios: Sequence[float], changes: Sequence[float], need: float, tolerance: float, above: bool
) -> bool:
    """The verdict on `against`'s figures: the median ratio at least `need` (`above`: more than
    it), and the median batch change no more than `tolerance` below 0."""
    ratio = statistics.median(ratios)
    return (ratio > need if above else ratio >= need) and statistics.median(changes) >= -tolerance


def _at_least(minimum: float, kind: type[int] | type[float], what: str) -> Callable[[str], float]:
    """An argparse type: a number of `kind`, at least `minimum`; the message says what was wrong."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be {'a whole number' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number, got {text}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum:g}, got {text}")
        return value

    return parse


@dataclass(frozen=True)
class Knob:
    """One thing the command line may change in a scenario, or in its engines' parameters."""

    flag: str
    field: str
    """The `Scenario` or `EngineParams` field it sets; also its name in the record."""
    engine: bool
    """Whether the field is `EngineParams`' (else `Scenario`'s)."""
    parse: Callable[[str], float]
    help: str


KNOBS = (
    Knob("--kv-pool-tokens", "kv_pool_tokens", True, _at_least(1, int, "the KV pool"), "tokens of KV memory per replica"),
    Knob("--slots", "slots", True, _at_least(0, int, "slots"), "running requests per replica at most (0: as many as fit)"),
    Knob("--tool-s", "tool_latency_s", False, _at_least(0, float, "a tool call's latency"), "seconds each tool call takes"),
    Knob("--slow-tool-s", "slow_tool_s", False, _at_least(0, float, "the slow tool's latency"), "seconds each call of the slow tool (deep_search) takes, the other tool's staying --tool-s"),
    Knob("--tool-calls", "max_tool_calls", False, _at_least(1, int, "the most tool calls"), "most tool calls a run makes (each makes 1 to N)"),
    Knob("--context-chars", "context_chars", False, _at_least(1, int, "a context"), "characters of each run's task context"),
    Knob("--batch", "batch_agents", False, _at_least(0, int, "batch agents"), "batch agents"),
    Knob("--interactive", "interactive_agents", False, _at_least(0, int, "interactive agents"), "interactive agents"),
    Knob("--host-cache-tokens", "host_cache_tokens", True, _at_least(0, int, "the host tier"), "tokens of each engine's host tier (0: none)"),
)  # fmt: skip


def with_knobs(scenario: Scenario, knobs: dict[str, Any]) -> tuple[Scenario, EngineParams | None]:
    """The scenario and, if any engine knob is set, the engines' parameters, with `knobs` applied.

    `knobs` maps fields to values, each of its field's type (which one value type cannot say)."""
    engine_fields = {k.field for k in KNOBS if k.engine}
    engine = {f: v for f, v in knobs.items() if f in engine_fields}
    scenario = replace(scenario, **{f: v for f, v in knobs.items() if f not in engine_fields})
    return scenario, (replace(scenario.engine, **engine) if engine else None)


def label(scenario: str, knobs: dict[str, Any]) -> str:
    """The scenario as a title names it: with the knobs that changed it, as they were written."""
    flags = {k.field: k.flag for k in KNOBS}
    given = ", ".join(f"{flags[f]} {v:g}" for f, v in knobs.items())
    return f"{scenario} ({given})" if given else scenario


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(scenario: str, seed: int, results: Sequence[ArmResult]) -> str:
    """One seed's figures per arm; `scenario` as `label` writes it."""
    lines = [
        f"Simulated {scenario}, seed {seed} (virtual time; runs ending in the measurement window)",
        "",
        "| arm | interactive runs/min | interactive p50 s | batch runs/min | batch p50 s | "
        "interactive wait to first token p50 / p99 s | batch wait p50 s | prefix cache hit | runs moved | "
        "continuation prefix hit | prefill share | engine s/run | tokens evicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {cell(r.interactive_runs_per_min)} | {cell(r.interactive_p50_s)} | "
            f"{cell(r.batch_runs_per_min)} | {cell(r.batch_p50_s)} | "
            f"{cell(r.interactive_wait_p50_s)} / {cell(r.interactive_wait_p99_s)} | "
            f"{cell(r.batch_wait_p50_s)} | {r.prefix_cache_hit_rate:.1%} | {r.runs_moved} of {r.runs} | "
            f"{_share(r.continuation_prefix_hit)} | {_share(r.prefill_share)} | {cell(r.engine_s_per_run)} | "
            f"{r.tokens_evicted} |"
        )
    return "\n".join(lines)


def _median_range(values: Sequence[float], show: Callable[[float], str] = lambda v: f"{v:g}") -> str:
    if not values:
        return "-"
    return f"{show(statistics.median(values))} ({show(min(values))}-{show(max(values))})"


def _tenth(value: float) -> str:
    return f"{value:.1f}"


def _percent(value: float) -> str:
    return f"{value:.1%}"


def summary(scenario: str, by_seed: dict[int, list[ArmResult]], title: str | None = None) -> tuple[str, dict]:
    """The median table over seeds, the ratios and their verdicts, as text and as a record.

    `scenario` is the named scenario, whose verdicts apply; `title` names it with its knobs."""
    seeds = sorted(by_seed)
    arms = [r.name for r in by_seed[seeds[0]]]
    per_arm = {a: [next(r for r in by_seed[s] if r.name == a) for s in seeds] for a in arms}
    lines = [
        f"Simulated {title or scenario}, seeds {', '.join(map(str, seeds))}: median (range) over the seeds",
        "",
        "| arm | interactive runs/min | batch runs/min | interactive + batch | interactive p50 s | "
        "interactive wait to first token p99 s | continuation prefix hit | prefill share | engine s/run | "
        "tokens evicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, dict] = {}

    def present(values: Sequence[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    for a in arms:
        rs = per_arm[a]
        inter = [r.interactive_runs_per_min for r in rs]
        batch = [r.batch_runs_per_min for r in rs]
        total = [i + b for i, b in zip(inter, batch, strict=True)]
        p50 = present([r.interactive_p50_s for r in rs])
        p99 = present([r.interactive_wait_p99_s for r in rs])
        hit = present([r.continuation_prefix_hit for r in rs])
        prefill = present([r.prefill_share for r in rs])
        per_run = present([r.engine_s_per_run for r in rs])
        evicted = [float(r.tokens_evicted) for r in rs]
        lines.append(
            f"| {a} | {_median_range(inter, _tenth)} | {_median_range(batch, _tenth)} | "
            f"{_median_range(total, _tenth)} | {_median_range(p50, _tenth)} | {_median_range(p99, _tenth)} | "
            f"{_median_range(hit, _percent)} | {_median_range(prefill, _percent)} | "
            f"{_median_range(per_run, lambda v: f'{v:.2f}')} | {_median_range(evicted, lambda v: f'{v:.0f}')} |"
        )
        medians[a] = {
            "interactive_runs_per_min": statistics.median(inter),
            "batch_runs_per_min": statistics.median(batch),
            "total_runs_per_min": statistics.median(total),
            "continuation_prefix_hit": statistics.median(hit) if hit else None,
            "prefill_share": statistics.median(prefill) if prefill else None,
            "engine_s_per_run": statistics.median(per_run) if per_run else None,
            "tokens_evicted": statistics.median(evicted),
        }
    record: dict = {"seeds": seeds, "medians": medians, "comparisons": []}
    if scenario in TIE_SCENARIOS:
        # Light load: nothing queues, so no policy has anything to win; every arm should tie, and
        # luftpause's gate should cost nothing: within TIE_TOLERANCE of the best arm.
        for field, label in (("interactive_runs_per_min", "interactive"), ("batch_runs_per_min", "batch")):
            values = [m[field] for m in medians.values()]
            best = max(values)
            leader = max(medians, key=lambda a: medians[a][field])
            spread = best / min(values) - 1 if min(values) > 0 else float("inf")
            behind = {a: 1 - m[field] / best for a, m in medians.items() if best > 0}
            outside = sorted(a for a, gap in behind.items() if gap > TIE_TOLERANCE)
            ours = behind.get(OURS)
            met = ours is not None and ours <= TIE_TOLERANCE
            lines.append(
                f"\n{label}: the arms' medians are within {spread:.1%} of each other; luftpause is "
                f"{ours:.1%} below the best, {leader} ({'met' if met else 'not met'}: within {TIE_TOLERANCE:.0%})"
                + (f"; more than {TIE_TOLERANCE:.0%} below it: {', '.join(outside)}" if outside else "")
                if ours is not None
                else f"\n{label}: the arms' medians are within {spread:.1%} of each other"
            )
            record["comparisons"].append(
                {
                    "tie": label,
                    "spread": spread,
                    "best": leader,
                    "ours_below_best": ours,
                    "outside": outside,
                    "met": met,
                }
            )
        return "\n".join(lines), record
    if OURS not in per_arm or scenario not in RATIO_SCENARIOS:
        return "\n".join(lines), record

    lines += [
        "",
        "| luftpause against | interactive ratio per seed | median | batch change per seed | verdict |",
    ]
    lines.append("|---|---|---|---|---|")
    ours = per_arm[OURS]

    def compare(
        label: str, others: list[ArmResult], need_ratio: float, batch_tolerance: float, above: bool = False
    ) -> None:
        ratios, changes = against(ours, others)
        ratio = statistics.median(ratios)
        met = meets(ratios, changes, need_ratio, batch_tolerance, above)
        needs = f"> {need_ratio:g}x" if above else f">= {need_ratio:g}x"
        lines.append(
            f"| {label} | {' / '.join(f'{x:.2f}x' for x in ratios)} | {ratio:.2f}x | "
            f"{' / '.join(f'{x:+.1%}' for x in changes)} | "
            f"{'met' if met else 'not met'} (needs {needs}, batch >= {0 - batch_tolerance:+.0%}) |"
        )
        record["comparisons"].append(
            {
                "against": label,
                "ratios": ratios,
                "batch_changes": changes,
                "target": need_ratio,
                "strictly_above": above,
                "batch_tolerance": batch_tolerance,
                "met": met,
            }
        )

    notes: list[str] = []
    blind = [a for a in CLASS_BLIND if a in per_arm]
    if blind:
        best = [
            max((per_arm[a][i] for a in blind), key=lambda r: r.interactive_runs_per_min)
            for i in range(len(seeds))
        ]
        compare("best class-blind router arm of each seed", best, TARGET_RATIO[scenario], BATCH_TOLERANCE)
        # The bound: an interactive run costs the engines what a batch run costs, so what
        # interactive gains, batch gives up. Within the batch tolerance, interactive can gain at
        # most that much of the class-blind arm's batch throughput.
        ceilings = [b.interactive_runs_per_min + BATCH_TOLERANCE * b.batch_runs_per_min for b in best]
        bound = statistics.median(c / b.interactive_runs_per_min for c, b in zip(ceilings, best, strict=True))
        notes.append(
            "What bounds the ratio: interactive + batch runs/min is about the same in every arm where "
            f"the engines do the same work per run whoever sends it (engine s/run above), so with batch "
            f"at most {BATCH_TOLERANCE:.0%} below the class-blind arm, interactive can reach at most its "
            f"interactive plus {BATCH_TOLERANCE:.0%} of its batch: {bound:.2f}x (median over seeds). "
            "An arm that keeps paused runs' prefixes cached does less work per run, and is not so bound."
        )
        record["ratio_bound_at_batch_tolerance"] = bound
    peers_here = [p for p in PEERS if p in per_arm]
    for peer in peers_here:
        compare(
            peer,
            per_arm[peer],
            PEER_RATIO[peer],
            PEER_BATCH_TOLERANCE.get(peer, BATCH_TOLERANCE),
            above=peer in ABOVE,
        )

    # Total runs/min: what luftpause's engines finish, against every peer's.
    if peers_here:
        lines += [
            "",
            "| luftpause's interactive + batch against | ratio per seed | median | verdict |",
            "|---|---|---|---|",
        ]
    for peer in peers_here:
        ratios = [
            (o.interactive_runs_per_min + o.batch_runs_per_min)
            / (t.interactive_runs_per_min + t.batch_runs_per_min)
            for o, t in zip(ours, per_arm[peer], strict=True)
        ]
        met = statistics.median(ratios) > 1.0
        lines.append(
            f"| {peer} | {' / '.join(f'{x:.3f}x' for x in ratios)} | {statistics.median(ratios):.3f}x | "
            f"{'met' if met else 'not met'} (needs > 1x) |"
        )
        record["comparisons"].append({"total_against": peer, "ratios": ratios, "target": 1.0, "met": met})

    hits = [r.continuation_prefix_hit for r in ours]
    measured = [h for h in hits if h is not None]
    median_hit = statistics.median(measured) if measured else None
    met = median_hit is not None and median_hit >= CONTINUATION_HIT_TARGET
    lines.append(
        f"\nluftpause's continuation prefix hit: {' / '.join(_share(h) for h in hits)} per seed, median "
        f"{_share(median_hit)} ({'met' if met else 'not met'}: needs >= {CONTINUATION_HIT_TARGET:.0%})"
    )
    record["comparisons"].append(
        {"continuation_prefix_hit": hits, "target": CONTINUATION_HIT_TARGET, "met": met}
    )
    return "\n".join(lines + [""] + notes if notes else lines), record


def plot(scenario: str, by_seed: dict[int, list[ArmResult]], path: Path) -> Path | None:
    """A PNG of interactive and batch runs/min per arm (median, bars for the range); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    seeds = sorted(by_seed)
    arms = [r.name for r in by_seed[seeds[0]]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, field, title in (
        (axes[0], "interactive_runs_per_min", "interactive runs/min"),
        (axes[1], "batch_runs_per_min", "batch runs/min"),
    ):
        values = [[getattr(next(r for r in by_seed[s] if r.name == a), field) for s in seeds] for a in arms]
        med = [statistics.median(v) for v in values]
        err = [
            [m - min(v) for m, v in zip(med, values, strict=True)],
            [max(v) - m for m, v in zip(med, values, strict=True)],
        ]
        colours = [
            "#d9480f"
            if a == OURS
            else "#ffa94d"
            if a.startswith(OURS)
            else "#4c6ef5"
            if a in PEERS
            else "#868e96"
            for a in arms
        ]
        ax.barh(arms, med, xerr=err, color=colours, capsize=3)
        ax.invert_yaxis()
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        for y, m in enumerate(med):
            ax.text(0.02 * max(med), y, f"{m:.1f}", va="center", ha="left", fontsize=8, color="white")
    axes[1].set_yticklabels([])
    fig.suptitle(
        f"Simulated {scenario}: median over seeds {seeds[0]}-{seeds[-1]} (bars: range); "
        "orange luftpause (light: its variants), blue class-aware peers, grey class-blind routers",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            seeds.extend(range(int(first), int(last) + 1) if dash else [int(first)])
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad seed list {text!r}: write e.g. 1-5 or 1,3,7") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given: write e.g. 1-5 or 1,3,7")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench sim", description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--seed", type=int, help="one workload seed (default 1)")
    parser.add_argument(
        "--seeds", type=_seeds, help="several seeds, e.g. 1-5: per-seed tables, then the median"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--arms",
        help=f"comma-separated arms (default: the scenario's, else all: {','.join(ARMS)})",
    )
    parser.add_argument("--no-record", action="store_true", help="do not write a record under bench/results/")
    parser.add_argument(
        "--host-cache",
        choices=("on", "off"),
        help="real-flood: the engines' host cache on (llama-server's default) or off (--cache-ram 0)",
    )
    for knob in KNOBS:
        parser.add_argument(
            knob.flag,
            type=knob.parse,
            dest=knob.field,
            metavar="S" if knob.flag in ("--tool-s", "--slow-tool-s") else "N",
            help=f"{knob.help} (default: the {'calibrated engine' if knob.engine else 'scenario'}'s)",
        )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.seed is not None and args.seeds is not None:
        parser.error("give --seed or --seeds, not both")
    knobs = {k.field: getattr(args, k.field) for k in KNOBS if getattr(args, k.field) is not None}
    if args.host_cache is not None:
        if not SCENARIOS[args.scenario].engine.slot_kv:
            parser.error(
                "--host-cache is for a scenario of llama.cpp engines (real-flood); see --host-cache-tokens"
            )
        if "host_cache_tokens" in knobs:
            parser.error("give --host-cache or --host-cache-tokens, not both")
        if args.host_cache == "off":
            knobs["host_cache_tokens"] = 0
    scenario, params = with_knobs(SCENARIOS[args.scenario], knobs)
    if scenario.batch_agents + scenario.interactive_agents == 0:
        parser.error("no agents: --batch and --interactive cannot both be 0")
    title = label(args.scenario, knobs)
    seeds = args.seeds or [args.seed if args.seed is not None else 1]
    named = args.arms if args.arms is not None else ",".join(SCENARIOS[args.scenario].arms or ARMS)
    arms = [a.strip() for a in named.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(
            f"luftpause bench sim: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}",
            file=sys.stderr,
        )
        return 2
    by_seed: dict[int, list[ArmResult]] = {}
    for seed in seeds:
        results = []
        for arm in arms:
            if len(seeds) > 1:
                print(f"seed {seed}: {arm} ...", file=sys.stderr, flush=True)
            results.append(simulate(scenario, arm, seed, params))
        by_seed[seed] = results
    texts = [table(title, seed, by_seed[seed]) for seed in seeds]
    record: dict = {
        "scenario": args.scenario,
        "knobs": knobs,
        "seeds": seeds,
        "by_seed": {str(s): [r.as_dict() for r in by_seed[s]] for s in seeds},
    }
    if len(seeds) == 1:
        # The single-seed record keeps the shape it always had, and says what the knobs changed.
        record = {
            "scenario": args.scenario,
            "knobs": knobs,
            "seed": seeds[0],
            "arms": [r.as_dict() for r in by_seed[seeds[0]]],
        }
    else:
        text, summary_record = summary(args.scenario, by_seed, title)
        texts.append(text)
        record["summary"] = summary_record
    if scenario.agents_plan_tool_calls:
        # The twin of the real flood: its figures, as the real bench prints them.
        engine = params if params is not None else scenario.engine
        host = "on" if engine.host_cache_tokens > 0 else "off"
        twin_text, twin_record = twin.report(title, by_seed, host)
        texts.append(twin_text)
        record["twin"] = twin_record
    text = "\n\n".join(texts)
    if args.json:
        print(json.dumps(record))
    else:
        print(text)
    if not args.no_record:
        from luftpause.bench import results as records

        path = records.write(f"sim-{args.scenario}", record, text)
        print(f"record: {path}", file=sys.stderr)
        if len(seeds) > 1:
            png = plot(title, by_seed, path.with_suffix(".png"))
            if png is None:
                print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
            else:
                print(f"plot: {png}", file=sys.stderr)
    return 0
