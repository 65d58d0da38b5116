"""The flood against real llama.cpp engines: own-loop agents through four fronts, host cache on and off.

N `llama-server` replicas (default 2, `--parallel 4` slots of 4096 tokens each, one thread,
`--metrics --slots --jinja`) serve a small model written once by `bench.llamacpp_model` (or
`--model PATH`, any GGUF), all pinned to the first CPU (`taskset`); everything else (scheduler,
dataplane, router, proxy, and this process, which runs the agents) runs on the second, where the
machine has two or more. With the host cache `off` the engines run with `--cache-ram 0`; `on`
is llama-server's default (a host-memory cache of prompts evicted from the slots).

Closed-loop own-loop agents (`loadgen.agents`, 16 batch and 4 interactive by default) each run
one run after another: a context of about 8,000 characters, the tools in every turn's body,
luftpause's headers (run id, class, caller), `max_tokens` 32. The model's replies are random
text, so each agent decides its run's length: 1 to 3 tool calls drawn per run from a seeded RNG,
each taking 2 s, every reply appended with its tool call and the tool's result, then one more
turn ends the run (`LoadSpec.tool_calls`). In front of each engine, for every arm alike, a
stand-in (`bench.tool_model`, on the stack's CPU) gives the replies the form a real agent's model
would: a turn with calls still to make ends in `tool_calls`, the run's last in `stop`, the engine
having done all the work. Without it every turn ends in `length`, and a front that tells a run
paused on a tool from one that ended (luftpause) would see every run end after each turn. The
arms, each a fresh stack, interleaved within each repeat:

- `straight`: no front; each run pinned to one engine by a stable hash of its run id;
- `round-robin`: `bench.sim.round_robin_proxy`, turn by turn, class-blind;
- `sglang-router`: the real SGLang router (`bench.sglang_router`), cache_aware, class-blind;
- `luftpause`: the scheduler and dataplane, replicas `metrics = "llamacpp"`, `kv_slots` the
  engines' slots, `host_cache` as the engines run, `engine_priority = "none"` (llama.cpp has no
  priority queue: only admission orders the classes); runs end with `DELETE /v1/runs/{id}`.
- `luftpause-gated` (only when asked for, and only with the host cache on): the same, its
  replicas declared `host_cache = false` whatever the engines keep, so the run gate holds one
  run a slot as it does with the host cache off. It is the other setting of the gate, the point
  of the frontier (interactive against batch) that the default leaves out where the engines keep
  prefixes themselves; with the host cache off it is the `luftpause` arm and is not run twice.

Per arm and repeat: interactive runs/min and run time p50 and p99, batch and all runs/min, turns
served in the window, the engines' prompt-cache share in the window (the growth of
`llamacpp:prompt_tokens_cached_total` over that of cached plus `llamacpp:prompt_tokens_total`,
which counts only the tokens prefilled) and prefill seconds (`llamacpp:prompt_seconds_total`),
and the CPU check of the fidelity harness over the stack's CPU: a window in which that CPU was
more than 90 % busy (all work on it: the machine may be shared), or the container's quota was, or
a single-threaded Python process of the stack used 90 % of a core, does not count and is left
out of the medians. Then luftpause over `straight` and over `sglang-router` (medians over the
repeats that count both, lowest to highest) for interactive runs/min, interactive p50 (below 1
is better), batch runs/min and turns served. A progress line every 10 s; the record (JSON,
markdown) and a PNG (runs/min by class, per arm, host cache on and off) under bench/results/.

With `--agents mcp` the agents are sub-agents instead (`loadgen.subagents`'s closed-loop flood:
each agent spawns a run over MCP with the same opening, awaits it and spawns the next), one MCP
session a class; each arm then runs fake-mcp (every call `--tool-latency-s`) and the runtime,
its turns sent to the arm's front: `sglang-router` (the runtime straight to the router) or
`luftpause` (the runtime through the dataplane). The model's reply decides the run's length
there (the stand-in's plan), since the runtime loops as the model says.

    luftpause bench real_flood                      # 3 repeats x 8 stacks of 140 s: about an hour
    luftpause bench real_flood --repeats 1 --warmup-s 5 --window-s 30 --host-cache off   # ~3 min
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import cpu, llamacpp_model, results, sglang_router, stack_config
from luftpause.bench.common import Processes, free_port, spread, spread_cell, wait_healthy
from luftpause.bench.results import cell
from luftpause.loadgen.agents import LoadSpec, Tally, run_load
from luftpause.loadgen.subagents import FloodSpec, flood

ARMS = ("straight", "round-robin", "sglang-router", "luftpause")
# Over MCP the runtime sends its sub-agents' turns to a front: the router's or luftpause's.
MCP_ARMS = ("sglang-router", "luftpause")
# Arms run only when named: the gate's other setting with the host cache on (a frontier point).
GATED = "luftpause-gated"
OURS = ("luftpause", GATED)
BASELINES = ("straight", "sglang-router")
HOST_CACHE = ("on", "off")
MODEL_NAME = "flood-model"
"""The name every engine serves its model under (`--alias`), whatever the GGUF is."""
CLASSES = ("interactive", "batch")
RATIO_KEYS = ("interactive_runs_per_min", "interactive_p50_s", "batch_runs_per_min", "turns")
PROGRESS_EVERY_S = 10.0
METRICS_TIMEOUT_S = 60.0
COUNTERS = {
    "prompt_tokens": "llamacpp:prompt_tokens_total",
    "cached_tokens": "llamacpp:prompt_tokens_cached_total",
    "prefill_s": "llamacpp:prompt_seconds_total",
}
# The Python processes of a stack that run on one thread (the CPU check); the router is Rust on
# threads of its own and the engines are expected to be busy.
SINGLE_THREADED = ("scheduler", "dataplane", "proxy", "agents")


# -- the engines and where things run --


def find_llama_server(given: str | None = None) -> str | None:
    """`given` where it is an executable, else what tools/llamacpp.sh would print without building
    (`llamacpp_model.find_llama_server`: $LLAMA_SERVER, PATH, the cache); None when none is there."""
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    try:
        return llamacpp_model.find_llama_server()
    except FileNotFoundError:
        return None


def engine_command(
    binary: str,
    model: str,
    port: int,
    *,
    slots: int,
    slot_context: int,
    host_cache: bool,
    max_tokens: int,
    jinja: bool = True,
) -> list[str]:
    """The argv of one llama-server: `slots` slots of `slot_context` tokens, one thread, the
    /metrics and /slots endpoints, the model served as MODEL_NAME; `--cache-ram 0` without the
    host cache. `--n-predict` caps a reply at `max_tokens` even where a front renamed the field."""
    argv = [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_NAME,
        "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--threads", "1",
        "--n-predict", str(max_tokens), "--metrics", "--slots", "--no-webui",
        "--jinja" if jinja else "--no-jinja",
    ]  # fmt: skip
    if not host_cache:
        argv += ["--cache-ram", "0"]
    return argv


@dataclass(frozen=True)
class Cores:
    """Where the engines run and where the rest does; `taskset` prefixes for their commands."""

    engines: int | None
    stack: int | None

    @classmethod
    def split(cls, available: set[int]) -> Cores:
        """The first CPU of `available` for the engines, the second for the stack; no pinning on one."""
        cpus = sorted(available)
        return cls(cpus[0], cpus[1]) if len(cpus) >= 2 else cls(None, None)

    def engine_prefix(self) -> list[str]:
        return [] if self.engines is None else ["taskset", "-c", str(self.engines)]

    def stack_prefix(self) -> list[str]:
        return [] if self.stack is None else ["taskset", "-c", str(self.stack)]


def luftpause_config(
    directory: Path,
    engine_ports: Sequence[int],
    *,
    grpc: int,
    status: int,
    dataplane: int,
    host_cache: bool,
    slots: int,
) -> Path:
    """The luftpause arm's configuration: the scheduler, the dataplane, one llama.cpp replica per
    engine with its slots and host cache stated and no priority queue."""
    replicas = [
        stack_config.replica(
            f"llama-{chr(ord('a') + i)}",
            port,
            [MODEL_NAME],
            metrics="llamacpp",
            engine_priority="none",
            kv_slots=slots,
            host_cache=host_cache,
        )
        for i, port in enumerate(engine_ports)
    ]
    return stack_config.write(
        directory, stack_config.stack(grpc=grpc, status=status, dataplane=dataplane, replicas=replicas)
    )


def model_path(given: str | None, directory: Path) -> Path:
    """`given`, or the benchmark's own small model written into `directory`."""
    if given:
        return Path(given)
    return llamacpp_model.write(directory / "luftpause-random-llama.gguf")


