"""The dataplane's Prometheus metrics, served at `GET /metrics`.

What an operator wants to see of the per-turn path: turns by route and by how they ended, turns
in flight now, how long turns were held for admission, and whether the scheduler link is up.
Each process has its own registry (several dataplanes may share a test process); the label
children are made once up front, so counting a turn costs one locked add, not a label lookup.
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
CONTENT_TYPE = CONTENT_TYPE_LATEST

_HELD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)


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
        self.admission = Histogram(
            "luftpause_dataplane_admission_seconds",
            "Time from asking the scheduler to admit a turn to its placement (held time included).",
            buckets=_HELD_BUCKETS,
            registry=self.registry,
        )
        self._connected = Gauge(
            "luftpause_dataplane_scheduler_connected",
            "1 while the scheduler link is resynced and reporting, else 0 (turns are held).",
            registry=self.registry,
        )

    def watch_scheduler(self, connected: Callable[[], bool]) -> None:
        self._connected.set_function(lambda: 1.0 if connected() else 0.0)

    def ended(self, route: str, outcome: str) -> None:
        self._turns[route, outcome].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
