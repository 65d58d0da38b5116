"""The arms of a simulated benchmark: who decides which replica a turn goes to, and when.

- `straight`: no front: each run pinned to one replica by a stable hash of its run id, as the
  real flood's agents talk to engines directly (`loadgen.agents.pinned`).
- `router-round-robin`: a class-blind router sending each request to the next replica in turn.
- `sglang-cache-aware`: the SGLang router's cache-aware policy as documented. The router keeps
  an approximate prefix tree per worker of the requests it sent there. When the load is
  imbalanced (the busiest worker has more than 64 requests in flight over the idlest and more
  than 1.5 times as many), the request goes to the idlest worker. Otherwise it goes to the
  worker whose tree matches the largest share of the request's text, if that share exceeds 0.3,
  else to the worker with the fewest requests in flight (the first on a tie), as sglang-router
  0.3.2 does (older releases and its documentation: the worker with the smallest tree; see
  bench/sglang_router.py for how this was checked against the real router). Our tree is over
  whole messages rather than characters, which differs only inside a message two requests
  share a beginning of, and never evicts (a run of minutes stays far below the router's limit).
- `sglang-sticky`: the router's sticky sessions (manual policy, routing key = run id): a key's
  first request goes to the worker with the fewest requests in flight, the rest follow it.
- `luftpause`: the scheduler's own `decide`, fed what the dataplane, the prober and the clock
  would feed it: the pool, a probe of each replica's engine load (and its KV pool and host
  tier, as SGLang's /get_server_info says them) every 2 s, a tick every 1 s, each turn's
  arrival (with its body's size and max_tokens), start, first token and completion (with its
  usage and tool-call ids), and the end of each run. A held turn waits until an action places
  it. Its replicas are configured as their engines run: on slot engines (llama.cpp) with
  `kv_slots` their slots and `host_cache` whether they keep a host tier (which llama.cpp does
  not say), and engines with no priority queue are sent no priorities (`engine_priority =
  "none"`), as the real flood's config says.
- `luftpause-no-run-gate`: the same on replicas whose KV pool nobody told it (an engine whose
  probe cannot read it, no `kv_tokens` in the config): turns are admitted by the lookahead alone
  and paused runs keep their replica however long their tools take, as before the run gate.
- `luftpause-gate-always`: the gate holding runs however few of them the pool keeps warm
  (`gate_min_runs = 1`): the ablation that shows where holding them stops paying.
- `luftpause-gated`: on engines with a host tier, replicas declared without one, so the run gate
  holds runs as it does where the pool is all there is (on slot engines, one run a slot): the
  gate's other setting, as the real flood's arm of that name.
- `luftpause-keep-by-caller`: completions that name no tool, so a paused run keeps its place for
  what all of its caller's pauses say rather than its tool's (`gate.pauses_on`): the gate's keep
  time as it was before tools were told apart. It differs only where tools differ
  (`--slow-tool-s`).
- `luftpause-no-engine-priority`: the same on engines that are not told priorities (llama.cpp,
  or an SGLang replica not declared `engine_priority`): luftpause's own queue is all the
  reordering there is.
- `luftpause-no-load-metrics`: the same, on replicas configured `metrics = "none"` (Ollama, a
  hosted API): probes read health only, so the lookahead is kept by first tokens alone, and no
  engine priorities are sent (such engines take none).
- `luftpause-no-load-metrics-uncapped`: those replicas with `lookahead = 0`, which is what the
  description did with engines that report no load: never capped.
- `luftpause-free-moving`: the same core with strict run affinity off. The core has no switch
  for that, so the arm makes every run idle before each of its turns by reporting the run ended
  just before the turn arrives: the core sees a run it does not know, free to go anywhere. A
  paused interactive run still counts as paused while its tool runs, so batch still keeps its
  room; only where it comes back to changes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

from luftpause.bench.sglang_router import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.turns import SimTurn
from luftpause.config import DEFAULT_MODEL, GATE_MIN_RUNS, LOOKAHEAD
from luftpause.dataplane import headers
from luftpause.dataplane.priority import Convention, priority_for
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.prefix_cache import Block
from luftpause.loadgen.agents import pinned
from luftpause.scheduler.actions import Place, Refuse
from luftpause.scheduler.core import decide
from luftpause.scheduler.events import (
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    Tick,
    TurnArrived,
    TurnCompleted,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, State

PROBE_PERIOD_S = 2.0
TICK_S = 1.0


class Arm(abc.ABC):
    """Sends turns to replicas; subclasses decide where."""

    name = ""

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.order = [r.name for r in replicas]
        self.clock = clock
        self.in_flight: Counter[str] = Counter()

    @classmethod
    def engines(cls, params: EngineParams) -> EngineParams:
        """The parameters of this arm's engines, from the scenario's: the same, unless the arm is
        a configuration of the engines too (a peer that turns on their priority preemption)."""
        return params

    @abc.abstractmethod
    def send(self, turn: SimTurn) -> None:
        """Places the turn now, or later (an arm that holds turns)."""

    def run_ended(self, run_id: str) -> None:
        """The agent finished a run (and starts the next at once); routers keep nothing per run."""
        return None

    def _dispatch(
        self, turn: SimTurn, replica: str, on_first_token: Callable[[], None] | None = None
    ) -> None:
        turn.replica = replica
        self.in_flight[replica] += 1

        def first_token() -> None:
            turn.first_token_at = self.clock.now
            if on_first_token is not None:
                on_first_token()

        def done() -> None:
            self.in_flight[replica] -= 1
            self._finished(turn)
            turn.on_done(turn)

        self.replicas[replica].submit(turn.request, first_token, done)

    def _finished(self, turn: SimTurn) -> None:
        """Hook: the turn's reply is complete (before the agent reacts to it); routers hear nothing."""
        return None


