"""The dataplane's Prometheus metrics, served at `GET /metrics`.

What an operator wants to see of the per-turn path: turns by route, by how they ended and by
service class; turns in flight now; how long turns were held for admission, how long engines
took to their first token and how long the engine request took to its end (each per class and
replica); engine errors by kind and replica; and whether the scheduler link is up. Each process
has its own registry (several dataplanes may share a test process); the label children are made
once up front for every configured replica, so counting a turn costs a dict lookup and one
locked add, not a label lookup. Every label is bounded: routes, outcomes, classes and error
kinds are the fixed sets below, and replicas are the config's (the scheduler names no other).

A dataplane of several workers (dataplane/workers.py) reports as a whole: the process that starts
them names a fresh directory in PROMETHEUS_MULTIPROC_DIR, each worker's prometheus-client keeps
its numbers in files there, and whichever worker answers `/metrics` adds up every worker's
(`MultiProcessCollector`): counters and histograms summed over the workers, a dead worker's
counts kept; turns in flight summed over the live workers; the scheduler link 1 only while every
live worker's is up. Those files hold values, not functions, so every gauge here is set when it
changes rather than read at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from luftpause import lifecycle

ROUTES = ("chat", "decide")
# completed: the reply came back whole; failed: the engine refused, broke off or could not be
# reached, or the client left mid-turn; abandoned: the client left while the turn was held;
# refused: the dataplane answered itself (bad request, unknown model, stopping).
OUTCOMES = ("completed", "failed", "abandoned", "refused")
# The `class` label's values, as the x-luftpause-class header names them; a turn refused before
# its class was read (a bad header or body) counts as "unknown".
CLASSES = lifecycle.CLASSES
UNKNOWN_CLASS = "unknown"
# The `kind` label of engine errors: the engine answered 4xx or 5xx; could not be reached (or
# broke off before its reply began); did not begin its reply within the first-byte timeout;
# broke off mid-stream or ended a stream before the reply finished; sent a whole reply that
# says it failed; or answered 200 with what is not a reply (a body that is not JSON, a stream that
# is not server-sent events of JSON).
ENGINE_ERRORS = ("http_4xx", "http_5xx", "unreachable", "timeout", "broke_off", "reply_error", "unreadable")
CONTENT_TYPE = CONTENT_TYPE_LATEST
# prometheus-client's own variable: set (in a worker's environment, before the import), every
# metric's values live in files in that directory, one set per process (dataplane/workers.py).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# 1-2.5-5 steps from 10 ms to 60 s, where both times are worth telling apart. Admission also
# gets 1 and 5 ms (a turn placed at once costs one gRPC round trip) and 2 and 10 minutes (a turn
# held behind a busy pool can wait that long); a whole turn may take minutes too.
_STEPS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_HELD_BUCKETS = (0.001, 0.005, *_STEPS, 120.0, 600.0)
_FIRST_TOKEN_BUCKETS = _STEPS
_TURN_BUCKETS = (*_STEPS, 120.0, 300.0, 600.0)


class _PerClassAndReplica:
    """A histogram labelled by class and replica, its children made up front for the replicas
    configured (one the config does not name gets its child when first seen)."""

    def __init__(self, histogram: Histogram, replicas: Iterable[str]) -> None:
        self._histogram = histogram
        self._children = {(c, r): histogram.labels(c, r) for c in CLASSES for r in replicas}

    def observe(self, service_class: str, replica: str, seconds: float) -> None:
        child = self._children.get((service_class, replica))
        if child is None:
            child = self._children[service_class, replica] = self._histogram.labels(service_class, replica)
        child.observe(seconds)


class DataplaneMetrics:
    """The dataplane's metrics in their own registry, every label's child made up front where
    its values are known (routes, outcomes, classes, the replicas configured)."""

    def __init__(self, replicas: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        replicas = tuple(replicas)
        self._turns = self._turns_by_label()
        self.in_flight = Gauge(
            "luftpause_dataplane_turns_in_flight",
            "Turns placed on a replica whose reply has not ended yet.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self._admission = self._per_class_and_replica(
            "luftpause_dataplane_admission_seconds",
            "Time from asking the scheduler to admit a turn to its placement (held time included), "
            "by service class and the replica it was placed on.",
            _HELD_BUCKETS,
            replicas,
        )
        self._first_token = self._per_class_and_replica(
            "luftpause_dataplane_engine_first_token_seconds",
            "Time from sending a turn's request to its engine to the first token reaching the "
            "dataplane (the whole reply, when it is not streamed): the engine's queue and prefill, "
            "by service class and replica.",
            _FIRST_TOKEN_BUCKETS,
            replicas,
        )
        self._turn = self._per_class_and_replica(
            "luftpause_dataplane_turn_seconds",
            "Time from sending a turn's request to its engine to the turn's end there (completed "
            "or failed), by service class and replica.",
            _TURN_BUCKETS,
            replicas,
        )
        self._errors = self._engine_errors(replicas)
        self._connected = Gauge(
            "luftpause_dataplane_scheduler_connected",
            "1 while the scheduler link is resynced and reporting, else 0 (turns are held).",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self._exposed = self._exposed_registry()

    def _turns_by_label(self) -> dict[tuple[str, str, str], Counter]:
        """The turns counter's children, made up front for every route, outcome and class."""
        turns = Counter(
            "luftpause_dataplane_turns",
            "Turns through the dataplane, by route, by how they ended and by service class.",
            ["route", "outcome", "class"],
            registry=self.registry,
        )
        return {
            (r, o, c): turns.labels(route=r, outcome=o, **{"class": c})
            for r in ROUTES
            for o in OUTCOMES
            for c in (*CLASSES, UNKNOWN_CLASS)
        }

    def _engine_errors(self, replicas: tuple[str, ...]) -> Counter:
        """The engine errors counter, its children made up front for the replicas configured."""
        errors = Counter(
            "luftpause_dataplane_engine_errors",
            "Engine requests that went wrong, by kind (http_4xx, http_5xx, unreachable, timeout, "
            "broke_off, reply_error, unreadable: a 200 that is not a reply) and replica.",
            ["kind", "replica"],
            registry=self.registry,
        )
        for kind in ENGINE_ERRORS:
            for r in replicas:
                errors.labels(kind, r)
        return errors

    def _exposed_registry(self) -> CollectorRegistry:
        """What `/metrics` shows: this process's registry, or every worker's files added up."""
        shared_dir = os.environ.get(MULTIPROC_DIR_ENV)
        if not shared_dir:
            return self.registry
        exposed = CollectorRegistry()
        multiprocess.MultiProcessCollector(exposed, shared_dir)  # type: ignore[no-untyped-call]
        return exposed

    def scheduler_connected(self, connected: bool) -> None:
        """The scheduler link came up (resynced and streaming) or went down."""
        self._connected.set(1.0 if connected else 0.0)

    def _per_class_and_replica(
        self, name: str, documentation: str, buckets: tuple[float, ...], replicas: tuple[str, ...]
    ) -> _PerClassAndReplica:
        histogram = Histogram(
            name, documentation, ["class", "replica"], buckets=buckets, registry=self.registry
        )
        return _PerClassAndReplica(histogram, replicas)

    def ended(self, route: str, outcome: str, service_class: str = UNKNOWN_CLASS) -> None:
        self._turns[route, outcome, service_class].inc()

    def admitted(self, service_class: str, replica: str, seconds: float) -> None:
        """A turn of `service_class` ("interactive" or "batch") was placed on `replica` after `seconds`."""
        self._admission.observe(service_class, replica, seconds)

    def first_token(self, service_class: str, replica: str, seconds: float) -> None:
        """A turn's first token arrived `seconds` after its engine request went out."""
        self._first_token.observe(service_class, replica, seconds)

    def turn_ended(self, service_class: str, replica: str, seconds: float) -> None:
        """A turn ended on `replica` `seconds` after its engine request went out."""
        self._turn.observe(service_class, replica, seconds)

    def engine_error(self, kind: str, replica: str) -> None:
        """An engine request went wrong in one of the ENGINE_ERRORS ways (rare: no children kept)."""
        self._errors.labels(kind, replica).inc()

    def render(self) -> bytes:
        return generate_latest(self._exposed)
