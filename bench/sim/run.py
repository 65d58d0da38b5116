"""One simulated run of a scenario under one arm, and what it measured.

Figures count runs that ended inside the measurement window (after the warm-up): runs a minute
by class, the median run time by class, how long turns waited for their first token (p50, p99), the share of prompt tokens served from the engines'
prefix caches during the window, and how many runs had turns on more than one replica.
Every replica orders its waiting queue by the request's priority, as the description's SGLang
engines did (--enable-priority-scheduling); a request nobody marked keeps arrival order.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

from luftpause.bench.sim.agents import Agent
from luftpause.bench.sim.arms import ARMS
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.scenarios import Scenario
from luftpause.fake_engine.params import EngineParams
from luftpause.scheduler.state import ServiceClass


@dataclass(frozen=True)
class ArmResult:
    name: str
    interactive_runs_per_min: float
    interactive_p50_s: float | None
    batch_runs_per_min: float
    batch_p50_s: float | None
    # From sending a turn to its first token (held by the arm, queued in the engine, prefilled),
    # p50 and p99 over the turns whose first token came in the window.
    interactive_wait_p50_s: float | None
    interactive_wait_p99_s: float | None
    batch_wait_p50_s: float | None
    prefix_cache_hit_rate: float
    runs_moved: int
    runs: int
    max_waiting: int
    wall_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def simulate(scenario: Scenario, arm_name: str, seed: int, params: EngineParams | None = None) -> ArmResult:
    # The description's test bed ran SGLang with --enable-priority-scheduling in every row. Arms
    # that send no priority leave every request at the same value, so their order stays first
    # come, first served; only an arm that marks its turns sees the engine reorder them.
    params = replace(params or EngineParams(), priority_scheduling=True)
    wall = time.perf_counter()
    clock = VirtualClock()
    replicas = [SimReplica(f"fake-{chr(ord('a') + i)}", params, clock) for i in range(scenario.replicas)]
    arm = ARMS[arm_name](replicas, clock)
    agents = [Agent(spec, arm, clock, params.reply_tokens) for spec in scenario.agents(seed)]
    for agent in agents:
        agent.start()
    window_start = scenario.warmup_s
    window_end = scenario.warmup_s + scenario.window_s
    max_waiting = 0

    def watch() -> None:
        nonlocal max_waiting
        max_waiting = max(max_waiting, *(r.load().waiting for r in replicas))

    clock.every(1.0, watch, start=window_start)
    clock.run_until(window_start)
    before = [r.load() for r in replicas]
    clock.run_until(window_end)
    after = [r.load() for r in replicas]

    records = [r for a in agents for r in a.records if window_start <= r.ended <= window_end]
    minutes = scenario.window_s / 60.0

    def of(cls: ServiceClass) -> list[float]:
        return [r.ended - r.started for r in records if r.service_class is cls]

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 1) if values else None

    def waits(cls: ServiceClass) -> list[float]:
        return sorted(
            first - sent
            for a in agents
            if a.spec.service_class is cls
            for sent, first in a.turn_waits
            if window_start <= first <= window_end
        )

    def quantile(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None

    interactive_waits, batch_waits = waits(ServiceClass.INTERACTIVE), waits(ServiceClass.BATCH)
    queries = sum(a.prefix_queries_total - b.prefix_queries_total for a, b in zip(after, before, strict=True))
    hits = sum(a.prefix_hits_total - b.prefix_hits_total for a, b in zip(after, before, strict=True))
    interactive, batch = of(ServiceClass.INTERACTIVE), of(ServiceClass.BATCH)
    return ArmResult(
        name=arm_name,
        interactive_runs_per_min=round(len(interactive) / minutes, 1),
        interactive_p50_s=median(interactive),
        batch_runs_per_min=round(len(batch) / minutes, 1),
        batch_p50_s=median(batch),
        interactive_wait_p50_s=quantile(interactive_waits, 0.5),
        interactive_wait_p99_s=quantile(interactive_waits, 0.99),
        batch_wait_p50_s=quantile(batch_waits, 0.5),
        prefix_cache_hit_rate=round(hits / queries, 3) if queries else 0.0,
        runs_moved=sum(1 for r in records if r.moved),
        runs=len(records),
        max_waiting=max_waiting,
        wall_s=round(time.perf_counter() - wall, 2),
    )