class Straight(Arm):
    name = "straight"

    def send(self, turn: SimTurn) -> None:
        self._dispatch(turn, self.order[pinned(turn.run_id, len(self.order))])


class RoundRobin(Arm):
    name = "router-round-robin"

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self._next = 0

    def send(self, turn: SimTurn) -> None:
        replica = self.order[self._next % len(self.order)]
        self._next += 1
        self._dispatch(turn, replica)


def matched_tokens(tree: set[bytes], blocks: Sequence[Block]) -> int:
    """How many of a request's leading tokens a router's prefix tree of earlier requests holds."""
    matched = 0
    for block in blocks:
        if block.key not in tree:
            break
        matched += block.tokens
    return matched


class CacheAware(Arm):
    name = "sglang-cache-aware"

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self._trees: dict[str, set[bytes]] = {name: set() for name in self.order}

    def send(self, turn: SimTurn) -> None:
        loads = [self.in_flight[name] for name in self.order]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > BALANCE_ABS_THRESHOLD and busiest > idlest * BALANCE_REL_THRESHOLD:
            choice = min(self.order, key=lambda name: self.in_flight[name])
        else:
            total = sum(b.tokens for b in turn.request.blocks) or 1
            best, best_rate = self.order[0], -1.0
            for name in self.order:
                matched = matched_tokens(self._trees[name], turn.request.blocks)
                if matched / total > best_rate:
                    best, best_rate = name, matched / total
            if best_rate > CACHE_THRESHOLD:
                choice = best
            else:
                # sglang-router 0.3.2 sends a request no tree matches to the worker with the
                # fewest in flight (older releases: the smallest tree); see bench/sglang_router.py.
                choice = min(self.order, key=lambda name: self.in_flight[name])
        tree = self._trees[choice]
        for block in turn.request.blocks:
            tree.add(block.key)
        self._dispatch(turn, choice)


class Sticky(Arm):
    name = "sglang-sticky"

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self._pins: dict[str, str] = {}

    def send(self, turn: SimTurn) -> None:
        replica = self._pins.get(turn.run_id)
        if replica is None:
            replica = min(self.order, key=lambda name: self.in_flight[name])
            self._pins[turn.run_id] = replica
        self._dispatch(turn, replica)

    def run_ended(self, run_id: str) -> None:
        self._pins.pop(run_id, None)