# -- counters --


def parse_counters(text: str) -> dict[str, float]:
    """The llama.cpp counters this benchmark reads, from one engine's /metrics text."""
    wanted = {name: key for key, name in COUNTERS.items()}
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] += float(value)
    return out


async def read_counters(client: httpx.AsyncClient, engines: Sequence[str]) -> dict[str, float]:
    """The counters summed over the engines, read side by side. llama-server answers /metrics
    from its main loop, after the batch it is computing: seconds, on a busy shared core."""

    async def one(url: str) -> dict[str, float]:
        reply = await client.get(f"{url}/metrics", timeout=METRICS_TIMEOUT_S)
        reply.raise_for_status()
        return parse_counters(reply.text)

    total = dict.fromkeys(COUNTERS, 0.0)
    for counters in await asyncio.gather(*(one(url) for url in engines)):
        for key, value in counters.items():
            total[key] += value
    return total


def counter_window(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engines did in the window: prompt tokens prefilled and served from the cache, the
    cache's share of all prompt tokens, and seconds spent prefilling."""
    grew = {key: max(after[key] - before[key], 0.0) for key in COUNTERS}
    prompt = grew["prompt_tokens"] + grew["cached_tokens"]
    return {
        "prompt_tokens": int(prompt),
        "prefilled_tokens": int(grew["prompt_tokens"]),
        "cached_tokens": int(grew["cached_tokens"]),
        "cache_share": round(grew["cached_tokens"] / prompt, 3) if prompt else None,
        "prefill_s": round(grew["prefill_s"], 2),
    }


# -- one arm --


@dataclass
class ArmStack:
    arm: str
    procs: Processes
    engine_urls: list[str]
    """The engines themselves, where their counters are read."""
    serving_urls: list[str]
    """Where fronts and agents reach them: each engine's tool-calling stand-in."""
    front_url: str | None
    single_threaded: set[str] = field(default_factory=set)
    runtime_url: str | None = None
    """The runtime's MCP URL, with `--agents mcp`: its sub-agents' turns go to the front."""


@contextmanager
def arm_stack(
    arm: str,
    host_cache: bool,
    args: argparse.Namespace,
    binary: str,
    model: Path,
    cores: Cores,
    logs: Path,
) -> Iterator[ArmStack]:
    """Starts the arm's engines and front, waits until each answers, yields; stops them after."""
    py = [*cores.stack_prefix(), sys.executable, "-m", "luftpause", "--log-level", "WARNING"]
    procs = Processes(logs)
    single: set[str] = set()
    try:
        ports = [free_port() for _ in range(args.replicas)]
        for i, port in enumerate(ports):
            command = engine_command(
                binary,
                str(model),
                port,
                slots=args.slots,
                slot_context=args.slot_context,
                host_cache=host_cache,
                max_tokens=args.max_tokens,
            )
            procs.start(f"llama-{chr(ord('a') + i)}", [*cores.engine_prefix(), *command])
        engines = [f"http://127.0.0.1:{p}" for p in ports]
        for url in engines:
            wait_healthy(f"{url}/health", procs, timeout_s=120)
        # Every arm talks to the engines through the stand-in that makes their replies call
        # tools as the run's plan says (bench/tool_model.py): what fronts and agents see.
        real = engines
        ports = [free_port() for _ in real]
        calls = f"{args.min_tool_calls}-{args.max_tool_calls}"
        for i, (url, port) in enumerate(zip(real, ports, strict=True)):
            stand_in = [*cores.stack_prefix(), sys.executable, "-m", "luftpause.bench.tool_model"]
            name = f"tool-model-{chr(ord('a') + i)}"
            procs.start(name, [*stand_in, "--engine", url, "--port", str(port), "--tool-calls", calls])
            single.add(name)
        engines = [f"http://127.0.0.1:{p}" for p in ports]
        for url in engines:
            wait_healthy(f"{url}/health", procs)
        front = free_port()
        front_url = None if arm == "straight" else f"http://127.0.0.1:{front}"
        if arm == "round-robin":
            proxy = [*cores.stack_prefix(), sys.executable, "-m", "luftpause.bench.sim.round_robin_proxy"]
            procs.start("proxy", [*proxy, "--port", str(front), "--engines", ",".join(engines)])
            single.add("proxy")
            wait_healthy(f"{front_url}/health", procs)
        elif arm == "sglang-router":
            argv = sglang_router.command(front, engines, policy="cache_aware", prometheus_port=free_port())
            router = procs.start("router", [*cores.stack_prefix(), *argv])
            sglang_router.wait_ready(str(front_url), engines, alive=lambda: router.poll() is None)
        elif arm in OURS:
            conf = luftpause_config(
                logs,
                ports,
                grpc=free_port(),
                status=free_port(),
                dataplane=front,
                # The gated arm declares no host cache, so the gate holds a run a slot.
                host_cache=host_cache and arm != GATED,
                slots=args.slots,
            )
            procs.start("scheduler", [*py, "scheduler", "--config", str(conf)])
            procs.start("dataplane", [*py, "dataplane", "--config", str(conf)])
            single |= {"scheduler", "dataplane"}
            wait_healthy(f"{front_url}/health", procs)
        runtime_url = None
        if args.agents == "mcp":
            assert front_url is not None, "sub-agents need a front: straight is own-loop only"
            runtime_url = start_runtime(procs, py, logs, front_url, args.tool_latency_s)
            single |= {"runtime", "fake-mcp"}
        yield ArmStack(arm, procs, real, engines, front_url, single, runtime_url)
    finally:
        procs.stop()


def runtime_config(directory: Path, *, port: int, front_url: str, fake_mcp: int) -> Path:
    """The runtime's configuration for `--agents mcp`: its turns to `front_url` (the dataplane
    or the router), the flood's model as spawn's default, fake-mcp its one tool server."""
    runtime = {
        "port": port,
        "dataplane": front_url,
        "default_model": MODEL_NAME,
        "state_dir": str(directory / "runtime-state"),
        "mcp_servers": [{"name": "fake-mcp", "url": f"http://127.0.0.1:{fake_mcp}/mcp"}],
    }
    return stack_config.write(directory, {"runtime": runtime}, "runtime.toml")


def start_runtime(procs: Processes, py: list[str], logs: Path, front_url: str, tool_latency_s: float) -> str:
    """Starts fake-mcp (every call `tool_latency_s`) and the runtime in front of `front_url`;
    returns the runtime's MCP URL once it answers."""
    mcp_port, port = free_port(), free_port()
    procs.start(
        "fake-mcp", [*py, "fake-mcp", "--port", str(mcp_port), "--fixed-latency-s", str(tool_latency_s)]
    )
    wait_healthy(f"http://127.0.0.1:{mcp_port}/health", procs)
    conf = runtime_config(logs, port=port, front_url=front_url, fake_mcp=mcp_port)
    procs.start("runtime", [*py, "runtime", "--config", str(conf)])
    wait_healthy(f"http://127.0.0.1:{port}/status", procs)
    return f"http://127.0.0.1:{port}/mcp"


def specs(arm: str, s: ArmStack, args: argparse.Namespace, seed: str) -> dict[str, LoadSpec | FloodSpec]:
    """The agents of one arm, by class: own-loop agents, or with `--agents mcp` closed-loop
    spawners of sub-agents through the runtime (loadgen/subagents.py), one MCP session a class."""
    counts = {"interactive": args.interactive, "batch": args.batch}
    if s.runtime_url is not None:
        return {
            cls: FloodSpec(
                url=s.runtime_url,
                agents=counts[cls],
                duration_s=args.window_s,
                service_class=cls,
                context_chars=args.context_chars,
                seed=seed,
                warmup_s=args.warmup_s,
                # As the own-loop agents' turns: spawn's default (256) is 8x the replies' length.
                max_tokens=args.max_tokens,
            )
            for cls in CLASSES
            if counts[cls] > 0
        }
    return {
        cls: LoadSpec(
            url=s.front_url or s.serving_urls[0],
            agents=counts[cls],
            duration_s=args.window_s,
            service_class=cls,
            caller=f"flood-{cls}",
            context_chars=args.context_chars,
            tool_latency_s=args.tool_latency_s,
            model=MODEL_NAME,
            stream=True,
            seed=seed,
            warmup_s=args.warmup_s,
            max_tokens=args.max_tokens,
            tool_calls=(args.min_tool_calls, args.max_tool_calls),
            pin_urls=tuple(s.serving_urls) if arm == "straight" else (),
            end_runs=arm in OURS,
        )
        for cls in CLASSES
        if counts[cls] > 0
    }


def progress_line(label: str, elapsed: float, warmup_s: float, tallies: dict[str, Tally]) -> str:
    phase = "warming up" if elapsed < warmup_s else "counting"
    runs = ", ".join(f"{cls} {t.runs}" for cls, t in tallies.items())
    return (
        f"real_flood {label} [{elapsed:4.0f} s, {phase}] turns {sum(t.turns for t in tallies.values())}, "
        f"runs {runs}, in flight {sum(t.in_flight for t in tallies.values())}, "
        f"errors {sum(t.errors for t in tallies.values())}"
    )


async def drive(
    s: ArmStack, load: dict[str, LoadSpec | FloodSpec], args: argparse.Namespace, cores: Cores, label: str
) -> dict[str, Any]:
    """Runs the agents through the stack; the window's figures, counters and CPU use."""
    started = time.monotonic()
    tallies = {cls: Tally(started=started) for cls in load}
    tasks = {
        cls: asyncio.create_task(
            flood(spec, tallies[cls], progress_every_s=None)
            if isinstance(spec, FloodSpec)
            else run_load(spec, tallies[cls], progress_every_s=None)
        )
        for cls, spec in load.items()
    }
    window_start = started + args.warmup_s
    window_end = window_start + args.window_s - cpu.WINDOW_MARGIN_S
    pids = {name: p.pid for name, p in s.procs.procs.items()} | {"agents": os.getpid()}
    single = s.single_threaded | {"agents"}
    before: cpu.CpuSnapshot | None = None
    counters_before: dict[str, float] = {}
    engine_before: tuple[float, float] | None = None
    next_line = started + PROGRESS_EVERY_S
    async with httpx.AsyncClient() as client:
        while True:
            now = time.monotonic()
            if before is None and now >= window_start:
                before = cpu.snapshot(pids, None if cores.stack is None else {cores.stack})
                engine_before = cpu.cpu_jiffies({cores.engines}) if cores.engines is not None else None
                counters_before = await read_counters(client, s.engine_urls)
            if now >= window_end:
                break
            if now >= next_line:
                print(
                    progress_line(label, now - started, args.warmup_s, tallies), file=sys.stderr, flush=True
                )
                next_line += PROGRESS_EVERY_S
            s.procs.check_alive()
            failed = [t for t in tasks.values() if t.done() and t.exception() is not None]
            if failed:
                raise RuntimeError(f"the agents failed: {failed[0].exception()!r}")
            wake = min(next_line, window_end, window_start if before is None else window_end)
            await asyncio.sleep(min(max(wake - now, 0.05), 1.0))
        assert before is not None
        after = cpu.snapshot(pids, None if cores.stack is None else {cores.stack})
        engine_after = cpu.cpu_jiffies({cores.engines}) if cores.engines is not None else None
        counters = counter_window(counters_before, await read_counters(client, s.engine_urls))
    summaries = {cls: await task for cls, task in tasks.items()}
    s.procs.check_alive()
    use = cpu.cpu_use(before, after, single)
    if engine_before is not None and engine_after is not None:
        busy = (engine_after[0] - engine_before[0]) / max(engine_after[1] - engine_before[1], 1.0)
        use["engine_cpu_busy"] = round(busy, 3)
    return figures(summaries, args.window_s) | counters | use | {"summaries": summaries}


def figures(summaries: dict[str, dict[str, Any]], window_s: float) -> dict[str, Any]:
    """Runs/min by class and all, interactive run time, turns served and errors in the window."""

    def of(cls: str, key: str) -> Any:
        return summaries[cls][key] if cls in summaries else None

    runs = sum(x["runs"] for x in summaries.values())
    return {
        "interactive_runs_per_min": of("interactive", "runs_per_min") or 0.0,
        "interactive_p50_s": of("interactive", "run_time_p50_s"),
        "interactive_p99_s": of("interactive", "run_time_p99_s"),
        "batch_runs_per_min": of("batch", "runs_per_min") or 0.0,
        "all_runs_per_min": round(runs / (window_s / 60.0), 2),
        "turns": sum(x["turns"] for x in summaries.values()),
        "errors": sum(x["errors"] for x in summaries.values()),
    }


# -- medians, ratios, the report --


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per host cache and arm, each figure's median and spread over the rows that count."""
    keys = (*RATIO_KEYS, "interactive_p99_s", "all_runs_per_min", "cache_share", "prefill_s")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["host_cache"], {}).setdefault(row["arm"], {})
    for host, arms in out.items():
        for arm in arms:
            counted = [r["real"] for r in rows if (r["host_cache"], r["arm"]) == (host, arm) and r["counts"]]
            arms[arm] = {k: spread([r[k] for r in counted if r.get(k) is not None]) for k in keys}
    return out


