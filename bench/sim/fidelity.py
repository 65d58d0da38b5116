"""Fidelity: the same scaled-down flood in real time with real processes, and in the simulator.

The question it answers: does the simulator predict what luftpause gains over a router? For each
arm it starts two HTTP fake engines (`luftpause fake-engine`, the calibrated model with the
scaled KV pool and priority scheduling on, as the simulator's replicas run) and in front of
them one of

- `router-round-robin`: a class-blind round-robin proxy (`round_robin_proxy`);
- `sglang-cache-aware`: the real SGLang router from PyPI (`sglang-router`, the `bench` extra)
  with `--policy cache_aware` (`luftpause.bench.sglang_router` says how it is started and what
  it does with a request);
- `luftpause`: the real scheduler and dataplane, configured with the two engines declared
  `engine_priority = "sglang"`, so that the dataplane writes each turn's class into its request
  as the simulator's `luftpause` arm does (the routers send no priority: first come, first served);

then runs two `luftpause loadgen` processes beside each other (batch and interactive agents,
closed loop, the flood's contexts and tool latency), stops everything, and runs the simulator's
twin of the arm (the sim arm of the same name) on the same scaled scenario. The loadgen agents
stream their turns (`--stream`): the dataplane reports a turn's first token to the scheduler as
the first content chunk passes, which is when the simulator's `luftpause` arm feeds its
`FirstToken` event; a reply read whole would report it only at the end of the reply.

Arms are interleaved within each of `--repeats` repeats (A B C, A B C, ...), so that drift on
the machine hits every arm. Repeat r (from 0) simulates seed `--seed` + r. Per repeat and arm it
prints real and simulated runs/min by class; then, per router arm, the ratio of luftpause's
interactive runs/min over that arm's, real and simulated, with the median and the spread (lowest
to highest) over the repeats that count, and a verdict: the real median ratio agrees with the
simulated one when both are on the same side of 1 (direction) and the real one is within 20 %
of the simulated one (size: |real / simulated - 1| <= 0.2).

In the `luftpause` arm the window is also watched from inside (`flood_watch`): the scheduler's
GET /status is sampled every 2 s (per replica: in flight, limit, our turns waiting in the engine,
other clients' waiting, the engine's own queue; the turns held by class), the dataplane's
/metrics is read at the window's start and end (held time and engine time to first token, p50
and p99 per class, from the histograms' growth over the window, interpolated inside a bucket as
Prometheus' histogram_quantile does), and midway the status page is rendered by headless
Chromium to a PNG, saved next to the record. All of it goes in the arm's row (`real.flood`) and
in the report's "Under the flood (luftpause arm)" tables. Chromium's few seconds of CPU fall in
that window, and so in its CPU figures.

A window is saturated, and its row does not count (nor any ratio that needs it), when the CPUs
this process may run on were busy more than 90 % of the window (all work on them, not only ours:
the machine is shared), or the container's CPU quota was used more than 90 %, or one of the
single-threaded Python processes (engine, scheduler, dataplane, proxy, loadgen) used more than
90 % of a core: then the real processes were not keeping up and real time is not what the
simulator models. The output names the cause.

Progress goes to stderr, one line per phase. The record (JSON and markdown) goes to
bench/results/ via `luftpause.bench.results`; each process's log stays in a temporary folder
that is removed unless a run failed (then its path is printed).

    luftpause bench fidelity                                  # 24 batch + 4 interactive, 3 repeats, ~40 min
    luftpause bench fidelity --batch 8 --interactive 2 --warmup-s 10 --window-s 30 --repeats 1
    python -m luftpause.bench.sim.fidelity ...                # the same
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from luftpause.bench import cpu, sglang_router, stack_config
from luftpause.bench.common import Processes, free_port, spread, spread_cell, wait_healthy
from luftpause.bench.results import cell, tidy_logs
from luftpause.bench.sim import flood_watch
from luftpause.bench.sim.run import simulate
from luftpause.bench.sim.scenarios import SCENARIOS, Scenario
from luftpause.config import DEFAULT_MODEL
from luftpause.fake_engine.params import EngineParams

ROUTER_ARMS = ("router-round-robin", "sglang-cache-aware")
ARMS = (*ROUTER_ARMS, "luftpause")
SIZE_TOLERANCE = 0.20
# Starting and stopping an arm's processes, before the first phase is timed (the progress line's
# estimate of what is left; replaced by the measured figure after the first arm).
SETUP_GUESS_S = 10.0


def _config(directory: Path, engines: list[int], grpc: int, status: int, dataplane: int) -> Path:
    replicas = [
        stack_config.replica(f"fake-{chr(ord('a') + i)}", port, [DEFAULT_MODEL], engine_priority="sglang")
        for i, port in enumerate(engines)
    ]
    return stack_config.write(
        directory, stack_config.stack(grpc=grpc, status=status, dataplane=dataplane, replicas=replicas)
    )


def engine_params(kv_pool_tokens: int) -> EngineParams:
    """The engines of both worlds: the calibrated model with the scaled KV pool, and priority
    scheduling on, as the simulator's replicas always run (the test bed's SGLang did). Arms that
    mark no turn leave every request at priority 0, first come, first served."""
    return replace(EngineParams(), kv_pool_tokens=kv_pool_tokens, priority_scheduling=True)


def timing_env(params: EngineParams) -> str:
    """`params` as $LUFTPAUSE_FAKE_ENGINE_TIMING for a fake-engine process: the fields that
    differ from the defaults, so that the real engines run the model the simulator runs."""
    defaults = EngineParams()
    changed = [f.name for f in fields(EngineParams) if getattr(params, f.name) != getattr(defaults, f.name)]
    return ",".join(f"{name}={str(getattr(params, name)).lower()}" for name in changed)


@dataclass
class Progress:
    """One stderr line per phase, with the time spent and an estimate of what is left."""

    runs: int
    phase_s: float
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    setup_s: list[float] = field(default_factory=list)

    def line(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        setup = statistics.mean(self.setup_s) if self.setup_s else SETUP_GUESS_S
        left = max((self.runs - self.done) * (self.phase_s + setup), 0.0)
        print(
            f"fidelity [{_clock(elapsed)} elapsed, ~{_clock(left)} left] {text}", file=sys.stderr, flush=True
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def real_arm(
    arm: str,
    args: argparse.Namespace,
    scenario: Scenario,
    params: EngineParams,
    seed: str,
    logs: Path,
    say: Progress,
    label: str,
) -> dict[str, Any]:
    """Runs the scaled flood through real processes for `arm`; returns runs/min by class and CPU use."""
    py = [sys.executable, "-m", "luftpause"]
    procs = Processes(logs)
    single_threaded: set[str] = set()
    loads: dict[str, subprocess.Popen] = {}
    sampler: flood_watch.StatusSampler | None = None
    flood: dict[str, Any] | None = None
    began = time.monotonic()
    try:
        engine_ports = [free_port() for _ in range(scenario.replicas)]
        timing = {"LUFTPAUSE_FAKE_ENGINE_TIMING": timing_env(params)}
        for i, port in enumerate(engine_ports):
            name = f"fake-{chr(ord('a') + i)}"
            procs.start(
                name,
                [*py, "--log-level", "WARNING", "fake-engine", "--name", name, "--port", str(port)],
                timing,
            )
            single_threaded.add(name)
        engines = [f"http://127.0.0.1:{p}" for p in engine_ports]
        for url in engines:
            wait_healthy(f"{url}/health", procs)
        front = free_port()
        if arm == "luftpause":
            grpc, status = free_port(), free_port()
            conf = _config(logs, engine_ports, grpc, status, front)
            procs.start("scheduler", [*py, "--log-level", "WARNING", "scheduler", "--config", str(conf)])
            procs.start("dataplane", [*py, "--log-level", "WARNING", "dataplane", "--config", str(conf)])
            single_threaded |= {"scheduler", "dataplane"}
            wait_healthy(f"http://127.0.0.1:{front}/health", procs)
        elif arm == "router-round-robin":
            proxy = [sys.executable, "-m", "luftpause.bench.sim.round_robin_proxy"]
            procs.start("proxy", [*proxy, "--port", str(front), "--engines", ",".join(engines)])
            single_threaded.add("proxy")
            wait_healthy(f"http://127.0.0.1:{front}/health", procs)
        elif arm == "sglang-cache-aware":
            # The router is Rust on threads of its own: only the machine-wide figures apply to it.
            argv = sglang_router.command(front, engines, policy="cache_aware", prometheus_port=free_port())
            router = procs.start("router", argv)
            sglang_router.wait_ready(
                f"http://127.0.0.1:{front}", engines, alive=lambda: router.poll() is None
            )
        else:
            raise ValueError(f"unknown arm {arm}")
        common = [
            "--url", f"http://127.0.0.1:{front}", "--duration-s", str(args.window_s),
            "--warmup-s", str(args.warmup_s), "--context-chars", str(scenario.context_chars),
            "--tool-latency-s", str(scenario.tool_latency_s), "--seed", seed, "--stream",
        ]  # fmt: skip
        for cls, n in (("batch", scenario.batch_agents), ("interactive", scenario.interactive_agents)):
            if n <= 0:
                continue
            with (logs / f"loadgen-{cls}.log").open("wb") as err:
                loads[cls] = subprocess.Popen(
                    [
                        *py,
                        "--log-level",
                        "WARNING",
                        "loadgen",
                        *common,
                        "--agents",
                        str(n),
                        "--class",
                        cls,
                        "--caller",
                        cls,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            single_threaded.add(f"loadgen-{cls}")
        loads_started = time.monotonic()
        say.setup_s.append(loads_started - began)
        pids = {name: p.pid for name, p in procs.procs.items()} | {
            f"loadgen-{c}": p.pid for c, p in loads.items()
        }
        say.line(f"{label}: warm-up {args.warmup_s:g} s")
        time.sleep(args.warmup_s)  # the window starts with loadgen's own count, not before
        procs.check_alive()
        say.line(f"{label}: window {args.window_s:g} s")
        before = cpu.snapshot(pids)
        window_end = loads_started + args.warmup_s + args.window_s - cpu.WINDOW_MARGIN_S
        if arm == "luftpause":
            metrics_url = f"http://127.0.0.1:{front}/metrics"
            start_histograms = flood_watch.scrape(metrics_url)
            sampler = flood_watch.StatusSampler(f"http://127.0.0.1:{status}/status").start()
            time.sleep(max(before.at + args.window_s / 2 - time.monotonic(), 0))
            shot = logs / "status-page.png"
            shot_began = time.monotonic()
            why_not = flood_watch.screenshot(f"http://127.0.0.1:{status}/", shot, logs / "chromium-profile")
            flood = {
                "screenshot_file": None if why_not else str(shot),
                "screenshot_error": why_not,
                "screenshot_s": round(time.monotonic() - shot_began, 2),
            }
        time.sleep(max(window_end - time.monotonic(), 0))
        if sampler is not None and flood is not None:
            flood["quantiles"] = flood_watch.window_quantiles(
                start_histograms, flood_watch.scrape(metrics_url)
            )
            flood["status"] = sampler.stop()
            sampler = None
        after = cpu.snapshot(pids)
        outputs = {cls: p.communicate() for cls, p in loads.items()}
        summaries = {}
        for cls, (out, _) in outputs.items():
            if loads[cls].returncode != 0 or not out.strip():
                tail = (logs / f"loadgen-{cls}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"loadgen {cls} exited with {loads[cls].returncode}:\n{tail}")
            summaries[cls] = json.loads(out.strip().splitlines()[-1])
        procs.check_alive()
    finally:
        if sampler is not None:
            sampler.stop()
        for p in loads.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        procs.stop()

    def per_min(cls: str) -> float:
        return summaries[cls]["runs_per_min"] if cls in summaries else 0.0

    return {
        "interactive_runs_per_min": per_min("interactive"),
        "batch_runs_per_min": per_min("batch"),
        "errors": sum(s["errors"] for s in summaries.values()),
        **cpu.cpu_use(before, after, single_threaded),
        "summaries": summaries,
        **({"flood": flood} if flood is not None else {}),
    }


# -- ratios and verdicts --


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def verdict(real: float | None, sim: float | None) -> dict[str, Any]:
    """Whether a real median ratio agrees with the simulated one: the same side of 1, and within
    SIZE_TOLERANCE of it (|real / sim - 1|)."""
    if real is None or sim is None or sim == 0:
        return {"direction": None, "size_gap": None, "agrees": None, "text": "no verdict: no repeat counted"}

    def side(x: float) -> int:
        return (x > 1) - (x < 1)

    direction = side(real) == side(sim)
    gap = round(abs(real / sim - 1), 3)
    within = gap <= SIZE_TOLERANCE
    if direction and within:
        text = f"agrees (same direction, {gap:.0%} apart)"
    elif direction:
        text = f"disagrees: same direction but {gap:.0%} apart (over {SIZE_TOLERANCE:.0%})"
    else:
        text = f"disagrees: direction (real {real:.2f}, simulated {sim:.2f})"
    return {"direction": direction, "size_gap": gap, "agrees": direction and within, "text": text}


def ratios(rows: list[dict[str, Any]], router_arm: str, repeats: int) -> dict[str, Any]:
    """luftpause over `router_arm`, interactive (and, for information, batch) runs/min, real and
    simulated, per repeat; the median and spread over the repeats where both rows count."""
    per_repeat = []
    for r in range(repeats):
        of = {row["arm"]: row for row in rows if row["repeat"] == r}
        ours, theirs = of.get("luftpause"), of.get(router_arm)
        if ours is None or theirs is None:
            continue
        entry: dict[str, Any] = {"repeat": r}
        for cls in ("interactive", "batch"):
            key = f"{cls}_runs_per_min"
            entry[f"{cls}_real"] = _ratio(ours["real"].get(key, 0.0), theirs["real"].get(key, 0.0))
            entry[f"{cls}_sim"] = _ratio(ours["sim"][key], theirs["sim"][key])
        left_out = [f"{row['arm']}: {row['why_not']}" for row in (ours, theirs) if not row["counts"]]
        if entry["interactive_real"] is None:
            left_out.append(f"{router_arm} finished no interactive run")
        entry["counts"] = not left_out
        entry["why_not"] = "; ".join(left_out) or None
        per_repeat.append(entry)
    counted = [e for e in per_repeat if e["counts"]]
    summary: dict[str, Any] = {"router_arm": router_arm, "repeats": per_repeat, "counted": len(counted)}
    for cls in ("interactive", "batch"):
        for side in ("real", "sim"):
            values = [e[f"{cls}_{side}"] for e in counted if e[f"{cls}_{side}"] is not None]
            summary[f"{cls}_{side}"] = spread(values)
    summary["verdict"] = verdict(summary["interactive_real"]["median"], summary["interactive_sim"]["median"])
    return summary


# -- the report --


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    router_version: str | None,
) -> str:
    lines = [
        f"Fidelity, flood scaled to {args.batch} batch + {args.interactive} interactive agents (streamed turns), "
        f"KV pool {args.kv_pool_tokens}, window {args.window_s:g} s after {args.warmup_s:g} s, "
        f"{args.repeats} repeat(s) with arms interleaved, simulated seed {args.seed} + repeat"
        + (f"; sglang-router {router_version}" if router_version else ""),
        "",
        "| repeat | arm | interactive runs/min real / sim | batch runs/min real / sim | errors | CPU busy | busiest process | counts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        real, sim = row["real"], row["sim"]
        cores: dict[str, float] = real.get("process_cores") or {}
        busiest = max(cores, key=cores.__getitem__) if cores else None
        lines.append(
            f"| {row['repeat'] + 1} | {row['arm']} | {cell(real.get('interactive_runs_per_min'))} / "
            f"{cell(sim['interactive_runs_per_min'])} | {cell(real.get('batch_runs_per_min'))} / "
            f"{cell(sim['batch_runs_per_min'])} | {cell(real.get('errors'))} | "
            f"{'-' if real.get('cpu_busy') is None else format(real['cpu_busy'], '.0%')} | "
            f"{'-' if busiest is None else f'{busiest} {cores[busiest]:.0%}'} | "
            f"{'yes' if row['counts'] else 'no: ' + row['why_not']} |"
        )
    lines += [
        "",
        "luftpause's interactive runs/min over each router arm's: median (lowest-highest) over the repeats that count",
        "",
        "| luftpause over | real | simulated | repeats counted | verdict (same direction, within 20 %) | batch real / simulated |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['router_arm']} | {spread_cell(s['interactive_real'])} | {spread_cell(s['interactive_sim'])} | "
            f"{s['counted']} of {len(s['repeats'])} | {s['verdict']['text']} | "
            f"{spread_cell(s['batch_real'])} / {spread_cell(s['batch_sim'])} |"
        )
    left_out = [
        f"repeat {e['repeat'] + 1} vs {s['router_arm']}: {e['why_not']}"
        for s in summaries
        for e in s["repeats"]
        if not e["counts"]
    ]
    if left_out:
        lines += ["", "Not counted: " + "; ".join(left_out) + "."]
    for row in rows:
        if "flood" in row["real"]:
            lines += ["", *flood_watch.markdown(f"repeat {row['repeat'] + 1}", row["real"]["flood"])]
    return "\n".join(lines)


def keep_screenshots(rows: list[dict[str, Any]], stamp: str | None) -> None:
    """Copies each luftpause window's status page picture from its (temporary) log folder to
    bench/results/, named after the run's time and repeat, and names it in the row's record
    (`screenshot`, a file beside the record); with no record (`stamp` None) none is kept."""
    from luftpause.bench.results import RESULTS_DIR

    for row in rows:
        flood = row["real"].get("flood")
        if not flood:
            continue
        source = flood.pop("screenshot_file", None)
        flood["screenshot"] = None
        if source is None:
            continue
        if stamp is None:
            flood["screenshot_error"] = "not kept (--no-record)"
            continue
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        target = RESULTS_DIR / f"fidelity-{stamp}-repeat{row['repeat'] + 1}-status.png"
        shutil.copyfile(source, target)
        flood["screenshot"] = target.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=24, help="batch agents (default 24, half the flood)")
    parser.add_argument("--interactive", type=int, default=4, help="interactive agents (default 4)")
    parser.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=16384,
        help="each engine's KV pool (default 16384, half the calibrated one)",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=60.0, help="uncounted start of each window (default 60)"
    )
    parser.add_argument("--window-s", type=float, default=180.0, help="counted window per arm (default 180)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats, each running every arm once (default 3)"
    )
    parser.add_argument("--seed", type=int, default=1, help="simulated seed of repeat 1; repeat r adds r - 1")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated, in this order (default {','.join(ARMS)})"
    )
    parser.add_argument("--no-record", action="store_true", help="do not write a record under bench/results/")
    args = parser.parse_args(list(argv) if argv is not None else None)
    # `luftpause bench` logs at INFO; a line per readiness poll would bury the progress lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or args.repeats < 1:
        parser.error(f"arms must be among {', '.join(ARMS)}; repeats at least 1")
    router_version = sglang_router.installed_version() if "sglang-cache-aware" in arms else None
    if "sglang-cache-aware" in arms and router_version is None:
        print(
            "luftpause bench fidelity: the sglang-cache-aware arm needs the SGLang router: "
            "pip install -e '.[bench]' (or leave the arm out with --arms)",
            file=sys.stderr,
        )
        return 2
    if router_version not in (None, sglang_router.TESTED_VERSION):
        print(
            f"fidelity: sglang-router {router_version} is installed; this harness was checked against "
            f"{sglang_router.TESTED_VERSION}",
            file=sys.stderr,
        )
    scenario = replace(
        SCENARIOS["flood"],
        name="flood-scaled",
        batch_agents=args.batch,
        interactive_agents=args.interactive,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
    )
    params = engine_params(args.kv_pool_tokens)
    say = Progress(runs=args.repeats * len(arms), phase_s=args.warmup_s + args.window_s)
    # The simulator first, all of it (a second or so a run), so that its CPU is spent outside
    # every real window and the predicted ratios are on screen before the long part starts.
    sims = {
        (r, arm): simulate(scenario, arm, args.seed + r, params).as_dict()
        for r in range(args.repeats)
        for arm in arms
    }
    for r in range(args.repeats):
        say.line(
            f"simulated repeat {r + 1} (seed {args.seed + r}): "
            + ", ".join(
                f"{arm} {sims[r, arm]['interactive_runs_per_min']:g} interactive / {sims[r, arm]['batch_runs_per_min']:g} batch runs/min"
                for arm in arms
            )
        )
    logs = Path(tempfile.mkdtemp(prefix="luftpause-fidelity-"))
    rows: list[dict[str, Any]] = []
    failed = False
    for r in range(args.repeats):
        for i, arm in enumerate(arms):
            label = f"repeat {r + 1}/{args.repeats}, {arm} ({i + 1}/{len(arms)})"
            say.line(f"{label}: starting processes")
            run_logs = logs / f"{r + 1}-{arm}"
            run_logs.mkdir()
            row: dict[str, Any] = {"repeat": r, "arm": arm, "sim": sims[r, arm]}
            try:
                row["real"] = real_arm(arm, args, scenario, params, f"{args.seed}-{r}", run_logs, say, label)
                row["counts"] = not row["real"]["saturated"]
                row["why_not"] = (
                    None if row["counts"] else "CPU saturated (" + row["real"]["saturation"] + ")"
                )
            except (RuntimeError, OSError, ValueError) as e:
                failed = True
                row["real"] = {"failed": str(e)}
                row["counts"], row["why_not"] = False, "failed: " + str(e).splitlines()[0]
            say.done += 1
            rows.append(row)
            real = row["real"]
            say.line(
                f"{label}: done: interactive {cell(real.get('interactive_runs_per_min'))} runs/min "
                f"(sim {row['sim']['interactive_runs_per_min']:g}), batch {cell(real.get('batch_runs_per_min'))} "
                f"(sim {row['sim']['batch_runs_per_min']:g})"
                + (f", CPU {real['cpu_busy']:.0%} busy" if "cpu_busy" in real else "")
                + ("" if row["counts"] else f"; does not count: {row['why_not']}")
            )
    summaries = [
        ratios(rows, arm, args.repeats) for arm in ROUTER_ARMS if arm in arms and "luftpause" in arms
    ]
    keep_screenshots(rows, None if args.no_record else time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    text = report(args, rows, summaries, router_version)
    print(text)
    tidy_logs("fidelity", logs, failed)
    if not args.no_record:
        from luftpause.bench import results as records

        router = None
        if router_version is not None:
            router = {
                "package": sglang_router.PACKAGE,
                "version": router_version,
                "command": sglang_router.command(0, ["<engine-a>", "<engine-b>"], prometheus_port=0)[1:],
            }
        record = {"options": vars(args), "sglang_router": router, "rows": rows, "ratios": summaries}
        path = records.write("fidelity", record, text)
        print(f"record: {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