class Luftpause(Arm):
    name = "luftpause"
    strict_affinity = True
    # What the replicas are configured with: whether their engines report load (metrics), and
    # their lookahead (None: the default).
    reports_load = True
    lookahead: int | None = None
    # The simulated engines order their queues by priority, as SGLang with
    # --enable-priority-scheduling, so luftpause's replicas say so; an engine without load
    # metrics (Ollama, a hosted API) is taken to have no priorities either.
    engine_priority: Convention = "sglang"
    # Whether its probes read the engine's KV pool (SGLang's /get_server_info does): the run gate
    # is on only where they do.
    reads_kv = True
    # The gate's fewest runs a pool must keep warm (None: the default, config.GATE_MIN_RUNS).
    gate_min_runs: int | None = None
    # Whether its replicas are configured as their engines keep a host tier: on slot engines
    # (llama.cpp, which does not say) the config says what they run, and on shared-pool engines
    # the config says nothing and their probes say it, as SGLang's /get_server_info does. False:
    # every replica's config says it keeps none (`luftpause-gated`), and the probes are not asked.
    declares_host_cache = True
    # Whether each completion names the tools its reply called, as the dataplane reports them
    # (False: none named, so a paused run keeps its place by all of its caller's pauses).
    reports_tool_names = True

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self.state = State()
        self._held: dict[str, SimTurn] = {}
        self._known_runs: set[str] = set()
        self.events = 0
        engine = replicas[0].engine.params
        if not engine.priority_scheduling:
            self.engine_priority = "none"  # an engine with no priority queue is told none
        specs = tuple(
            ReplicaSpec(
                name=name,
                url=f"sim://{name}",
                kind=Kind.GENERATIVE,
                models=(DEFAULT_MODEL,),
                reports_load=self.reports_load,
                lookahead=LOOKAHEAD if self.lookahead is None else self.lookahead,
                gate_min_runs=GATE_MIN_RUNS if self.gate_min_runs is None else self.gate_min_runs,
                kv_slots=engine.slots if engine.slot_kv else None,
                host_cache=self.declares_host_cache and engine.slot_kv and engine.host_cache_tokens > 0,
                host_cache_configured=engine.slot_kv or not self.declares_host_cache,
            )
            for name in self.order
        )
        self._feed(PoolConfigured(specs, at=clock.now))
        clock.every(PROBE_PERIOD_S, self._probe, start=clock.now)
        clock.every(TICK_S, lambda: self._feed(Tick(at=self.clock.now)), start=clock.now + TICK_S)

    def send(self, turn: SimTurn) -> None:
        if not self.strict_affinity and turn.run_id in self._known_runs:
            self._feed(RunEnded(turn.run_id, at=self.clock.now))
        self._known_runs.add(turn.run_id)
        self._held[turn.turn_id] = turn
        self._feed(
            TurnArrived(
                turn_id=turn.turn_id,
                run_id=turn.run_id,
                service_class=turn.service_class,
                caller=turn.caller,
                model=DEFAULT_MODEL,
                kind=Kind.GENERATIVE,
                at=self.clock.now,
                request_bytes=turn.request_bytes,
                max_tokens=turn.request.max_tokens,
            )
        )

    def run_ended(self, run_id: str) -> None:
        self._known_runs.discard(run_id)
        self._feed(RunEnded(run_id, at=self.clock.now))

    def _probe(self) -> None:
        for name in self.order:
            if not self.reports_load:
                # An engine without load metrics: the prober reads its health only.
                self._feed(ReplicaProbed(name, True, None, None, at=self.clock.now))
                continue
            load = self.replicas[name].load()
            # The pool's size and whether it keeps a host tier, as the prober reads them from
            # SGLang's /get_server_info (the config's word on a slot engine's tier stands).
            params = self.replicas[name].engine.params
            kv_tokens = params.kv_pool_tokens if self.reads_kv else None
            host = params.host_cache_tokens > 0 if self.reads_kv and not params.slot_kv else None
            self._feed(
                ReplicaProbed(
                    name,
                    True,
                    load.running,
                    load.waiting,
                    at=self.clock.now,
                    kv_tokens=kv_tokens,
                    host_cache=host,
                )
            )

    def _feed(self, event: Event) -> None:
        self.events += 1
        self.state, actions = decide(self.state, event)
        for action in actions:
            if isinstance(action, Place):
                turn = self._held.pop(action.turn_id)
                if action.slot is not None:
                    # What the dataplane writes into the request: the slot its run's KV is in.
                    turn.request = dataclasses.replace(turn.request, slot=action.slot)
                self._start(turn, action.replica)
            elif isinstance(action, Refuse):
                raise RuntimeError(f"the scheduler refused a simulated turn: {action.message}")

    def _start(self, turn: SimTurn, replica: str) -> None:
        # What the dataplane writes into the request for a replica with this `engine_priority`.
        priority = priority_for(self.engine_priority, headers.service_class(turn.service_class))
        if priority is not None:
            turn.request = dataclasses.replace(turn.request, priority=priority)
        # The dataplane reports the start as it sends the request; the engine answers later.
        # A streamed turn's first token is reported as it comes; a turn read whole reports it
        # as the reply ends (`_finished`), as the dataplane does.
        self._feed(TurnStarted(turn.turn_id, turn.run_id, at=self.clock.now, streamed=turn.streamed))
        self._dispatch(
            turn,
            replica,
            on_first_token=(
                (lambda: self._feed(FirstToken(turn.turn_id, turn.run_id, at=self.clock.now)))
                if turn.streamed
                else None
            ),
        )

    def _finished(self, turn: SimTurn) -> None:
        call = turn.reply.tool_call
        if not turn.streamed:
            self._feed(FirstToken(turn.turn_id, turn.run_id, at=self.clock.now))
        self._feed(
            TurnCompleted(
                turn_id=turn.turn_id,
                run_id=turn.run_id,
                finish_reason=turn.reply.finish_reason,
                prompt_tokens=turn.request.prompt_tokens,
                completion_tokens=turn.reply.completion_tokens,
                tool_call_ids=(call.id,) if call is not None else (),
                at=self.clock.now,
                tool_names=(call.name,) if call is not None and self.reports_tool_names else (),
            )
        )


