"""The strongest peers a user could pick without luftpause, as arms of the simulator.

- `router-plus-engine-priority`: the SGLang router's cache-aware policy (the `sglang-cache-aware`
  arm, unchanged) in front of engines started with `--enable-priority-scheduling`, the harness
  writing each turn's class into the request as its `priority`: 1 for interactive, 0 for batch.
- `router-plus-engine-priority-preempt`: the same with SGLang's priority preemption doing what it
  does when the batch is full: the harness marks only its interactive turns (priority 1) and
  leaves batch ones unset, SGLang's worst value, so the gap is over the preemption threshold and
  an interactive turn that does not fit preempts running batch turns.
- `router-plus-engine-priority-host-tier`: `router-plus-engine-priority` on engines that also keep
  a host tier behind their KV, as SGLang's HiCache does (`--enable-hierarchical-cache`): what a
  user can turn on for free. Its size and restore cost (`HOST_TIER_RATIO`,
  `HOST_RESTORE_PER_TOKEN_S`) are stated and reasoned where they are defined.
- `flow-control`: a gateway queue in the style of the Gateway API Inference Extension's flow
  control layer (the endpoint picker that llm-d builds on): turns wait at the gateway while
  every replica reads saturated, leave it by priority, then fairness across callers, then
  arrival, and go to the unsaturated replica that best matches their prefix.
- `run-gate-fixed`: a gateway that caps the runs active on each replica at a fixed
  `RUN_GATE_FIXED_CAP`: a run is active on a replica from its first turn's placement until it
  ends; a new run's first turn waits while every replica is at the cap (interactive first, then
  arrival) and goes to the replica with the fewest active runs; a placed run's later turns go
  straight to its replica. Turns carry engine priority as `router-plus-engine-priority`'s do.
  It is the ablation of a scheduler-side run gate: what a gate with one number, not chosen per
  scenario, already gets.

All run against the same engine model as every other arm, priority scheduling on (`run`).

What SGLang's priority scheduling does, from its sources (sgl-project/sglang, 2026:
docs/advanced_features/server_arguments.md; python/sglang/srt/managers/schedule_policy.py
and scheduler.py), and what of it the engine model has:

- The waiting queue is sorted by priority, higher values first (`--schedule-low-priority-
  values-first` reverses that), then by arrival, with the default `fcfs` policy. A request that
  sets no priority gets the worst value there is. The model has this ordering
  (`EngineParams.priority_scheduling`).
- Admission walks that order and stops at the first request that does not fit, so nothing
  behind it starts first. The model's queue head waits the same way.
- Preemption is on by default with priority scheduling (`--disable-priority-preemption` turns it
  off): a waiting request that does not fit may evict running ones, worst priority first, but
  only those whose priority is worse than its own by more than
  `--priority-scheduling-preemption-threshold` (10 by default), and only if evicting them frees
  enough room; the evicted ones free their KV and go back to the queue to be computed again.
  With the values of `router-plus-engine-priority` (a gap of 1) SGLang does not preempt, and
  neither does the model. `router-plus-engine-priority-preempt` leaves batch unset, and its
  engines model the preemption (`EngineParams.priority_preemption`, described in
  `fake_engine.engine`): SGLang tries it for the queue's head once the running batch is full
  (no slot, or the last admission ran out of memory), walks the running requests worst priority
  first and, among equals, the latest to enter the queue first, takes them while each is worse
  by more than the threshold until what they hold covers what the head needs, and preempts
  them only if it does. A victim's KV is released without being inserted into the radix tree
  (`release_req`: `is_insert=False`, to use the room at once), so its own prompt is not cached;
  the prefix it had matched stays. It goes back to the waiting queue keeping its output ids,
  and its next prefill recomputes input and output; what it loses is that KV and its place.
  The model tries preemption as soon as the head does not fit rather than one scheduler
  iteration later, and counts the room exactly rather than by SGLang's token estimates.

What the flow control layer does, from the extension's documentation and sources
(kubernetes-sigs/gateway-api-inference-extension: site-src/guides/flow-control.md,
site-src/concepts/priority-and-capacity.md, site-src/implementations/model-servers.md,
site-src/guides/epp-configuration/prefix-aware.md, pkg/epp/saturationdetector/; the
round-robin fairness policy's README in llm-d/llm-d-inference-scheduler), and how it is modelled:

- A request belongs to a flow: a fairness id (a request header, e.g. the tenant) and a priority
  (from its InferenceObjective; higher goes first, 0 when unset). Here the caller is the
  fairness id and the class the priority: interactive 1, batch 0.
- Dispatch is strictly by priority: every held request of a higher band goes before any of a
  lower one. Within a band a fairness policy picks the flow; we use the round-robin policy,
  which cycles through the flows that have something waiting (the default, global strict
  fairness, differs only with several callers in a band, which no scenario has). Within a flow
  the order is arrival at the gateway (the default FCFS ordering policy).
- Before dispatching, the saturation detector is asked whether the pool has room. The
  utilization detector reads each endpoint's scraped waiting queue (`sglang:num_queue_reqs`,
  here `load().waiting`) and KV usage (`sglang:token_usage`, here `load().token_usage`).
  Defaults: queue depth threshold 5, KV cache utilisation threshold 0.8, metrics older than
  200 ms count as no room; the endpoint picker scrapes every 50 ms (`--refresh-metrics-interval`).
  A replica here is saturated when its last scrape read a queue of 5 or more or a KV usage of
  0.8 or more (the per-endpoint filter's limit with no headroom; the older detector counted a
  pod as having room up to and including the thresholds, which would let one more in), or when
  that scrape is stale. Turns are held while every replica is saturated, as the older detector's
  pool check had it (no pod with room). Newer versions turn the same readings into a pool-wide
  gradient, the average over endpoints of the larger of queue/threshold and KV/threshold, which
  the flow controller applies as proportional backpressure; that is not modelled (an average
  can hold turns while one replica is idle and the other far over).
- The layer is work-conserving, and its dispatch loop runs continuously, so a held turn leaves
  as soon as a reading shows room. Here the gateway dispatches on every event that may change
  the answer: a scrape, a turn's arrival, a turn's end.
- Between scrapes the detector sees the last reading only; its own documentation warns that a
  burst can all go to an endpoint that looks healthy until the next scrape shows it is not. The
  model does the same: after a scrape that shows room, every held turn leaves at once. So an
  engine's queue can exceed the threshold by what one scrape period let in.
- Routing happens at dispatch ("late binding"), among the replicas with room, by the scorers
  of the inference pool chart's default profile (config/charts/inferencepool): prefix cache
  scorer weight 3, queue scorer 2, KV cache utilisation scorer 2, the best total wins. The
  prefix scorer's score is the share of the prompt's blocks it believes a server holds, learnt
  from what the picker sent there; we match whole messages against what the gateway sent to each
  replica, as the cache-aware arm does (never evicted, as there). The queue scorer spreads the
  candidates' scraped queues over 0..1 (shortest 1; all 1 when equal), the KV scorer is 1 minus
  the scraped KV usage. The picker breaks ties at random; we give them to the replica with the
  fewest turns in flight from the gateway. Prefix first with load only breaking ties, which is
  what a profile with the prefix scorer alone would do, sends every new run to the replica that
  already holds the system prompt until it reads saturated: it does about as well in the flood
  and far worse at moderate load, so it is not the configuration used.
- Not modelled: request TTLs and the byte-capacity limits of the bands (nothing is rejected;
  `max_held_s` shows how long a turn waited) and any engine priority (this arm writes none).

The router and flow-control arms keep no state per run: no affinity for a paused run beyond
what prefix matching gives, no room kept for runs whose tool is running. `run-gate-fixed` keeps
each run on its replica and counts it there while its tool runs, which is what keeps room for it.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace

from luftpause.bench.sim.arms import ARMS, Arm, CacheAware, Luftpause, matched_tokens
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.turns import SimTurn
from luftpause.fake_engine.engine import EngineLoad
from luftpause.fake_engine.params import EngineParams
from luftpause.scheduler.state import ServiceClass

# The priority the harness writes into each request for SGLang (higher goes first). Batch is
# written too: a request without one gets SGLang's worst value, which lets interactive turns
# preempt running batch turns (the `-preempt` arm).
ENGINE_PRIORITY = {ServiceClass.INTERACTIVE: 1, ServiceClass.BATCH: 0}

# What SGLang gives a request that sets no priority, higher going first: the worst value there is.
SGLANG_UNSET_PRIORITY = -sys.maxsize
# The harness that marks only its interactive turns.
INTERACTIVE_MARKED_ONLY = {ServiceClass.INTERACTIVE: 1, ServiceClass.BATCH: SGLANG_UNSET_PRIORITY}

RUN_GATE_FIXED_CAP = 11
"""Runs active on one replica at most, in `run-gate-fixed`: one fixed number, near the flood turns
one calibrated replica's KV pool holds at once (about twelve, `EngineParams.kv_pool_tokens`). It
is the ablation a scheduler-side run gate must beat without a number chosen per scenario."""

# The InferenceObjective priority of each class at the gateway (higher goes first).
OBJECTIVE_PRIORITY = {ServiceClass.INTERACTIVE: 1, ServiceClass.BATCH: 0}

# The endpoint picker's documented defaults.
SCRAPE_PERIOD_S = 0.050
METRICS_STALENESS_S = 0.200
QUEUE_DEPTH_THRESHOLD = 5
KV_CACHE_UTIL_THRESHOLD = 0.8
# The scorer weights of the inference pool chart's default profile.
PREFIX_WEIGHT = 3.0
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0


class RouterPlusEnginePriority(CacheAware):
    name = "router-plus-engine-priority"
    priorities = ENGINE_PRIORITY

    def send(self, turn: SimTurn) -> None:
        turn.request = replace(turn.request, priority=self.priorities[turn.service_class])
        super().send(turn)


HOST_TIER_RATIO = 2
"""Each engine's host tier in `router-plus-engine-priority-host-tier`, as a multiple of its KV
pool (65,536 tokens on the calibrated engine): SGLang's HiCache default (`--hicache-ratio 2`, the host pool sized as a multiple of the
device pool; `--hicache-size 0`, no fixed size). At Llama-3.2-1B's 32 KiB a token that is 2 GiB
of host memory per replica, which a laptop with an 8 GB GPU has to spare."""

HOST_RESTORE_PER_TOKEN_S = 5e-6
"""What copying one token of KV back from the host tier costs, in that arm: 32 KiB a token over a
laptop GPU's PCIe link (PCIe 4.0 x8, about 13 GB/s host to device in practice), shared by the two
replicas on the one GPU, about 6.5 GB/s each: 5 microseconds a token, a tenth of the calibrated
prefill's 50 (`EngineParams.prefill_per_token_s`). HiCache writes evicted nodes to the host in
the background, overlapped with compute, so a write costs nothing here; a load is charged in the
prefill pass of the request that needs it (SGLang overlaps loads layer by layer with that pass,
so this errs on the tier's cost, not its benefit). Derived, not measured: no GPU here."""


def with_host_tier(params: EngineParams) -> EngineParams:
    """The engines with the host tier a user can turn on for free (HiCache's default size)."""
    return replace(
        params,
        host_cache_tokens=HOST_TIER_RATIO * params.kv_pool_tokens,
        host_restore_per_token_s=HOST_RESTORE_PER_TOKEN_S,
    )


class RouterPlusEnginePriorityHostTier(RouterPlusEnginePriority):
    name = "router-plus-engine-priority-host-tier"

    @classmethod
    def engines(cls, params: EngineParams) -> EngineParams:
        return with_host_tier(params)


class LuftpauseHostTier(Luftpause):
    """luftpause on the same engines as `router-plus-engine-priority-host-tier`: what a luftpause
    user gets who turns the host tier on too (its engines say so, as SGLang's /get_server_info
    does, so the run gate holds nothing and only the classes and the lookahead order the turns)."""

    name = "luftpause-host-tier"

    @classmethod
    def engines(cls, params: EngineParams) -> EngineParams:
        return with_host_tier(params)


class RouterPlusEnginePriorityPreempt(RouterPlusEnginePriority):
    name = "router-plus-engine-priority-preempt"
    priorities = INTERACTIVE_MARKED_ONLY

    @classmethod
    def engines(cls, params: EngineParams) -> EngineParams:
        # SGLang's default with priority scheduling: preemption on, threshold 10.
        return replace(params, priority_preemption=True)


class RunGateFixed(Arm):
    name = "run-gate-fixed"
    cap = RUN_GATE_FIXED_CAP

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self.active: Counter[str] = Counter()
        self._home: dict[str, str] = {}
        # New runs' first turns waiting at the gateway, interactive ones first, each oldest first.
        self._gate = {ServiceClass.INTERACTIVE: deque[SimTurn](), ServiceClass.BATCH: deque[SimTurn]()}
        self.max_held_s = 0.0

    @property
    def held(self) -> int:
        return sum(len(turns) for turns in self._gate.values())

    def send(self, turn: SimTurn) -> None:
        turn.request = replace(turn.request, priority=ENGINE_PRIORITY[turn.service_class])
        home = self._home.get(turn.run_id)
        if home is not None:
            self._dispatch(turn, home)
            return
        self._gate[turn.service_class].append(turn)
        self._open()

    def run_ended(self, run_id: str) -> None:
        home = self._home.pop(run_id, None)
        if home is not None:
            self.active[home] -= 1
            self._open()

    def _open(self) -> None:
        """Places waiting first turns while some replica is under the cap."""
        while turns := self._gate[ServiceClass.INTERACTIVE] or self._gate[ServiceClass.BATCH]:
            # The fewest active runs; the first replica on a tie.
            replica = min(self.order, key=lambda name: self.active[name])
            if self.active[replica] >= self.cap:
                return
            turn = turns.popleft()
            self.max_held_s = max(self.max_held_s, self.clock.now - turn.arrived_at)
            self._home[turn.run_id] = replica
            self.active[replica] += 1
            self._dispatch(turn, replica)


class FlowControl(Arm):
    name = "flow-control"

    def __init__(self, replicas: Sequence[SimReplica], clock: VirtualClock) -> None:
        super().__init__(replicas, clock)
        self.scraped: dict[str, EngineLoad] = {}
        self.scraped_at: dict[str, float] = {}
        # Priority band -> fairness id -> that flow's held turns, oldest first.
        self._bands: dict[int, dict[str, deque[SimTurn]]] = {}
        # The flow each band served last, where its round robin resumes.
        self._last_flow: dict[int, str] = {}
        self._trees: dict[str, set[bytes]] = {name: set() for name in self.order}
        self.held = 0
        self.max_held_s = 0.0
        clock.every(SCRAPE_PERIOD_S, self._scrape, start=clock.now)

    def send(self, turn: SimTurn) -> None:
        band = self._bands.setdefault(OBJECTIVE_PRIORITY[turn.service_class], {})
        band.setdefault(turn.caller, deque()).append(turn)
        self.held += 1
        self.dispatch()

    def has_room(self, name: str) -> bool:
        """What the saturation detector says of one replica, from its last scrape."""
        load = self.scraped.get(name)
        if load is None or self.clock.now - self.scraped_at[name] > METRICS_STALENESS_S:
            return False
        return load.waiting < QUEUE_DEPTH_THRESHOLD and load.token_usage < KV_CACHE_UTIL_THRESHOLD

    def dispatch(self) -> None:
        """Sends held turns, best first, for as long as some replica reads as having room."""
        # The readings change only at a scrape, so one look serves the whole loop.
        open_replicas = [name for name in self.order if self.has_room(name)]
        if not open_replicas:
            return
        while (turn := self._next_turn()) is not None:
            self.held -= 1
            self.max_held_s = max(self.max_held_s, self.clock.now - turn.arrived_at)
            self._place(turn, open_replicas)

    def _scrape(self) -> None:
        for name in self.order:
            self.scraped[name] = self.replicas[name].load()
            self.scraped_at[name] = self.clock.now
        self.dispatch()

    def _finished(self, turn: SimTurn) -> None:
        self.dispatch()

    def _next_turn(self) -> SimTurn | None:
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            waiting = sorted(flow for flow, turns in band.items() if turns)
            if not waiting:
                continue
            last = self._last_flow.get(priority)
            # Round robin: the first flow after the one served last, in a fixed order.
            flow = next((f for f in waiting if last is None or f > last), waiting[0])
            self._last_flow[priority] = flow
            return band[flow].popleft()
        return None

    def _place(self, turn: SimTurn, candidates: list[str]) -> None:
        total = sum(block.tokens for block in turn.request.blocks) or 1
        queues = [self.scraped[name].waiting for name in candidates]
        shortest, longest = min(queues), max(queues)

        def score(name: str) -> tuple[float, int]:
            matched = matched_tokens(self._trees[name], turn.request.blocks)
            load = self.scraped[name]
            # The queue scorer spreads the candidates' queues over 0..1, 1 for all when equal.
            queue = 1.0 if longest == shortest else (longest - load.waiting) / (longest - shortest)
            weighted = (
                PREFIX_WEIGHT * matched / total + QUEUE_WEIGHT * queue + KV_WEIGHT * (1.0 - load.token_usage)
            )
            # The picker takes the best score; a tie goes to the fewest turns in flight.
            return weighted, -self.in_flight[name]

        choice = max(candidates, key=score)
        self._trees[choice].update(block.key for block in turn.request.blocks)
        self._dispatch(turn, choice)


PEERS: dict[str, type[Arm]] = {
    arm.name: arm
    for arm in (
        RouterPlusEnginePriority,
        RouterPlusEnginePriorityPreempt,
        RouterPlusEnginePriorityHostTier,
        FlowControl,
        RunGateFixed,
    )
}

# `arms` imports this module once its own arms exist; the simulator and the CLI see one table.
ARMS.update(PEERS)
# Not a peer: luftpause itself on the host-tier peer's engines.
ARMS[LuftpauseHostTier.name] = LuftpauseHostTier