def ratios(
    rows: list[dict[str, Any]], baseline: str, host_cache: str, arm: str = "luftpause"
) -> dict[str, Any]:
    """`arm` (one of ours) over `baseline` with the host cache `host_cache`: per repeat where both
    rows count (and the baseline finished an interactive run), each of RATIO_KEYS; then the
    median and spread of each."""
    per_repeat = []
    for r in sorted({row["repeat"] for row in rows}):
        of = {row["arm"]: row for row in rows if (row["repeat"], row["host_cache"]) == (r, host_cache)}
        ours, theirs = of.get(arm), of.get(baseline)
        if ours is None or theirs is None:
            continue
        entry: dict[str, Any] = {"repeat": r}
        for key in RATIO_KEYS:
            a, b = ours["real"].get(key), theirs["real"].get(key)
            entry[key] = round(a / b, 3) if a is not None and b else None
        left_out = [f"{row['arm']}: {row['why_not']}" for row in (ours, theirs) if not row["counts"]]
        if not left_out and entry["interactive_runs_per_min"] is None:
            left_out.append(f"{baseline} finished no interactive run")
        entry["counts"] = not left_out
        entry["why_not"] = "; ".join(left_out) or None
        per_repeat.append(entry)
    counted = [e for e in per_repeat if e["counts"]]
    summary: dict[str, Any] = {
        "arm": arm,
        "baseline": baseline,
        "host_cache": host_cache,
        "repeats": per_repeat,
    }
    summary["counted"] = len(counted)
    for key in RATIO_KEYS:
        summary[key] = spread([e[key] for e in counted if e[key] is not None])
    summary["verdict"] = verdict(summary)
    return summary