class LuftpauseNoRunGate(Luftpause):
    name = "luftpause-no-run-gate"
    reads_kv = False


class LuftpauseGateAlways(Luftpause):
    name = "luftpause-gate-always"
    gate_min_runs = 1


class LuftpauseGated(Luftpause):
    name = "luftpause-gated"
    declares_host_cache = False


class LuftpauseKeepByCaller(Luftpause):
    name = "luftpause-keep-by-caller"
    reports_tool_names = False


class LuftpauseFreeMoving(Luftpause):
    name = "luftpause-free-moving"
    strict_affinity = False


class LuftpauseNoEnginePriority(Luftpause):
    name = "luftpause-no-engine-priority"
    engine_priority = "none"


class LuftpauseNoLoadMetrics(Luftpause):
    name = "luftpause-no-load-metrics"
    reports_load = False
    engine_priority = "none"


class LuftpauseNoLoadMetricsUncapped(Luftpause):
    name = "luftpause-no-load-metrics-uncapped"
    reports_load = False
    engine_priority = "none"
    lookahead = 0


ARMS: dict[str, type[Arm]] = {
    arm.name: arm
    for arm in (
        Straight,
        RoundRobin,
        CacheAware,
        Sticky,
        Luftpause,
        LuftpauseNoRunGate,
        LuftpauseGateAlways,
        LuftpauseGated,
        LuftpauseKeepByCaller,
        LuftpauseFreeMoving,
        LuftpauseNoEnginePriority,
        LuftpauseNoLoadMetrics,
        LuftpauseNoLoadMetricsUncapped,
    )
}

# The peers (router plus engine priority, flow control) subclass the arms above and add
# themselves to ARMS; importing them last lets either module be imported first.
import luftpause.bench.sim.peers  # noqa: E402, F401
