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

- `real-flood`: the twin of `bench/real_flood.py`, the flood against real llama.cpp: 16 batch and
  4 interactive own-loop agents on two llama-server replicas of 4 slots (`LLAMACPP_ONE_CORE`,
  its host cache on as llama-server's default; `--host-cache off` for `--cache-ram 0`), each
  agent planning its run's 1 to 3 tool calls itself around replies of max_tokens 32 (the real
  model's replies are random text), 8000-character contexts with the tools in every body,
  20 s of warm-up and a 120 s window; the real bench's arms by default.

Tool calls take 2 s each, the fixed-latency mode of the fake MCP server used by benchmarks.
`luftpause bench sim` can change a scenario's agents, contexts, tool calls and engines from its
command line (`cli.KNOBS`); the named scenarios here stay what the records were made with.
Agents start spread over the first 5 s (from the seed), as processes started together would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from luftpause.bench.sim.agents import AgentSpec, Overheads
from luftpause.fake_engine.params import LLAMACPP_ONE_CORE, EngineParams
from luftpause.fake_engine.replies import MAX_TOOL_CALLS
from luftpause.loadgen.conversation import MAX_TOKENS
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
    engine: EngineParams = EngineParams()
    """The engines' parameters (knobs apply on top): the calibrated SGLang replica by default."""
    priority_queue: bool = True
    """Whether the engines order their queue by priority, as the description's SGLang engines
    did (--enable-priority-scheduling); llama.cpp has no such queue."""
    max_tokens: int = MAX_TOKENS
    """The max_tokens every turn sends."""
    agents_plan_tool_calls: bool = False
    """Whether each agent draws its run's tool calls itself (1 to `max_tool_calls`) and adds them
    to the model's text replies, as `loadgen.agents` does in front of a real model whose replies
    are random text (`LoadSpec.tool_calls`); else the fake engine's replies make the calls."""
    slow_tool_s: float | None = None
    """How long a call of the slow tool (`agents.SLOW_TOOL`) takes where it differs from
    `tool_latency_s`, the other tool's; None: both take `tool_latency_s`."""
    arms: tuple[str, ...] = ()
    """The arms `bench sim` runs when none are named; empty: all of them."""

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
                        max_tokens=self.max_tokens,
                        plans_tool_calls=self.agents_plan_tool_calls,
                        slow_tool_s=self.slow_tool_s,
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

REAL_FLOOD_ARMS = ("straight", "router-round-robin", "sglang-cache-aware", "luftpause")
"""The real bench's arms, as the simulator names them: straight, round-robin, sglang-router
(its cache-aware policy) and luftpause."""

SCENARIOS["real-flood"] = Scenario(
    "real-flood",
    batch_agents=16,
    interactive_agents=4,
    context_chars=8000,
    warmup_s=20.0,
    window_s=120.0,
    engine=LLAMACPP_ONE_CORE,
    priority_queue=False,
    max_tokens=32,
    agents_plan_tool_calls=True,
    arms=REAL_FLOOD_ARMS,
)
