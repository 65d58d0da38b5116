"""`luftpause bench frontier`: what holding runs can buy on a scenario's engines, at every setting.

A gate that holds runs on a replica trades between the classes: the more runs it holds, the
larger each engine's decode batch (batch throughput) and the more paused prefixes are evicted
(prefill redone); the fewer, the faster each decode step (interactive run time) and the more
runs wait at the gateway. The simulator's flood asks luftpause for more interactive runs than
the best class-blind router *and* almost as many batch runs *and* more runs in all than every
peer. Whether any setting of a run-holding gate does that is a question about the whole curve,
not one point of it, so this command draws the curve twice, on the scenario's engines:

- luftpause with each replica's KV pool declared at a share of what its engine has (`kv_tokens`
  in a replica's config, which a user can set; `POOL_SCALES`): below 1 it holds fewer runs than
  fit, above 1 more (the engine then evicts some of them). At 1 it is luftpause as it runs by
  default, with the pool read from the engine;
- the peer `run-gate-fixed` at several fixed caps of active runs per replica (`CAPS`), its own
  cap (`peers.RUN_GATE_FIXED_CAP`) among them;

and beside them the peers a user could pick without luftpause, and the best class-blind router
arm of each seed. For every point of either curve it says whether the point meets the scenario's
targets as `bench sim`'s verdicts state them (`cli.TARGET_RATIO`, `cli.BATCH_TOLERANCE`,
`cli.PEER_RATIO`) and whether its runs in all are above every peer's that runs the same engines
(a peer that changes the engines, the host tier's, is listed apart: no gate setting changes
what the engines keep). Medians over the seeds, per-seed ratios first, as `bench sim` takes them.

    luftpause bench frontier [--scenario flood] [--seeds 1-3] [knobs as bench sim takes them]

The record (JSON and markdown) goes under bench/results/ as `frontier-<scenario>-<time>`, with a
PNG of batch against interactive runs a minute when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luftpause.bench.sim import cli
from luftpause.bench.sim.arms import ARMS, Arm, Luftpause
from luftpause.bench.sim.peers import PEERS, RUN_GATE_FIXED_CAP, RunGateFixed
from luftpause.bench.sim.run import ArmResult, simulate
from luftpause.bench.sim.scenarios import SCENARIOS
from luftpause.scheduler.events import Event, PoolConfigured

# The KV pool each of luftpause's replicas is declared with, as a share of its engine's.
POOL_SCALES = (0.8, 0.9, 1.0, 1.1, 1.2)
# The fixed caps of active runs per replica `run-gate-fixed` is drawn at.
CAPS = (9, 10, 11, 12, 13)


def declared_pool(scale: float) -> type[Arm]:
    """luftpause on replicas whose config declares `scale` times their engine's KV pool."""

    class DeclaredPool(Luftpause):
        name = f"luftpause-pool-{scale:g}x"
        # The configured pool stands whatever a probe reads (`kv_tokens` in a replica's config).
        reads_kv = False

        def _feed(self, event: Event) -> None:
            if isinstance(event, PoolConfigured):
                tokens = int(self.pool_tokens() * scale)
                specs = tuple(dataclasses.replace(spec, kv_tokens=tokens) for spec in event.replicas)
                event = dataclasses.replace(event, replicas=specs)
            super()._feed(event)

        def pool_tokens(self) -> int:
            return next(iter(self.replicas.values())).engine.params.kv_pool_tokens

    return DeclaredPool if scale != 1.0 else Luftpause


def fixed_cap(cap: int) -> type[Arm]:
    """`run-gate-fixed` with `cap` active runs per replica at most."""
    if cap == RUN_GATE_FIXED_CAP:
        return RunGateFixed

    class FixedCap(RunGateFixed):
        name = f"run-gate-fixed-{cap}"

    FixedCap.cap = cap
    return FixedCap


@dataclass(frozen=True)
class Point:
    """One arm over the seeds: what it served, and how that stands against the targets."""

    curve: str
    """"luftpause" or "run-gate-fixed" for a point of a curve, "peer" or "class-blind" else."""
    setting: str
    arm: str
    interactive: float
    batch: float
    total: float
    ratio: float | None = None
    """Median over seeds of its interactive runs/min over the best class-blind arm's."""
    batch_change: float | None = None
    """Median over seeds of its batch runs/min against the best class-blind arm's, minus 1."""
    peer_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    """Against each same-engine class-aware peer: median interactive ratio."""
    total_ratio: float | None = None
    """Median over seeds of its runs in all over the most any same-engine peer served that seed."""
    meets_class_blind: bool | None = None
    meets_peers: bool | None = None
    above_peers: bool | None = None


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _total(r: ArmResult) -> float:
    return r.interactive_runs_per_min + r.batch_runs_per_min


