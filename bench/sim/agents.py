"""Simulated agents: closed-loop runs, each turn through an arm, each tool call a fixed wait.

An agent runs one run after another, for as long as the simulation lasts: a run opens with the
shared system prompt and a task with its own context (`loadgen.conversation`), sends a turn,
and while the reply is a tool call waits the tool's latency, appends the call and its answer and
sends the next turn. A text reply ends the run and the next one starts at once (after the
runtime's own work, in a scenario of sub-agents, `Overheads`). Replies come from
the fake engine's own rule (`compose_reply`) with the engine's parameters, so a simulated run and
a run through the HTTP fake engine say and cost the same. An agent that plans its tool calls
(`AgentSpec.plans_tool_calls`, the twin of `loadgen.agents` in front of a real model) asks for
text, draws its run's number of calls from its own seeded RNG and adds each call to the reply
(`loadgen.agents.planned_step`), as the real agents do.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from luftpause.bench.sim.arms import Arm
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.turns import SimTurn
from luftpause.fake_engine.engine import ModelRequest
from luftpause.fake_engine.prefix_cache import prompt_blocks, reply_block
from luftpause.fake_engine.protocol import reply_message
from luftpause.fake_engine.replies import MAX_TOOL_CALLS, compose_reply
from luftpause.loadgen.agents import planned_step
from luftpause.loadgen.conversation import MAX_TOKENS, TOOLS, first_messages, tool_result_message
from luftpause.scheduler.state import ServiceClass

SLOW_TOOL = "deep_search"
"""The tool of the load generator's two (`loadgen.conversation.TOOLS`) that a scenario may make slow
(`AgentSpec.slow_tool_s`): it searches several sources in depth; `lookup` answers a short fact."""


@dataclass(frozen=True)
class Overheads:
    """Fixed waits an agent adds around the engine's work (none for an own-loop agent)."""

    turn_s: float = 0.0
    """Before each turn after a run's first: the runtime journals the tool round, builds the body."""
    tool_s: float = 0.0
    """On each tool call, beyond the tool's own latency: the MCP round trip to the tool server."""
    run_s: float = 0.0
    """Between one run's answer and the next run's first turn: await returns, spawn, journal."""


@dataclass(frozen=True)
class AgentSpec:
    name: str
    service_class: ServiceClass
    caller: str
    context_chars: int
    tool_latency_s: float
    start_at: float
    seed: int
    streamed: bool = True
    overheads: Overheads = Overheads()
    max_tool_calls: int = MAX_TOOL_CALLS
    """The most tool calls a run makes (the engine's reply rule plans 1 to this many)."""
    max_tokens: int = MAX_TOKENS
    """The max_tokens each turn sends."""
    plans_tool_calls: bool = False
    """Whether the agent plans its runs' tool calls itself (1 to `max_tool_calls` a run)."""
    slow_tool_s: float | None = None
    """How long a call of the slow tool (`SLOW_TOOL`) takes, where it differs from the others'
    `tool_latency_s`; None: every tool takes `tool_latency_s`."""

    def tool_s(self, name: str) -> float:
        """How long a call of the tool `name` takes, the harness's own overheads included."""
        latency = (
            self.slow_tool_s if name == SLOW_TOOL and self.slow_tool_s is not None else self.tool_latency_s
        )
        return latency + self.overheads.tool_s + self.overheads.turn_s


@dataclass
class RunRecord:
    run_id: str
    service_class: ServiceClass
    started: float
    ended: float
    turns: int
    tool_calls: int
    replicas: tuple[str, ...]

    @property
    def moved(self) -> bool:
        return len(set(self.replicas)) > 1


