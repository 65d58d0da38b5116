"""The simulated scenarios: who floods the pool, with what, for how long.

- `flood`: 48 batch agents and 4 interactive ones, closed loop, 8000-character contexts, up to
  3 tool calls a run, on two replicas; measured over 3 simulated minutes (the description's
  window) after a minute of warm-up, so that the window sees the pool in its steady state and
  not the start, when every agent sends its first turn at once.
- `light`: the same with 2000-character contexts and 24 batch agents: the engines never queue.
- `routing`: 8 sub-agents in flight (interactive, one caller), 8000-character contexts: moderate
  load, where placement for the prefix cache is what differs between arms.
- `mcp-flood` and `mcp-light`: `flood` and `light` with the agents as sub-agents of the runtime
  (`loadgen --spawn-agents`): its turns are streamed as the own-loop agents' are (runtime/llm.py),
  so the scheduler hears of each first token as it comes; what differs is the runtime's own work
  between turns, on each tool call and between runs, added as fixed waits (`RUNTIME_OVERHEADS`).

Tool calls take 2 s each, the fixed-latency mode of the fake MCP server used by benchmarks.
`luftpause bench sim` can change a scenario's agents, contexts, tool calls and engines from its
command line (`cli.KNOBS`); the named scenarios here stay what the records were made with.
Agents start spread over the first 5 s (from the seed), as processes started together would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from luftpause.bench.sim.agents import AgentSpec, Overheads
from luftpause.fake_engine.replies import MAX_TOOL_CALLS
from luftpause.scheduler.state import ServiceClass

TOOL_LATENCY_S = 2.0
START_SPREAD_S = 5.0


RUNTIME_OVERHEADS = Overheads(turn_s=0.015, tool_s=0.012, run_s=0.05)
"""Measured on the real stack, one sub-agent at a time on idle engines (8 runs, 8000-character
contexts): a tool call took 2.008-2.016 s at the runtime against fake-mcp's fixed 2 s, and a
run's time from spawn to await's answer was 27-116 ms more than its turns' and tool calls' time
(2 to 4 turns a run), split here between the turns and the run's start."""


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
    streamed: bool = True
    """Whether turns are streamed (own-loop agents here and the runtime: yes; False models a
    client that reads each reply whole, whose first token the scheduler hears of as it ends)."""
    overheads: Overheads = Overheads()
    max_tool_calls: int = MAX_TOOL_CALLS
    """The most tool calls a run makes; each run makes 1 to this many (the fake engine's rule)."""

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
                        streamed=self.streamed,
                        overheads=self.overheads,
                        max_tool_calls=self.max_tool_calls,
                    )
                )
        return specs


SCENARIOS: dict[str, Scenario] = {
    "flood": Scenario("flood", batch_agents=48, interactive_agents=4, context_chars=8000),
    "light": Scenario("light", batch_agents=24, interactive_agents=4, context_chars=2000),
    "routing": Scenario("routing", batch_agents=0, interactive_agents=8, context_chars=8000),
}
for _own_loop in ("flood", "light"):
    SCENARIOS[f"mcp-{_own_loop}"] = replace(
        SCENARIOS[_own_loop], name=f"mcp-{_own_loop}", overheads=RUNTIME_OVERHEADS
    )