def judge(
    scenario: str,
    curves: dict[tuple[str, str], list[ArmResult]],
    peers: dict[str, list[ArmResult]],
    blind: list[ArmResult],
) -> list[Point]:
    """Every point of both curves judged against the targets, then the peers and the class-blind arm.

    `curves`: (curve, setting) -> the arm's result per seed; `peers`: the same-engine peers'
    results per seed; `blind`: the best class-blind arm of each seed."""
    need = cli.TARGET_RATIO.get(scenario)

    def point(curve: str, setting: str, results: list[ArmResult]) -> Point:
        ratios, changes = cli.against(results, blind)
        # A curve's point at the peer's own setting is that peer: never judged against itself.
        others = {name: rs for name, rs in peers.items() if rs[0].name != results[0].name}
        versus = {name: cli.against(results, rs) for name, rs in others.items()}
        best_peer = (
            [max(_total(rs[i]) for rs in others.values()) for i in range(len(results))] if others else []
        )
        total_ratio = (
            _median([_total(r) / b for r, b in zip(results, best_peer, strict=True)]) if others else None
        )
        meets_peers = all(
            cli.meets(
                *versus[name],
                cli.PEER_RATIO[name],
                cli.PEER_BATCH_TOLERANCE.get(name, cli.BATCH_TOLERANCE),
                name in cli.ABOVE,
            )
            for name in versus
            if name in cli.PEER_RATIO
        )
        return Point(
            curve,
            setting,
            results[0].name,
            _median([r.interactive_runs_per_min for r in results]),
            _median([r.batch_runs_per_min for r in results]),
            _median([_total(r) for r in results]),
            _median(ratios),
            _median(changes),
            {name: _median(r) for name, (r, _) in versus.items()},
            total_ratio,
            cli.meets(ratios, changes, need, cli.BATCH_TOLERANCE, False) if need is not None else None,
            meets_peers,
            total_ratio > 1.0 if total_ratio is not None else None,
        )

    points = [point(curve, setting, results) for (curve, setting), results in curves.items()]
    for name, results in peers.items():
        points.append(
            Point(
                "peer",
                name,
                name,
                _median([r.interactive_runs_per_min for r in results]),
                _median([r.batch_runs_per_min for r in results]),
                _median([_total(r) for r in results]),
            )
        )
    points.append(
        Point(
            "class-blind",
            "best of each seed",
            "/".join(sorted({b.name for b in blind})),
            _median([b.interactive_runs_per_min for b in blind]),
            _median([b.batch_runs_per_min for b in blind]),
            _median([_total(b) for b in blind]),
        )
    )
    return points


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def report(title: str, seeds: list[int], points: list[Point], apart: dict[str, list[ArmResult]]) -> str:
    """The curves and the peers as a markdown table, with what the targets need and a verdict line."""
    lines = [
        f"Run-holding frontier, simulated {title}, median over seeds {', '.join(map(str, seeds))}",
        "",
        "| curve | setting | interactive runs/min | batch runs/min | in all | interactive over best class-blind "
        "| batch against it | meets the class-blind target | meets the peer targets | in all over the best same-engine peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.curve} | {p.setting} | {p.interactive:.1f} | {p.batch:.1f} | {p.total:.1f} | "
            + (
                f"{p.ratio:.2f}x | {p.batch_change:+.1%} | "
                if p.ratio is not None and p.batch_change is not None
                else "- | - | "
            )
            + f"{_yes(p.meets_class_blind)} | {_yes(p.meets_peers)} | "
            + (f"{p.total_ratio:.3f}x |" if p.total_ratio is not None else "- |")
        )
    for name, results in apart.items():
        lines.append(
            f"| peer on other engines | {name} | {_median([r.interactive_runs_per_min for r in results]):.1f} | "
            f"{_median([r.batch_runs_per_min for r in results]):.1f} | {_median([_total(r) for r in results]):.1f} "
            "| - | - | - | - | - |"
        )
    on_curves = [p for p in points if p.curve in ("luftpause", "run-gate-fixed")]
    all_three = [p for p in on_curves if p.meets_class_blind and p.meets_peers and p.above_peers]
    best = max(on_curves, key=lambda p: p.total)
    lines += [
        "",
        "Points of either curve meeting every target at once: "
        + (", ".join(f"{p.curve} {p.setting}" for p in all_three) if all_three else "none")
        + f". The most runs in all on either curve: {best.curve} {best.setting}, {best.total:.1f} a minute.",
    ]
    return "\n".join(lines)


