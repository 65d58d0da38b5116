"""The simulated scenarios: who floods the pool, with what, for how long.

- `flood`: 48 batch agents and 4 interactive ones, closed loop, 8000-character contexts, up to
  3 tool calls a run, on two replicas; measured over 3 simulated minutes (the description's
  window) after a minute of warm-up, so that the window sees the pool in its steady state and
  not the start, when every agent sends its first turn at once.
- `light`: the same with 2000-character contexts and 24 batch agents: the engines never queue.
- `routing`: 8 sub-agents in flight (interactive, one caller), 8000-character contexts: moderate
  load, where placement for the prefix cache is what differs between arms.

Tool calls take 2 s each, the fixed-latency mode of the fake MCP server used by benchmarks.
Agents start spread over the first 5 s (from the seed), as processes started together would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from luftpause.bench.sim.agents import AgentSpec
from luftpause.scheduler.state import ServiceClass

TOOL_LATENCY_S = 2.0
START_SPREAD_S = 5.0


@dataclass(frozen=True)
class Scenario:
    name: str
    batch_agents: int
    interactive_agents: int
    context_chars: int
    replicas: int = 2
    warmup_s: float = 60.0
    window_s: float = 180.0
    tool_latency_s: float = TOOL_LATENCY_S

    def agents(self, seed: int) -> list[AgentSpec]:
        rng = random.Random(seed)
        specs = []
        for cls, count, caller in (
            (ServiceClass.BATCH, self.batch_agents, "flood"),
            (ServiceClass.INTERACTIVE, self.interactive_agents, "user"),
        ):
            for i in range(count):
                specs.append(
                    AgentSpec(
                        name=f"{cls.value}{i}",
                        service_class=cls,
                        caller=caller,
                        context_chars=self.context_chars,
                        tool_latency_s=self.tool_latency_s,
                        start_at=rng.uniform(0.0, START_SPREAD_S),
                        seed=seed,
                    )
                )
        return specs


SCENARIOS: dict[str, Scenario] = {
    "flood": Scenario("flood", batch_agents=48, interactive_agents=4, context_chars=8000),
    "light": Scenario("light", batch_agents=24, interactive_agents=4, context_chars=2000),
    "routing": Scenario("routing", batch_agents=0, interactive_agents=8, context_chars=8000),
}