# The real-engine issue's targets for luftpause over each baseline, per host cache: the least
# ratio of each figure (the interactive p50's most: below 1 is faster). With the host cache on
# the engines keep prefixes themselves, so luftpause must win on order alone at no cost; with it
# off, at least what a naive gateway gate holding four runs a replica did (3x, 1.3x, 1.6x).
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "on": {
        "interactive_runs_per_min": (">=", 1.3),
        "interactive_p50_s": ("<=", 0.67),
        "batch_runs_per_min": (">=", 0.95),
        "turns": (">=", 1.0),
    },
    "off": {"interactive_runs_per_min": (">=", 3.0), "batch_runs_per_min": (">=", 1.3), "turns": (">=", 1.6)},
}


def target_verdict(summary: dict[str, Any]) -> str:
    """Whether the medians meet TARGETS for the summary's host cache: "met", or what missed."""
    missed = []
    for key, (sense, bound) in TARGETS[summary["host_cache"]].items():
        median = summary[key]["median"]
        if median is None or (median < bound if sense == ">=" else median > bound):
            missed.append(f"{key} {median if median is not None else '-'} (needs {sense} {bound})")
    return "met" if not missed else "not met: " + ", ".join(missed)


def verdict(summary: dict[str, Any]) -> str:
    """What the ratios say of luftpause against the baseline, in a few words, and the targets."""
    inter, batch = summary["interactive_runs_per_min"], summary["batch_runs_per_min"]
    if inter["median"] is None:
        return "no verdict: no repeat counted"
    if inter["low"] > 1:
        side = "interactive ahead in every counted repeat"
    elif inter["high"] < 1:
        side = "interactive behind in every counted repeat"
    else:
        side = "interactive mixed over the repeats"
    text = f"{side} ({inter['median']:.2f}x)"
    if batch["median"] is not None:
        text += f", batch {batch['median'] - 1:+.0%}"
    return f"{text}; targets {target_verdict(summary)}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def report(args: argparse.Namespace, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        f"The flood against real llama.cpp: {args.batch} batch + {args.interactive} interactive "
        f"{'sub-agents over MCP (the runtime in front of each arm)' if args.agents == 'mcp' else 'own-loop agents'} "
        f"({args.min_tool_calls}-{args.max_tool_calls} tool calls of {args.tool_latency_s:g} s a run, "
        f"~{args.context_chars} characters of context, max_tokens {args.max_tokens}), {args.replicas} llama-server "
        f"x {args.slots} slots of {args.slot_context} tokens; window {args.window_s:g} s after {args.warmup_s:g} s, "
        f"{args.repeats} repeat(s), arms interleaved; {summary['placement']}",
        "",
        "| repeat | host cache | arm | interactive runs/min | interactive p50 / p99 s | batch runs/min "
        "| all runs/min | turns | cache share | prefill s | errors | stack CPU | engine CPU | counts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        real = row["real"]
        lines.append(
            f"| {row['repeat'] + 1} | {row['host_cache']} | {row['arm']} | {cell(real.get('interactive_runs_per_min'))} | "
            f"{cell(real.get('interactive_p50_s'))} / {cell(real.get('interactive_p99_s'))} | "
            f"{cell(real.get('batch_runs_per_min'))} | {cell(real.get('all_runs_per_min'))} | "
            f"{cell(real.get('turns'))} | {_share(real.get('cache_share'))} | {cell(real.get('prefill_s'))} | "
            f"{cell(real.get('errors'))} | {_share(real.get('cpu_busy'))} | {_share(real.get('engine_cpu_busy'))} | "
            f"{'yes' if row['counts'] else 'no: ' + str(row['why_not'])} |"
        )
    lines += [
        "",
        "Medians over the repeats that count (lowest-highest):",
        "",
        "| host cache | arm | interactive runs/min | interactive p50 s | interactive p99 s | batch runs/min "
        "| turns | cache share | counted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for host, arms in summary["medians"].items():
        for arm, m in arms.items():
            lines.append(
                f"| {host} | {arm} | {spread_cell(m['interactive_runs_per_min'])} | "
                f"{spread_cell(m['interactive_p50_s'])} | {spread_cell(m['interactive_p99_s'])} | "
                f"{spread_cell(m['batch_runs_per_min'])} | {spread_cell(m['turns'])} | "
                f"{spread_cell(m['cache_share'])} | {m['interactive_runs_per_min']['n']} |"
            )
    lines += [
        "",
        "Each of our arms over each baseline, median (lowest-highest) over the repeats where both count "
        "(interactive p50: below 1 is faster):",
        "",
        "| host cache | arm | over | interactive runs/min | interactive p50 | batch runs/min | turns | counted | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["ratios"]:
        lines.append(
            f"| {r['host_cache']} | {r.get('arm', 'luftpause')} | {r['baseline']} | "
            f"{spread_cell(r['interactive_runs_per_min'])} | "
            f"{spread_cell(r['interactive_p50_s'])} | {spread_cell(r['batch_runs_per_min'])} | "
            f"{spread_cell(r['turns'])} | {r['counted']} of {len(r['repeats'])} | {r['verdict']} |"
        )
    left_out = [
        f"repeat {row['repeat'] + 1} {row['host_cache']} {row['arm']}: {row['why_not']}"
        for row in rows
        if not row["counts"]
    ]
    left_out += [
        f"repeat {e['repeat'] + 1} {r['host_cache']} against {r['baseline']}: {e['why_not']}"
        for r in summary["ratios"]
        for e in r["repeats"]
        if not e["counts"] and e["why_not"].endswith("finished no interactive run")
    ]
    if left_out:
        lines += ["", "Not counted: " + "; ".join(left_out) + "."]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Interactive and batch runs/min per arm (medians over the rows that count, a whisker from
    the lowest to the highest), one panel per host cache setting; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hosts = [h for h in HOST_CACHE if any(r["host_cache"] == h for r in rows)]
    if not hosts:
        return None
    fig, axes = plt.subplots(1, len(hosts), figsize=(5.5 * len(hosts), 3.6), squeeze=False)
    width = 0.38
    for ax, host in zip(axes[0], hosts, strict=True):
        arms = [a for a in (*ARMS, GATED) if any((r["host_cache"], r["arm"]) == (host, a) for r in rows)]
        for k, (cls, colour) in enumerate((("interactive", "#d9480f"), ("batch", "#495057"))):
            key = f"{cls}_runs_per_min"
            values = [
                [r["real"][key] for r in rows if (r["host_cache"], r["arm"]) == (host, a) and r["counts"]]
                for a in arms
            ]
            med = [statistics.median(v) if v else 0.0 for v in values]
            err = [[m - min(v) if v else 0 for m, v in zip(med, values, strict=True)],
                   [max(v) - m if v else 0 for m, v in zip(med, values, strict=True)]]  # fmt: skip
            xs = [i + (k - 0.5) * width for i in range(len(arms))]
            ax.bar(xs, med, width, yerr=err, capsize=3, color=colour, label=cls)
            for x, m in zip(xs, med, strict=True):
                ax.text(x, m, f"{m:.3g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(arms)), arms, fontsize=8)
        ax.set_ylabel("runs/min")
        ax.set_title(f"host cache {host}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("The flood against real llama.cpp: runs/min by class (repeats that count)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main --


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="luftpause bench real_flood", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="batch agents (default 16)")
    p.add_argument("--interactive", type=int, default=4, help="interactive agents (default 4)")
    p.add_argument("--replicas", type=int, default=2, help="llama-server replicas (default 2)")
    p.add_argument("--slots", type=int, default=4, help="each replica's --parallel slots (default 4)")
    p.add_argument("--slot-context", type=int, default=4096, help="tokens of context a slot (default 4096)")
    p.add_argument("--host-cache", choices=("on", "off", "both"), default="both")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="the agents' seed of repeat 1; repeat r adds r - 1")
    p.add_argument(
        "--arms",
        help=f"comma-separated (default {','.join(ARMS)}; with --agents mcp {','.join(MCP_ARMS)}; "
        f"either may add {GATED}, the gate holding a run a slot with the host cache on)",
    )
    p.add_argument(
        "--agents",
        choices=("own-loop", "mcp"),
        default="own-loop",
        help="own-loop agents (default), or sub-agents spawned and awaited over MCP through the runtime",
    )
    p.add_argument("--context-chars", type=int, default=8000)
    p.add_argument("--tool-latency-s", type=float, default=2.0)
    p.add_argument("--min-tool-calls", type=int, default=1)
    p.add_argument("--max-tool-calls", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--model", help="a GGUF to serve (default: bench/llamacpp_model.py's, written to a temp dir)"
    )
    p.add_argument("--llama-server", help="the llama-server binary (default: $LLAMA_SERVER, PATH, the cache)")
    p.add_argument("--no-record", action="store_true", help="do not write a record under bench/results/")
    return p


def arms_for(arms: Sequence[str], host: str) -> list[str]:
    """The arms run with the host cache `host`: the gated arm only where it is on (off, it is
    the luftpause arm's very stack)."""
    return [a for a in arms if a != GATED or host == "on"]


def main(argv: Sequence[str] | None = None) -> int:
    # A SIGTERM unwinds like an interrupt, so that every stack's processes are stopped on the way
    # out (before, they were left running); the handler before is put back afterwards.
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, before)


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    default = MCP_ARMS if args.agents == "mcp" else ARMS
    allowed = (*default, GATED)
    arms = [a.strip() for a in (args.arms or ",".join(default)).split(",") if a.strip()]
    if not arms or any(a not in allowed for a in arms) or args.repeats < 1:
        parser.error(
            f"arms must be among {', '.join(allowed)} (with --agents {args.agents}); repeats at least 1"
        )
    if not 0 <= args.min_tool_calls <= args.max_tool_calls:
        parser.error("--min-tool-calls must be between 0 and --max-tool-calls")
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print(
            "luftpause bench real_flood needs llama-server: tools/llamacpp.sh builds one (or pass --llama-server)",
            file=sys.stderr,
        )
        return 2
    version = sglang_router.installed_version() if "sglang-router" in arms else None
    if "sglang-router" in arms and version is None:
        print("the sglang-router arm needs the SGLang router: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    hosts = list(HOST_CACHE) if args.host_cache == "both" else [args.host_cache]
    cores = Cores.split(os.sched_getaffinity(0))
    if cores.stack is not None:
        os.sched_setaffinity(0, {cores.stack})  # the agents run here, beside the stack
    placement = (
        f"engines on CPU {cores.engines}, the rest on CPU {cores.stack}"
        if cores.stack is not None
        else "one CPU: nothing pinned"
    )
    work = Path(tempfile.mkdtemp(prefix="luftpause-real-flood-"))
    model = model_path(args.model, work)
    logs = work / "logs"
    logs.mkdir()
    rows: list[dict[str, Any]] = []
    failed = False
    began = time.monotonic()
    stacks = args.repeats * sum(len(arms_for(arms, host)) for host in hosts)
    print(
        f"real_flood: {stacks} stacks of {args.warmup_s + args.window_s:g} s; llama-server {binary}, "
        f"model {model}; {placement}",
        file=sys.stderr,
        flush=True,
    )
    try:
        for r in range(args.repeats):
            for host in hosts:
                these = arms_for(arms, host)
                for arm in these if r % 2 == 0 else list(reversed(these)):
                    label = f"repeat {r + 1}/{args.repeats}, host cache {host}, {arm}"
                    print(
                        f"real_flood [{time.monotonic() - began:5.0f} s] {label}: starting",
                        file=sys.stderr,
                        flush=True,
                    )
                    run_logs = logs / f"{r + 1}-{host}-{arm}"
                    run_logs.mkdir()
                    row: dict[str, Any] = {"repeat": r, "host_cache": host, "arm": arm}
                    try:
                        with arm_stack(arm, host == "on", args, binary, model, cores, run_logs) as s:
                            load = specs(arm, s, args, f"{args.seed + r}")
                            row["real"] = asyncio.run(drive(s, load, args, cores, label))
                        row["counts"] = not row["real"]["saturated"]
                        row["why_not"] = (
                            None if row["counts"] else "CPU saturated (" + row["real"]["saturation"] + ")"
                        )
                    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as e:
                        failed = True
                        row["real"] = {"failed": str(e)}
                        why = (str(e) or type(e).__name__).splitlines()[0]
                        row["counts"], row["why_not"] = False, "failed: " + why
                    rows.append(row)
                    real = row["real"]
                    print(
                        f"real_flood [{time.monotonic() - began:5.0f} s] {label}: interactive "
                        f"{cell(real.get('interactive_runs_per_min'))}, batch {cell(real.get('batch_runs_per_min'))} "
                        f"runs/min, {cell(real.get('turns'))} turns, cache share {_share(real.get('cache_share'))}"
                        + (f", stack CPU {real['cpu_busy']:.0%}" if "cpu_busy" in real else "")
                        + ("" if row["counts"] else f"; does not count: {row['why_not']}"),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if args.model is None:
            model.unlink(missing_ok=True)
    summary: dict[str, Any] = {
        "placement": placement,
        "medians": medians(rows),
        "ratios": [
            ratios(rows, baseline, host, ours)
            for host in hosts
            for ours in arms_for(arms, host)
            if ours in OURS
            for baseline in BASELINES
            if baseline in arms
        ],
    }
    text = report(args, rows, summary)
    print(text)
    results.tidy_logs("real_flood", logs, failed)
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    if not args.no_record:
        record = {
            "options": vars(args),
            "llama_server": {
                "binary": binary,
                "commands": {
                    host: engine_command(
                        "llama-server", "<model>", 0, slots=args.slots, slot_context=args.slot_context,
                        host_cache=host == "on", max_tokens=args.max_tokens,
                    )[1:]
                    for host in hosts
                },
            },
            "sglang_router": None if version is None else {"package": sglang_router.PACKAGE, "version": version},
            "rows": rows,
            **summary,
        }  # fmt: skip
        path = results.write("real_flood", record, text)
        png = plot(path.with_suffix(".png"), rows)
        print(f"record: {path}" + (f"\nplot: {png}" if png else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