def plot(scenario: str, title: str, points: list[Point], path: Path) -> Path | None:
    """Batch against interactive runs/min: both curves as lines, the peers as points; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for curve, colour in (("luftpause", "#d9480f"), ("run-gate-fixed", "#4c6ef5")):
        along = [p for p in points if p.curve == curve]
        ax.plot([p.interactive for p in along], [p.batch for p in along], "o-", color=colour, label=curve)
        for p in along:
            ax.annotate(
                p.setting, (p.interactive, p.batch), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    for p in points:
        if p.curve == "peer" and p.arm != "run-gate-fixed":
            ax.plot(p.interactive, p.batch, "s", color="#5c940d")
            ax.annotate(
                p.setting, (p.interactive, p.batch), textcoords="offset points", xytext=(4, -10), fontsize=7
            )
        elif p.curve == "class-blind":
            ax.plot(p.interactive, p.batch, "D", color="#868e96")
            ax.annotate(
                "best class-blind",
                (p.interactive, p.batch),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    blind = next((p for p in points if p.curve == "class-blind"), None)
    need = cli.TARGET_RATIO.get(scenario)
    if blind is not None and need is not None:
        x0, y0 = need * blind.interactive, (1 - cli.BATCH_TOLERANCE) * blind.batch
        right, top = ax.get_xlim()[1], ax.get_ylim()[1]
        ax.fill_between([x0, max(right, x0 + 1)], y0, max(top, y0 + 1), color="#40c057", alpha=0.12)
        ax.annotate("class-blind target", (x0, y0), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("interactive runs/min (median over seeds)")
    ax.set_ylabel("batch runs/min (median over seeds)")
    ax.set_title(f"Run-holding frontier, simulated {title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench frontier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="flood", choices=sorted(SCENARIOS))
    parser.add_argument("--seeds", type=cli._seeds, default=[1, 2, 3], help="seeds, e.g. 1-5 (default 1-3)")
    parser.add_argument("--no-record", action="store_true", help="do not write a record under bench/results/")
    for knob in cli.KNOBS:
        parser.add_argument(knob.flag, type=knob.parse, dest=knob.field, metavar="N", help=knob.help)
    args = parser.parse_args(list(argv) if argv is not None else None)
    knobs = {k.field: getattr(args, k.field) for k in cli.KNOBS if getattr(args, k.field) is not None}
    scenario, params = cli.with_knobs(SCENARIOS[args.scenario], knobs)
    if scenario.engine.slot_kv:
        parser.error(
            "the frontier is drawn on a shared KV pool; on slot engines the gate holds one run a slot"
        )
    title = cli.label(args.scenario, knobs)
    engines = params if params is not None else scenario.engine
    arms: dict[tuple[str, str], type[Arm]] = {}
    for scale in POOL_SCALES:
        arms[("luftpause", f"pool {scale:g}x")] = declared_pool(scale)
    for cap in CAPS:
        arms[("run-gate-fixed", f"cap {cap}")] = fixed_cap(cap)
    # A peer whose engines keep what the scenario's do not (a host tier) is listed apart.
    same = {
        n: a for n, a in PEERS.items() if a.engines(engines).host_cache_tokens == engines.host_cache_tokens
    }
    other = {n: a for n, a in PEERS.items() if n not in same}
    blind_arms = {name: ARMS[name] for name in cli.CLASS_BLIND}
    jobs: list[tuple[str, type[Arm]]] = [
        *((f"{c} {s}", a) for (c, s), a in arms.items()),
        *((n, a) for n, a in same.items() if n != RunGateFixed.name),
        *other.items(),
        *blind_arms.items(),
    ]
    runs: dict[str, list[ArmResult]] = {label: [] for label, _ in jobs}
    for seed in args.seeds:
        for n, (label, arm) in enumerate(jobs, 1):
            print(f"seed {seed}: {label} ({n}/{len(jobs)}) ...", file=sys.stderr, flush=True)
            runs[label].append(simulate(scenario, arm.name, seed, params, arm=arm))
    curves = {key: runs[f"{key[0]} {key[1]}"] for key in arms}
    peers = {name: runs[name] for name in same if name != RunGateFixed.name}
    peers[RunGateFixed.name] = curves[("run-gate-fixed", f"cap {RUN_GATE_FIXED_CAP}")]
    blind = [
        max((runs[name][i] for name in blind_arms), key=lambda r: r.interactive_runs_per_min)
        for i in range(len(args.seeds))
    ]
    points = judge(args.scenario, curves, peers, blind)
    apart = {name: runs[name] for name in other}
    text = report(title, args.seeds, points, apart)
    print(text)
    if not args.no_record:
        from luftpause.bench import results as records

        record: dict[str, Any] = {
            "scenario": args.scenario,
            "knobs": knobs,
            "seeds": args.seeds,
            "pool_scales": list(POOL_SCALES),
            "caps": list(CAPS),
            "points": [dataclasses.asdict(p) for p in points],
            "by_arm": {label: [r.as_dict() for r in rs] for label, rs in runs.items()},
        }
        path = records.write(f"frontier-{args.scenario}", record, text)
        print(f"record: {path}", file=sys.stderr)
        png = plot(args.scenario, title, points, path.with_suffix(".png"))
        print(f"plot: {png}" if png else "no plot: matplotlib is not installed", file=sys.stderr)
    return 0
