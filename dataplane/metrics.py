"""The dataplane's Prometheus metrics, served at `GET /metrics`.

What an operator wants to see of the per-turn path: turns by route and by how they ended, turns
in flight now, how long turns were held for admission and how long engines took to their first
token (both per service class), and whether the scheduler link is up. Each process has its own
registry (several dataplanes may share a test process); the label children are made once up
front, so counting a turn costs one locked add, not a label lookup.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ROUTES = ("chat", "decide")
# completed: the reply came back whole; failed: the engine refused, broke off or could not be
# reached, or the client left mid-turn; abandoned: the client left while the turn was held;
# refused: the dataplane answered itself (bad request, unknown model, stopping).
OUTCOMES = ("completed", "failed", "abandoned", "refused")
# The `class` label's values, as the x-luftpause-class header names them.
CLASSES = ("interactive", "batch")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# 1-2.5-5 steps from 10 ms to 60 s, where both times are worth telling apart. Admission also
# gets 1 and 5 ms (a turn placed at once costs one gRPC round trip) and 2 and 10 minutes (a turn
# held behind a busy pool can wait that long).
_STEPS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_HELD_BUCKETS = (0.001, 0.005, *_STEPS, 120.0, 600.0)
_FIRST_TOKEN_BUCKETS = _STEPS


class DataplaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        turns = Counter(
            "luftpause_dataplane_turns",
            "Turns through the dataplane, by route and by how they ended.",
            ["route", "outcome"],
            registry=self.registry,
        )
        self._turns = {(r, o): turns.labels(route=r, outcome=o) for r in ROUTES for o in OUTCOMES}
        self.in_flight = Gauge(
            "luftpause_dataplane_turns_in_flight",
            "Turns placed on a replica whose reply has not ended yet.",
            registry=self.registry,
        )
        self._admission = self._per_class(
            "luftpause_dataplane_admission_seconds",
            "Time from asking the scheduler to admit a turn to its placement (held time included), "
            "by service class.",
            _HELD_BUCKETS,
        )
        self._first_token = self._per_class(
            "luftpause_dataplane_engine_first_token_seconds",
            "Time from sending a turn's request to its engine to the first token reaching the "
            "dataplane (the whole reply, when it is not streamed): the engine's queue and prefill, "
            "by service class.",
            _FIRST_TOKEN_BUCKETS,
        )
        self._connected = Gauge(
            "luftpause_dataplane_scheduler_connected",
            "1 while the scheduler link is resynced and reporting, else 0 (turns are held).",
            registry=self.registry,
        )

    def watch_scheduler(self, connected: Callable[[], bool]) -> None:
        self._connected.set_function(lambda: 1.0 if connected() else 0.0)

    def _per_class(self, name: str, documentation: str, buckets: tuple[float, ...]) -> dict[str, Histogram]:
        """A histogram labelled by service class, as its children made up front."""
        histogram = Histogram(name, documentation, ["class"], buckets=buckets, registry=self.registry)
        return {c: histogram.labels(c) for c in CLASSES}

    def ended(self, route: str, outcome: str) -> None:
        self._turns[route, outcome].inc()

    def admitted(self, service_class: str, seconds: float) -> None:
        """A turn of `service_class` ("interactive" or "batch") was placed after `seconds`."""
        self._admission[service_class].observe(seconds)

    def first_token(self, service_class: str, seconds: float) -> None:
        """A turn's first token arrived `seconds` after its engine request went out."""
        self._first_token[service_class].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
