"""A stack for the sub-agent benchmarks: the runtime in front of one of three fronts, as processes.

Each benchmark arm gets fresh processes on ports picked free: fake engines (the calibrated model,
`fidelity.engine_params`: priority scheduling on, the KV pool given), the fake MCP tool server
with every call taking a fixed time, the runtime with that server as its only tool server, and
between the runtime and the engines one front:

- `luftpause`: the real scheduler and dataplane, the engines declared `engine_priority =
  "sglang"` (the dataplane writes each turn's class into its request, as the simulator's
  `luftpause` arm does);
- `sglang-cache-aware` and `sglang-round-robin`: the real SGLang router from PyPI
  (`bench.sglang_router`) with that policy; the runtime's turns go straight to it (it drops the
  `x-luftpause-*` headers, so nothing there sees a class, and it answers the runtime's run end,
  `DELETE /v1/runs/{id}`, with 404, which the runtime ignores).

With `single_pass=True` a third fake engine is started as a single-pass replica (`kind =
"single-pass"`), for `/v1/decide` (luftpause front only). The processes, their logs and the
CPU check are the fidelity harness's (`bench.sim.fidelity`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import cpu, sglang_router, stack_config
from luftpause.bench.common import Processes, free_port, wait_healthy
from luftpause.bench.sim.fidelity import engine_params, timing_env
from luftpause.config import DEFAULT_MODEL

FRONTS = ("luftpause", "sglang-cache-aware", "sglang-round-robin")
ROUTER_POLICY = {"sglang-cache-aware": "cache_aware", "sglang-round-robin": "round_robin"}
SINGLE_PASS_MODEL = "fake-classifier"
# The single-threaded Python processes of a stack, for the CPU check (the router is Rust on
# threads of its own: only the machine-wide figures apply to it).
SINGLE_THREADED = ("scheduler", "dataplane", "runtime", "fake-mcp")


@dataclass
class Stack:
    front: str
    procs: Processes
    runtime_url: str
    """The runtime's MCP URL (nothing answers there when the stack was started without it)."""
    front_url: str
    engine_urls: list[str]
    status_url: str | None = None
    single_pass_url: str | None = None
    single_threaded: set[str] = field(default_factory=set)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.procs.items()}


def _config(
    directory: Path,
    metrics: str,
    engines: list[int],
    grpc: int,
    status: int,
    dataplane: int,
    runtime: int,
    front_url: str,
    fake_mcp: int,
    single_pass: int | None,
    single_pass_lookahead: int | None = None,
) -> Path:
    # The fake engines order their queues higher priority first, as SGLang does.
    priority = "sglang" if metrics == "sglang" else "none"
    replicas = [
        stack_config.replica(
            f"fake-{chr(ord('a') + i)}", port, [DEFAULT_MODEL], metrics=metrics, engine_priority=priority
        )
        for i, port in enumerate(engines)
    ]
    if single_pass is not None:
        lookahead = {} if single_pass_lookahead is None else {"lookahead": single_pass_lookahead}
        replicas.append(
            stack_config.replica(
                "classifier", single_pass, [SINGLE_PASS_MODEL], kind="single-pass", **lookahead
            )
        )
    tables = stack_config.stack(
        grpc=grpc,
        status=status,
        dataplane=dataplane,
        runtime=runtime,
        runtime_dataplane=front_url,
        state_dir=directory / "state",
        tool_server={"name": "fake-mcp", "url": f"http://127.0.0.1:{fake_mcp}/mcp"},
        replicas=replicas,
    )
    return stack_config.write(directory, tables)


