"""Routing at moderate load: 8 sub-agents in flight over MCP, placed by luftpause's affinity, the
SGLang router's cache-aware policy or its round robin, with the share of prompt tokens that the
engines served from their prefix caches.

Each arm gets a fresh stack (`bench.stack`: two fake engines with the calibrated KV pool and the
vLLM-flavoured /metrics, whose prefix-cache counters give the share; fake-mcp at 2 s a call; the
runtime) in front of luftpause or the real SGLang router from PyPI (`cache_aware` or
`round_robin`). One `luftpause loadgen --spawn-agents 8 --class interactive` process (one
caller) runs closed-loop sub-agents with the flood's 8000-character contexts. Counted over the
window after the warm-up: runs/min from loadgen, and the cache share from the engines' counters
read at the window's start and end. Arms are interleaved within each repeat, rotating; a window
with the CPUs saturated does not count (the fidelity harness's check). Record, table and PNG under
bench/results/.

    luftpause bench routing                  # 3 repeats, 20 s warm-up, 90 s windows, ~20 min
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
from pathlib import Path
from typing import Any

from luftpause.bench import results, sglang_router
from luftpause.bench import stack as stacks
from luftpause.bench.common import spread, spread_cell
from luftpause.bench.sim.scenarios import SCENARIOS

ARMS = ("luftpause", "sglang-cache-aware", "sglang-round-robin")
CPU_WINDOW_MARGIN_S = 0.5


def real_arm(arm: str, args: argparse.Namespace, seed: str, logs: Path) -> dict[str, Any]:
    with stacks.stack(arm, logs, metrics="vllm") as s:
        with (logs / "loadgen.log").open("wb") as err:
            load = subprocess.Popen(
                [
                    sys.executable, "-m", "luftpause", "--log-level", "WARNING", "loadgen",
                    "--runtime", s.runtime_url, "--spawn-agents", str(args.agents), "--class", "interactive",
                    "--duration-s", str(args.window_s), "--warmup-s", str(args.warmup_s),
                    "--context-chars", str(SCENARIOS["routing"].context_chars), "--seed", seed,
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )  # fmt: skip
        try:
            started = time.monotonic()
            time.sleep(args.warmup_s)
            s.procs.check_alive()
            window = stacks.CpuWindow(s, {"loadgen": load.pid})
            q0, h0 = stacks.prefix_cache_counters(s.engine_urls)
            time.sleep(
                max(started + args.warmup_s + args.window_s - CPU_WINDOW_MARGIN_S - time.monotonic(), 0)
            )
            q1, h1 = stacks.prefix_cache_counters(s.engine_urls)
            cpu = window.close()
            out, _ = load.communicate(timeout=120)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
        if load.returncode != 0 or not out.strip():
            raise RuntimeError(
                f"loadgen exited with {load.returncode}:\n{(logs / 'loadgen.log').read_text()[-2000:]}"
            )
        summary = json.loads(out.strip().splitlines()[-1])
    return {
        "runs_per_min": summary["runs_per_min"],
        "run_time_p50_s": summary["run_time_p50_s"],
        "errors": summary["errors"],
        "prefix_cache_share": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
        **cpu,
        "summary": summary,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench routing", description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=8, help="sub-agents in flight (default 8)")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=90.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    version = sglang_router.installed_version()
    if version is None:
        print("luftpause bench routing needs the SGLang router: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="luftpause-routing-"))
    rows: list[dict[str, Any]] = []
    failed = False
    began = time.monotonic()
    for r in range(args.repeats):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            run_logs = logs / f"{r + 1}-{arm}"
            run_logs.mkdir()
            row: dict[str, Any] = {"repeat": r, "arm": arm}
            try:
                row |= real_arm(arm, args, f"routing-{r}", run_logs)
                row["counts"] = not row["saturated"]
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
                failed = True
                row |= {"failed": str(e), "counts": False, "saturation": "failed: " + str(e).splitlines()[0]}
            rows.append(row)
            print(
                f"routing [{time.monotonic() - began:5.0f} s] repeat {r + 1}/{args.repeats} {arm}: "
                f"{row.get('runs_per_min')} runs/min, cache share {row.get('prefix_cache_share')}"
                + (f", CPU {row['cpu_busy']:.0%}" if "cpu_busy" in row else "")
                + ("" if row["counts"] else f"  (does not count: {row['saturation']})"),
                file=sys.stderr,
                flush=True,
            )
    per_arm: dict[str, dict[str, Any]] = {
        arm: {
            "runs_per_min": spread([x["runs_per_min"] for x in rows if x["arm"] == arm and x["counts"]]),
            "prefix_cache_share": spread(
                [
                    x["prefix_cache_share"]
                    for x in rows
                    if x["arm"] == arm and x["counts"] and x["prefix_cache_share"] is not None
                ]
            ),
            "counted": sum(1 for x in rows if x["arm"] == arm and x["counts"]),
        }
        for arm in ARMS
    }
    ours = per_arm["luftpause"]["prefix_cache_share"]["median"]
    aware = per_arm["sglang-cache-aware"]["prefix_cache_share"]["median"]
    rr = per_arm["sglang-round-robin"]["prefix_cache_share"]["median"]
    verdict = (
        "no verdict: an arm has no repeat that counts"
        if None in (ours, aware, rr)
        else f"{'met' if ours >= aware and ours > rr else 'not met'}: luftpause {ours:.1%}, "
        f"cache-aware {aware:.1%}, round robin {rr:.1%} (needs at least cache-aware's and above round robin's)"
    )
    labels = {
        "luftpause": "luftpause affinity",
        "sglang-cache-aware": "SGLang router, cache_aware",
        "sglang-round-robin": "SGLang router, round_robin",
    }
    lines = [
        f"Routing, {args.agents} sub-agents in flight over MCP, {args.window_s:g} s windows after {args.warmup_s:g} s, "
        f"{args.repeats} repeat(s), arms interleaved; sglang-router {version}",
        "",
        "| arm | runs/min, median (range) | prompt tokens from the prefix cache | repeats counted |",
        "|---|---|---|---|",
    ]
    for arm in ARMS:
        a = per_arm[arm]
        share = a["prefix_cache_share"]
        share_cell = (
            "-"
            if share["median"] is None
            else (f"{share['median']:.1%} ({share['low']:.1%}-{share['high']:.1%})")
        )
        lines.append(
            f"| {labels[arm]} | {spread_cell(a['runs_per_min'])} | {share_cell} | {a['counted']} of {args.repeats} |"
        )
    lines += ["", f"Cache share: {verdict}."]
    text = "\n".join(lines)
    print(text)
    results.tidy_logs("routing", logs, failed)
    if not args.no_record:
        record = {
            **sglang_router.record_head(args, version),
            "rows": rows,
            "per_arm": per_arm,
            "verdict": verdict,
        }
        results.write_with_bars(
            "routing",
            record,
            text,
            f"Routing, {args.agents} sub-agents in flight: share of prompt tokens from the prefix cache",
            "share of prompt tokens",
            {
                labels[arm]: [
                    x["prefix_cache_share"]
                    for x in rows
                    if x["arm"] == arm and x["counts"] and x["prefix_cache_share"] is not None
                ]
                for arm in ARMS
            },
            stream=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