@dataclass
class Agent:
    spec: AgentSpec
    arm: Arm
    clock: VirtualClock
    reply_tokens: int
    records: list[RunRecord] = field(default_factory=list)
    # Each turn's (time it was sent, time its first token came): how long it waited, anywhere.
    turn_waits: list[tuple[float, float]] = field(default_factory=list)
    # When each turn's reply was complete (what the real bench counts as a turn served).
    turn_ends: list[float] = field(default_factory=list)
    _runs: int = 0
    _turns: int = 0
    _planned: int = 0

    def start(self) -> None:
        self._rng = random.Random(f"{self.spec.seed}/{self.spec.name}")
        self.clock.at(self.spec.start_at, self._new_run)

    def _new_run(self) -> None:
        self._runs += 1
        self._run_id = f"{self.spec.name}-run{self._runs}"
        self._messages = first_messages(f"{self.spec.seed}/{self._run_id}", self.spec.context_chars)
        self._started = self.clock.now
        self._replicas: list[str] = []
        self._tool_calls = 0
        if self.spec.plans_tool_calls:
            self._planned = self._rng.randint(1, self.spec.max_tool_calls)
        self._send_turn()

    def _run_done(self) -> None:
        self.arm.run_ended(self._run_id)
        if self.spec.overheads.run_s:
            self.clock.after(self.spec.overheads.run_s, self._new_run)
        else:
            self._new_run()

    def _send_turn(self) -> None:
        # An agent that plans its calls is answered as the real bench's stand-in answers it
        # (bench/tool_model.py): a tool call while its plan has calls to make, then text.
        choice = None
        if self.spec.plans_tool_calls:
            choice = "required" if self._tool_calls < self._planned else "none"
        reply = compose_reply(
            self._messages,
            TOOLS,
            choice,
            self.spec.max_tokens,
            self.reply_tokens,
            self.spec.max_tool_calls,
        )
        blocks = prompt_blocks(self._messages, TOOLS)
        self._turns += 1
        turn_id = f"{self._run_id}-t{self._turns}"
        request = ModelRequest(
            turn_id,
            blocks,
            completion_tokens=reply.completion_tokens,
            max_tokens=self.spec.max_tokens,
            reply=reply_block(blocks, reply_message(reply)),
        )
        turn = SimTurn(
            turn_id=turn_id,
            run_id=self._run_id,
            service_class=self.spec.service_class,
            caller=self.spec.caller,
            index=len(self._replicas),
            request=request,
            reply=reply,
            on_done=self._turn_done,
            arrived_at=self.clock.now,
            streamed=self.spec.streamed,
            request_bytes=len(
                json.dumps({"messages": self._messages, "tools": TOOLS, "max_tokens": self.spec.max_tokens})
            ),
        )
        self.arm.send(turn)

    def _turn_done(self, turn: SimTurn) -> None:
        assert turn.replica is not None
        if turn.first_token_at is not None:
            self.turn_waits.append((turn.arrived_at, turn.first_token_at))
        self._replicas.append(turn.replica)
        self.turn_ends.append(self.clock.now)
        message = reply_message(turn.reply)
        if self.spec.plans_tool_calls and turn.reply.tool_call is None:
            if self._tool_calls < self._planned:
                text = {"content": message["content"]}
                message, call = planned_step(text, self._run_id, self._tool_calls, self._rng)
                self._tool_calls += 1
                self._messages.append(message)
                wait = self.spec.tool_s(str(call["function"]["name"]))
                result = tool_result_message(call)
                self.clock.after(wait, lambda: self._tool_returned(result))
                return
        elif turn.reply.tool_call is not None:
            self._tool_calls += 1
            self._messages.append(message)
            result = tool_result_message(message["tool_calls"][0])
            wait = self.spec.tool_s(turn.reply.tool_call.name)
            self.clock.after(wait, lambda: self._tool_returned(result))
            return
        self.records.append(
            RunRecord(
                self._run_id,
                self.spec.service_class,
                self._started,
                self.clock.now,
                len(self._replicas),
                self._tool_calls,
                tuple(self._replicas),
            )
        )
        self._run_done()

    def _tool_returned(self, result: dict) -> None:
        self._messages.append(result)
        self._send_turn()