@contextmanager
def stack(
    front: str,
    logs: Path,
    *,
    replicas: int = 2,
    kv_pool_tokens: int = 16384,
    tool_latency_s: float = 2.0,
    single_pass: bool = False,
    metrics: str = "sglang",
    runtime: bool = True,
    single_pass_lookahead: int | None = None,
) -> Iterator[Stack]:
    """Starts the processes, waits until each answers, yields the stack; stops it on the way out.

    `metrics` is the engines' /metrics flavour: "vllm" has the prefix-cache counters
    (`prefix_cache_share` reads them), and luftpause's replicas are then told no priorities."""
    if front not in FRONTS:
        raise ValueError(f"unknown front {front}; known: {', '.join(FRONTS)}")
    py = [sys.executable, "-m", "luftpause", "--log-level", "WARNING"]
    procs = Processes(logs)
    single_threaded: set[str] = set()
    try:
        timing = {"LUFTPAUSE_FAKE_ENGINE_TIMING": timing_env(engine_params(kv_pool_tokens))}
        engine_ports = [free_port() for _ in range(replicas)]
        for i, port in enumerate(engine_ports):
            name = f"fake-{chr(ord('a') + i)}"
            procs.start(
                name,
                [*py, "fake-engine", "--name", name, "--port", str(port), "--metrics", metrics],
                timing,
            )
            single_threaded.add(name)
        sp_port = free_port() if single_pass else None
        if sp_port is not None:
            procs.start(
                "classifier",
                [
                    *py,
                    "fake-engine",
                    "--name",
                    "classifier",
                    "--port",
                    str(sp_port),
                    "--model",
                    SINGLE_PASS_MODEL,
                ],
            )
        mcp_port = free_port()
        procs.start(
            "fake-mcp", [*py, "fake-mcp", "--port", str(mcp_port), "--fixed-latency-s", str(tool_latency_s)]
        )
        engines = [f"http://127.0.0.1:{p}" for p in engine_ports]
        for url in engines + ([f"http://127.0.0.1:{sp_port}"] if sp_port else []):
            wait_healthy(f"{url}/health", procs)
        front_port, runtime_port = free_port(), free_port()
        front_url = f"http://127.0.0.1:{front_port}"
        grpc, status = free_port(), free_port()
        conf = _config(
            logs,
            metrics,
            engine_ports,
            grpc,
            status,
            front_port,
            runtime_port,
            front_url,
            mcp_port,
            sp_port,
            single_pass_lookahead,
        )
        status_url = None
        if front == "luftpause":
            procs.start("scheduler", [*py, "scheduler", "--config", str(conf)])
            procs.start("dataplane", [*py, "dataplane", "--config", str(conf)])
            wait_healthy(f"{front_url}/health", procs)
            status_url = f"http://127.0.0.1:{status}"
        else:
            argv = sglang_router.command(
                front_port, engines, policy=ROUTER_POLICY[front], prometheus_port=free_port()
            )
            router = procs.start("router", argv)
            sglang_router.wait_ready(front_url, engines, alive=lambda: router.poll() is None)
        if runtime:
            procs.start("runtime", [*py, "runtime", "--config", str(conf)])
            wait_healthy(f"http://127.0.0.1:{runtime_port}/status", procs)
        single_threaded |= {name for name in SINGLE_THREADED if name in procs.procs}
        yield Stack(
            front=front,
            procs=procs,
            runtime_url=f"http://127.0.0.1:{runtime_port}/mcp",
            front_url=front_url,
            engine_urls=engines,
            status_url=status_url,
            single_pass_url=f"http://127.0.0.1:{sp_port}" if sp_port else None,
            single_threaded=single_threaded,
        )
    finally:
        procs.stop()


def _counter_totals(url: str, names: tuple[str, ...]) -> list[float]:
    """Per name, the sum of the engine's /metrics lines that start with it (over their labels)."""
    totals = [0.0] * len(names)
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        for i, name in enumerate(names):
            if line.startswith(name):
                totals[i] += float(line.rsplit(" ", 1)[1])
                break
    return totals


def prefix_cache_counters(engine_urls: list[str]) -> tuple[float, float]:
    """(prompt tokens queried, of them served from the prefix cache) summed over the engines,
    from their vLLM-flavoured /metrics counters."""
    queries = hits = 0.0
    for url in engine_urls:
        q, h = _counter_totals(url, ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
        queries, hits = queries + q, hits + h
    return queries, hits


def generation_tokens(engine_urls: list[str]) -> list[float]:
    """Each engine's generated tokens so far, from its SGLang-flavoured /metrics counter."""
    return [_counter_totals(url, ("sglang:generation_tokens_total",))[0] for url in engine_urls]


class CpuWindow:
    """The fidelity harness's CPU check over one measured window of a stack and its load."""

    def __init__(self, s: Stack, loads: dict[str, int] | None = None) -> None:
        self.pids = s.pids() | (loads or {})
        self.single_threaded = s.single_threaded | set(loads or {})
        self.before = cpu.snapshot(self.pids)

    def close(self) -> dict[str, Any]:
        """CPU busy share, each process's cores, and whether the window was saturated (and why)."""
        return cpu.cpu_use(self.before, cpu.snapshot(self.pids), self.single_threaded)
