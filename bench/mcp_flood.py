"""Sub-agents over MCP under a batch flood, in real time: the runtime through luftpause against
the runtime straight to the real SGLang router, and the same scenario in the simulator.

For each arm a fresh stack (`bench.stack`: two fake engines with the scaled KV pool and priority
scheduling on, fake-mcp with every call taking 2 s, the runtime) with its turns going through
luftpause (`luftpause`) or straight to the SGLang router from PyPI, cache-aware
(`sglang-cache-aware`, class-blind: it drops the class header). Two `luftpause loadgen
--spawn-agents` processes beside each other, batch and interactive, each one MCP session and so
one caller, run closed-loop sub-agents with the flood's contexts (`loadgen.subagents`). The
simulator's twin of each arm runs the `mcp-flood` scenario scaled the same way (streamed turns,
the runtime's overheads), seed `--seed` + repeat.

Arms are interleaved within each repeat. A window whose CPUs were more than 90 % busy, or in
which one of the single-threaded processes (engines, scheduler, dataplane, runtime, fake-mcp,
loadgen) used more than 90 % of a core, does not count (the fidelity harness's check). Prints
per repeat and arm the runs/min by class, real and simulated; then luftpause's interactive
ratio over the router with the spread, batch's change, the issue's target (2.5x, batch within
5 %) and whether real and simulated agree (`fidelity.verdict`). Record, table and PNG under
bench/results/.

    luftpause bench mcp_flood                      # 24 batch + 4 interactive, 3 repeats, ~30 min
    luftpause bench mcp_flood --batch 6 --interactive 2 --warmup-s 10 --window-s 30 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from luftpause.bench import results, sglang_router
from luftpause.bench import stack as stacks
from luftpause.bench.common import spread_cell
from luftpause.bench.results import cell
from luftpause.bench.sim.fidelity import engine_params, ratios
from luftpause.bench.sim.run import simulate
from luftpause.bench.sim.scenarios import SCENARIOS

ROUTER_ARM = "sglang-cache-aware"
ARMS = (ROUTER_ARM, "luftpause")
TARGET_RATIO = 2.5
BATCH_TOLERANCE = 0.05
# The CPU window closes this long before loadgen's deadline, while every process is still there.
CPU_WINDOW_MARGIN_S = 0.5


def real_arm(arm: str, args: argparse.Namespace, seed: str, logs: Path) -> dict[str, Any]:
    """The scaled flood of sub-agents through `arm`'s stack; runs/min by class and CPU use."""
    loads: dict[str, subprocess.Popen] = {}
    try:
        with stacks.stack(arm, logs, kv_pool_tokens=args.kv_pool_tokens) as s:
            for cls, n in (("batch", args.batch), ("interactive", args.interactive)):
                with (logs / f"loadgen-{cls}.log").open("wb") as err:
                    loads[cls] = subprocess.Popen(
                        [
                            sys.executable, "-m", "luftpause", "--log-level", "WARNING", "loadgen",
                            "--runtime", s.runtime_url, "--spawn-agents", str(n), "--class", cls,
                            "--duration-s", str(args.window_s), "--warmup-s", str(args.warmup_s),
                            "--context-chars", str(SCENARIOS["mcp-flood"].context_chars),
                            "--seed", f"{seed}-{cls}",
                        ],
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )  # fmt: skip
            started = time.monotonic()
            time.sleep(args.warmup_s)
            s.procs.check_alive()
            window = stacks.CpuWindow(s, {f"loadgen-{c}": p.pid for c, p in loads.items()})
            time.sleep(
                max(started + args.warmup_s + args.window_s - CPU_WINDOW_MARGIN_S - time.monotonic(), 0)
            )
            cpu = window.close()
            summaries = {}
            for cls, p in loads.items():
                out, _ = p.communicate(timeout=120)
                if p.returncode != 0 or not out.strip():
                    tail = (logs / f"loadgen-{cls}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"loadgen {cls} exited with {p.returncode}:\n{tail}")
                summaries[cls] = json.loads(out.strip().splitlines()[-1])
            s.procs.check_alive()
    finally:
        for p in loads.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {
        "interactive_runs_per_min": summaries["interactive"]["runs_per_min"],
        "batch_runs_per_min": summaries["batch"]["runs_per_min"],
        "interactive_p50_s": summaries["interactive"]["run_time_p50_s"],
        "errors": sum(x["errors"] for x in summaries.values()),
        **cpu,
        "summaries": summaries,
    }


def report(args: argparse.Namespace, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        f"Sub-agents over MCP under a flood: {args.batch} batch + {args.interactive} interactive closed-loop "
        f"sub-agents, KV pool {args.kv_pool_tokens}, window {args.window_s:g} s after {args.warmup_s:g} s, "
        f"{args.repeats} repeat(s), arms interleaved; simulated seed {args.seed} + repeat",
        "",
        "| repeat | arm | interactive runs/min real / sim | batch runs/min real / sim | interactive p50 s real / sim | errors | CPU busy | counts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        real, sim = row["real"], row["sim"]
        lines.append(
            f"| {row['repeat'] + 1} | {row['arm']} | {cell(real.get('interactive_runs_per_min'))} / "
            f"{cell(sim['interactive_runs_per_min'])} | {cell(real.get('batch_runs_per_min'))} / "
            f"{cell(sim['batch_runs_per_min'])} | {cell(real.get('interactive_p50_s'))} / "
            f"{cell(sim['interactive_p50_s'])} | {cell(real.get('errors'))} | "
            f"{'-' if real.get('cpu_busy') is None else format(real['cpu_busy'], '.0%')} | "
            f"{'yes' if row['counts'] else 'no: ' + row['why_not']} |"
        )
    met = summary["target"]
    lines += [
        "",
        "| luftpause over the router | real | simulated | repeats counted | target |",
        "|---|---|---|---|---|",
        f"| interactive runs/min | {spread_cell(summary['interactive_real'])} | "
        f"{spread_cell(summary['interactive_sim'])} | {summary['counted']} of {len(summary['repeats'])} | "
        f"real {met['real']}, simulated {met['sim']} (at least {TARGET_RATIO:g}x, batch within {BATCH_TOLERANCE:.0%}) |",
        f"| batch runs/min | {spread_cell(summary['batch_real'])} | {spread_cell(summary['batch_sim'])} | | |",
        "",
        f"Real against simulated (interactive ratio): {summary['verdict']['text']}.",
    ]
    return "\n".join(lines)


def _target(summary: dict[str, Any]) -> dict[str, str]:
    out = {}
    for side in ("real", "sim"):
        inter, batch = summary[f"interactive_{side}"]["median"], summary[f"batch_{side}"]["median"]
        if inter is None or batch is None:
            out[side] = "no figure"
        else:
            ok = inter >= TARGET_RATIO and batch >= 1 - BATCH_TOLERANCE
            out[side] = f"{'met' if ok else 'not met'} ({inter:.2f}x, batch {batch - 1:+.1%})"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench mcp_flood", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=24, help="batch sub-agents (default 24, half the flood)")
    p.add_argument("--interactive", type=int, default=4, help="interactive sub-agents (default 4)")
    p.add_argument("--kv-pool-tokens", type=int, default=16384, help="each engine's KV pool (default 16384)")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=180.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    version = sglang_router.installed_version()
    if version is None:
        print("luftpause bench mcp_flood needs the SGLang router: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    scenario = replace(
        SCENARIOS["mcp-flood"],
        name="mcp-flood-scaled",
        batch_agents=args.batch,
        interactive_agents=args.interactive,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
    )
    params = engine_params(args.kv_pool_tokens)
    sims = {
        (r, arm): simulate(scenario, arm, args.seed + r, params).as_dict()
        for r in range(args.repeats)
        for arm in ARMS
    }
    logs = Path(tempfile.mkdtemp(prefix="luftpause-mcp-flood-"))
    rows: list[dict[str, Any]] = []
    failed = False
    began = time.monotonic()
    for r in range(args.repeats):
        for arm in ARMS if r % 2 == 0 else tuple(reversed(ARMS)):
            print(
                f"mcp_flood [{time.monotonic() - began:5.0f} s] repeat {r + 1}/{args.repeats}, {arm}: "
                f"simulated {sims[r, arm]['interactive_runs_per_min']:g} interactive / "
                f"{sims[r, arm]['batch_runs_per_min']:g} batch runs/min; running...",
                file=sys.stderr,
                flush=True,
            )
            run_logs = logs / f"{r + 1}-{arm}"
            run_logs.mkdir()
            row: dict[str, Any] = {"repeat": r, "arm": arm, "sim": sims[r, arm]}
            try:
                row["real"] = real_arm(arm, args, f"{args.seed}-{r}", run_logs)
                row["counts"] = not row["real"]["saturated"]
                row["why_not"] = (
                    None if row["counts"] else "CPU saturated (" + row["real"]["saturation"] + ")"
                )
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
                failed = True
                row["real"] = {"failed": str(e)}
                row["counts"], row["why_not"] = False, "failed: " + str(e).splitlines()[0]
            rows.append(row)
            real = row["real"]
            print(
                f"mcp_flood [{time.monotonic() - began:5.0f} s]   done: interactive "
                f"{cell(real.get('interactive_runs_per_min'))}, batch {cell(real.get('batch_runs_per_min'))} runs/min"
                + (f", CPU {real['cpu_busy']:.0%} busy" if "cpu_busy" in real else "")
                + ("" if row["counts"] else f"; does not count: {row['why_not']}"),
                file=sys.stderr,
                flush=True,
            )
    summary = ratios(rows, ROUTER_ARM, args.repeats)
    summary["target"] = _target(summary)
    text = report(args, rows, summary)
    print(text)
    results.tidy_logs("mcp_flood", logs, failed)
    if not args.no_record:
        record = {
            **sglang_router.record_head(args, version),
            "rows": rows,
            "ratios": summary,
        }
        counted = [row for row in rows if row["counts"]]
        results.write_with_bars(
            "mcp_flood",
            record,
            text,
            "Sub-agents over MCP under a flood, real time: runs/min per repeat that counts",
            "runs/min",
            {
                f"{arm} {cls}": [row["real"][f"{cls}_runs_per_min"] for row in counted if row["arm"] == arm]
                for cls in ("interactive", "batch")
                for arm in ARMS
            },
            stream=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
