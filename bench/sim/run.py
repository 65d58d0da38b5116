"""One simulated run of a scenario under one arm, and what it measured.

Figures count runs that ended inside the measurement window (after the warm-up): runs a minute
by class, the median run time by class, how long turns waited for their first token (p50, p99), the share of prompt tokens served from the engines'
prefix caches during the window, and how many runs had turns on more than one replica.

What the engines did in the window, the engine model's eyes: of the continuation turns they
admitted (a run's turns after its first), the share of their own-run prompt tokens (all but the
leading blocks every run shares) found in the prefix cache; prefill time over busy time; busy
seconds per run ended; tokens evicted from the prefix caches. A turn admitted twice (preempted
and computed again) counts at each admission: both are work the engine did.
Every replica orders its waiting queue by the request's priority, as the description's SGLang
engines did (--enable-priority-scheduling); a request nobody marked keeps arrival order. A
scenario whose engines have no such queue (`Scenario.priority_queue`: llama.cpp) keeps arrival
order whatever the requests say. Turns served counts the turns whose reply was complete in the
window, as the real flood counts them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

from luftpause.bench.sim.agents import Agent
from luftpause.bench.sim.arms import ARMS, Arm
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.scenarios import Scenario
from luftpause.fake_engine.engine import ModelRequest
from luftpause.fake_engine.params import EngineParams
from luftpause.scheduler.state import ServiceClass

SHARED_PREFIX_BLOCKS = 2
"""The leading blocks of every run's prompt: the tool definitions and the system prompt
(`loadgen.conversation.first_messages`, keyed by `prefix_cache.prompt_blocks`). After them comes
the run's own: its task, then its replies and tool results."""

RUN_OPENING_BLOCKS = SHARED_PREFIX_BLOCKS + 1
"""A run's first turn: the shared blocks and the task. A prompt longer than that continues a run."""


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
    # The engine model's eyes (see the module's docstring); None where nothing was measured.
    continuation_prefix_hit: float | None
    prefill_share: float | None
    engine_s_per_run: float | None
    tokens_evicted: int
    preemptions: int
    """Running turns the engines preempted in the window (only engines with priority preemption do)."""
    wall_s: float
    turns: int = 0
    """Turns whose reply was complete in the window."""
    interactive_p99_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def simulate(
    scenario: Scenario,
    arm_name: str,
    seed: int,
    params: EngineParams | None = None,
    arm: type[Arm] | None = None,
) -> ArmResult:
    """`scenario` under the arm `arm_name` (or the class `arm`, for one not in `ARMS`: a setting of
    one that is) with workload `seed`, on engines of `params` (default: the scenario's)."""
    # The description's test bed ran SGLang with --enable-priority-scheduling in every row. Arms
    # that send no priority leave every request at the same value, so their order stays first
    # come, first served; only an arm that marks its turns sees the engine reorder them.
    engines = params or scenario.engine
    if scenario.priority_queue:
        engines = replace(engines, priority_scheduling=True)
    kind = arm if arm is not None else ARMS[arm_name]
    params = kind.engines(engines)
    wall = time.perf_counter()
    clock = VirtualClock()
    replicas = [SimReplica(f"fake-{chr(ord('a') + i)}", params, clock) for i in range(scenario.replicas)]
    front = kind(replicas, clock)
    agents = [Agent(spec, front, clock, params.reply_tokens) for spec in scenario.agents(seed)]
    window_start = scenario.warmup_s
    window_end = scenario.warmup_s + scenario.window_s
    max_waiting = 0
    # Own-run prompt tokens of the continuation turns admitted in the window, and of those the cached.
    continued = {"tokens": 0, "cached": 0}

    def admitted(request: ModelRequest, matched_blocks: int) -> None:
        if not window_start <= clock.now <= window_end or len(request.blocks) <= RUN_OPENING_BLOCKS:
            return
        continued["tokens"] += sum(b.tokens for b in request.blocks[SHARED_PREFIX_BLOCKS:])
        continued["cached"] += sum(b.tokens for b in request.blocks[SHARED_PREFIX_BLOCKS:matched_blocks])

    for replica in replicas:
        replica.engine.on_admit = admitted
    for agent in agents:
        agent.start()

    def watch() -> None:
        nonlocal max_waiting
        max_waiting = max(max_waiting, *(r.load().waiting for r in replicas))

    clock.every(1.0, watch, start=window_start)
    clock.run_until(window_start)
    before = [r.load() for r in replicas]
    work_before = [r.work() for r in replicas]
    clock.run_until(window_end)
    after = [r.load() for r in replicas]
    work_after = [r.work() for r in replicas]

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
    pairs = list(zip(work_after, work_before, strict=True))
    prefill_s = sum(a.prefill_s - b.prefill_s for a, b in pairs)
    busy_s = sum(a.busy_s - b.busy_s for a, b in pairs)
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
        continuation_prefix_hit=(
            round(continued["cached"] / continued["tokens"], 3) if continued["tokens"] else None
        ),
        prefill_share=round(prefill_s / busy_s, 3) if busy_s > 0 else None,
        engine_s_per_run=round(busy_s / len(records), 2) if records else None,
        tokens_evicted=sum(a.tokens_evicted - b.tokens_evicted for a, b in pairs),
        preemptions=sum(a.preempted - b.preempted for a, b in pairs),
        wall_s=round(time.perf_counter() - wall, 2),
        turns=sum(1 for a in agents for ended in a.turn_ends if window_start <= ended <= window_end),
        interactive_p99_s=(
            round(sorted(interactive)[min(len(interactive) - 1, int(0.99 * len(interactive)))], 1)
            if interactive
            else None
        ),
    )
