"""The scheduler's Prometheus metrics, served at `GET /metrics` on its status port.

Everything that mirrors the state (turns held by class and caller and the oldest wait, each
replica's admission limit, turns in flight, reservations and health, its KV pool and the runs
it holds with their working sets, how the run gate counts there and whether its engine keeps a
host tier, its engine's prompt-cache counters, the runs waiting for room, runs by class and
phase, dataplane streams) is computed at scrape time from the host's current state by a custom
collector, so a decision costs nothing more for being watched. The counters (decisions by
action, resyncs, probe failures per replica) are plain integers the host keeps (`HostCounts`)
and this collector reads.

Labels are bounded: replicas come from the config, classes and phases are enums, and actions
are the core's. Callers are chosen by clients (`x-luftpause-caller`), so only the
`CALLERS_SHOWN` callers with the most held turns at a scrape keep their name; the rest are
summed under `caller="(other)"`, and the anonymous caller is `caller="(anonymous)"`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from luftpause.scheduler import admission, gate
from luftpause.scheduler.actions import Action, Place, Refuse, Reserved, Revoked, RunForgotten, TurnExpired
from luftpause.scheduler.state import Phase, ServiceClass, State, Turn
from luftpause.scheduler.status import per_replica, runs_of, waiting_for_room

# How many callers keep their own label value in the held-turns gauge (those with most held).
CALLERS_SHOWN = 10
OTHER_CALLERS = "(other)"
ANONYMOUS = "(anonymous)"

# The `action` label of luftpause_scheduler_decisions_total, per action the core emits.
ACTION_NAMES: dict[type[Action], str] = {
    Place: "place",
    Refuse: "refuse",
    TurnExpired: "expire",
    RunForgotten: "forget",
    Reserved: "reserve",
    Revoked: "revoke",
}


@dataclasses.dataclass(slots=True)
class HostCounts:
    """What the host counts as it goes: each a plain integer add, read by the collector."""

    decisions: Counter[str] = dataclasses.field(default_factory=Counter)
    probe_failures: Counter[str] = dataclasses.field(default_factory=Counter)
    resyncs: int = 0


def caller_label(caller: str, shown: set[str]) -> str:
    if caller not in shown:
        return OTHER_CALLERS
    return caller if caller else ANONYMOUS


class SchedulerCollector(Collector):
    """Reads `current()` (the host's state), `clock()` (the events' clock), `counts` and
    `streams()` (Turns streams open) at each scrape."""

    def __init__(
        self,
        current: Callable[[], State],
        clock: Callable[[], float],
        counts: HostCounts,
        streams: Callable[[], int],
    ) -> None:
        self.current, self.clock, self.counts, self.streams = current, clock, counts, streams

    def collect(self) -> Iterable[Metric]:
        state, now = self.current(), self.clock()
        held = state.held()
        yield from self._held(held, now)
        yield from self._replicas(state)
        yield from self._gate(state, held)
        runs = GaugeMetricFamily(
            "luftpause_scheduler_runs",
            "Runs the scheduler knows, by class and phase.",
            labels=["class", "phase"],
        )
        by = Counter((r.service_class, r.phase) for r in state.runs.values())
        for c in ServiceClass:
            for p in Phase:
                runs.add_metric([str(c), str(p)], by[c, p])
        yield runs
        decisions = CounterMetricFamily(
            "luftpause_scheduler_decisions",
            "Actions the scheduler's core decided, by action (place, refuse, expire, forget, reserve, revoke).",
            labels=["action"],
        )
        for name in ACTION_NAMES.values():
            decisions.add_metric([name], self.counts.decisions[name])
        yield decisions
        yield CounterMetricFamily(
            "luftpause_scheduler_resyncs", "Resyncs received from dataplanes.", value=self.counts.resyncs
        )
        yield GaugeMetricFamily(
            "luftpause_scheduler_dataplane_streams",
            "Dataplanes' Turns streams open now.",
            value=self.streams(),
        )

    def _held(self, held: list[Turn], now: float) -> Iterable[Metric]:
        per_caller = Counter(t.caller for t in held)
        shown = {caller for caller, _ in per_caller.most_common(CALLERS_SHOWN)}
        counts: Counter[tuple[str, str]] = Counter()
        oldest: dict[str, float] = {}
        for t in held:
            cls = str(t.service_class)
            counts[cls, caller_label(t.caller, shown)] += 1
            oldest[cls] = min(oldest.get(cls, t.arrived_at), t.arrived_at)
        turns = GaugeMetricFamily(
            "luftpause_scheduler_held_turns",
            f"Turns held for admission now, by class and caller (the {CALLERS_SHOWN} callers with most "
            f'held keep their name, the rest are "{OTHER_CALLERS}").',
            labels=["class", "caller"],
        )
        for c in ServiceClass:
            turns.add_metric([str(c), OTHER_CALLERS], counts.pop((str(c), OTHER_CALLERS), 0))
        for (cls, caller), n in sorted(counts.items()):
            turns.add_metric([cls, caller], n)
        yield turns
        wait = GaugeMetricFamily(
            "luftpause_scheduler_held_oldest_wait_seconds",
            "How long the longest-held turn of each class has waited (0 when none is held).",
            labels=["class"],
        )
        for c in ServiceClass:
            since = oldest.get(str(c))
            wait.add_metric([str(c)], max(now - since, 0.0) if since is not None else 0.0)
        yield wait

    def _replicas(self, state: State) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "luftpause_scheduler_in_flight_turns",
            "Our turns placed on each replica and not yet reported done.",
            labels=["replica"],
        )
        limit = GaugeMetricFamily(
            "luftpause_scheduler_admission_limit",
            "The most of our turns each replica may hold now (+Inf: uncapped).",
            labels=["replica"],
        )
        reserved = GaugeMetricFamily(
            "luftpause_scheduler_reservations",
            "Room set aside on each replica for dataplanes while nothing is held.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "luftpause_scheduler_replica_healthy", "1 while the replica's last probe found it healthy.",
            labels=["replica"],
        )  # fmt: skip
        failures = CounterMetricFamily(
            "luftpause_scheduler_probe_failures",
            "Probes that found a replica unhealthy (no answer, or not 2xx on its health path).",
            labels=["replica"],
        )
        ejected = GaugeMetricFamily(
            "luftpause_scheduler_replica_ejected",
            "1 while the replica is out of rotation because its turns kept failing (outlier ejection).",
            labels=["replica"],
        )
        ejections = CounterMetricFamily(
            "luftpause_scheduler_replica_ejections",
            "Times the replica was taken out of rotation because its turns kept failing.",
            labels=["replica"],
        )
        flying, reservations = per_replica(state)
        for r in state.replicas_in_order():
            n = flying.get(r.name, 0)
            cap = admission.limit(r, n, state.waiting_interactive(r.name))
            in_flight.add_metric([r.name], n)
            limit.add_metric([r.name], math.inf if cap is None else cap)
            reserved.add_metric([r.name], reservations.get(r.name, 0))
            healthy.add_metric([r.name], 1.0 if r.healthy else 0.0)
            failures.add_metric([r.name], self.counts.probe_failures[r.name])
            ejected.add_metric([r.name], 1.0 if r.outlier.ejected else 0.0)
            ejections.add_metric([r.name], r.outlier.ejections)
        yield from (in_flight, limit, reserved, healthy, failures, ejected, ejections)
        yield from self._prompt_cache(state)

    def _prompt_cache(self, state: State) -> Iterable[Metric]:
        """Each replica's engine's prompt-cache counters as its last /metrics page said them
        (prober.CACHE_METRICS; only replicas whose page has them): the share of prompts its
        prefix cache gave back is the second over the first, since the engine started, and
        over a window their rates' ratio. They restart from 0 with the engine."""
        prompt = CounterMetricFamily(
            "luftpause_scheduler_replica_prompt_tokens",
            "Prompt tokens each replica's engine took since it started, those from its prefix cache included.",
            labels=["replica"],
        )
        cached = CounterMetricFamily(
            "luftpause_scheduler_replica_cached_prompt_tokens",
            "Of each replica's engine's prompt tokens, those its prefix cache gave back since it started.",
            labels=["replica"],
        )
        for r in state.replicas_in_order():
            if r.prompt_tokens is not None and r.cached_tokens is not None:
                prompt.add_metric([r.name], r.prompt_tokens)
                cached.add_metric([r.name], r.cached_tokens)
        yield from (prompt, cached)

    def _gate(self, state: State, held: list[Turn]) -> Iterable[Metric]:
        """The run gate (gate.py): each replica's KV pool, the runs it holds, how the gate counts
        there and whether its engine keeps a host tier, and the runs waiting to be admitted."""
        pool = GaugeMetricFamily(
            "luftpause_scheduler_replica_kv_tokens",
            "Tokens of KV memory each replica's engine has, as configured or read from the engine "
            "(only replicas where it is known: elsewhere the run gate is off).",
            labels=["replica"],
        )
        held_kv = GaugeMetricFamily(
            "luftpause_scheduler_replica_held_kv_tokens",
            "The working sets of the runs each replica holds (generating, or paused within their keep time).",
            labels=["replica"],
        )
        held_runs = GaugeMetricFamily(
            "luftpause_scheduler_replica_held_runs",
            "Runs each replica holds (generating, or paused within their keep time).",
            labels=["replica"],
        )
        run_gate = GaugeMetricFamily(
            "luftpause_scheduler_replica_run_gate",
            "How the run gate counts runs on each replica, as /status says it: 1 on the one `mode` "
            'that holds ("slots", "tokens", or "off: <why>").',
            labels=["replica", "mode"],
        )
        host_cache = GaugeMetricFamily(
            "luftpause_scheduler_replica_host_cache",
            "1 where the replica's engine keeps evicted prefixes in host memory (the gate then holds "
            'no runs there), and who said so: `source` "config", "engine" or "default".',
            labels=["replica", "source"],
        )
        for r in state.replicas_in_order():
            if r.kv_tokens is not None:
                pool.add_metric([r.name], r.kv_tokens)
            held_kv.add_metric([r.name], state.held_kv.get(r.name, 0))
            held_runs.add_metric([r.name], state.held_runs.get(r.name, 0))
            run_gate.add_metric([r.name, gate.mode(r)], 1.0)
            host_cache.add_metric([r.name, r.host_cache_source], 1.0 if r.host_cache else 0.0)
        waiting = GaugeMetricFamily(
            "luftpause_scheduler_runs_waiting_for_room",
            "Runs waiting to be admitted, by class: their turns are held and no replica holds them yet.",
            labels=["class"],
        )
        for c, turns in waiting_for_room(state, held).items():
            waiting.add_metric([str(c)], runs_of(turns))
        yield from (pool, held_kv, held_runs, run_gate, host_cache, waiting)


def registry_of(collector: SchedulerCollector) -> Callable[[], bytes]:
    """The exposition text of `collector` alone, as a function to call per scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return lambda: generate_latest(registry)
