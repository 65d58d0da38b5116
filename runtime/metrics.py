"""The runtime's Prometheus metrics, served at `GET /metrics` on its HTTP port.

Runs by state and the approvals waiting now are read from the runs at scrape time (a custom
collector); tool calls by server and outcome, budget trips by kind and the journal's write
latency are counted as they happen. With `LUFTPAUSE_TOKEN` set, /metrics needs the token like
/status (auth.py): it names tool servers and what the runs are doing, and Prometheus sends a
bearer token with `authorization: {credentials_file: ...}` in its scrape config.

Every label is bounded: states are the runs' shown statuses, servers are the configured tool
servers (a call naming no offered tool counts under `server="(none)"`), outcomes and budget kinds
are the fixed sets below. No run handle is ever a label.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from luftpause.runtime.budgets import BUDGET_KINDS

if TYPE_CHECKING:
    from luftpause.runtime.run import Run

CONTENT_TYPE = CONTENT_TYPE_LATEST
STATES = ("running", "AwaitingApproval", "finished", "failed", "cancelled")
# ok: the tool answered; error: it answered with an error (or its server failed); refused: not
# sent (no such tool, arguments that do not fit its schema); declined: the user said no;
# not_run: the run's maxToolCalls was spent; unknown: sent before the run stopped (a restart, a
# takeover) and never answered, so not sent again (tool calls are at most once).
TOOL_OUTCOMES = ("ok", "error", "refused", "declined", "not_run", "unknown")
NO_SERVER = "(none)"
# Group commits take from well under a millisecond (page cache) to seconds (a slow disk).
_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)


class _RunsNow(Collector):
    def __init__(self, runs: Callable[[], Iterable[Run]]) -> None:
        self.runs = runs

    def collect(self) -> Iterable[Metric]:
        states: Tally[str] = Tally()
        approvals = 0
        for run in self.runs():
            states[run.shown_status()] += 1
            if run.running:
                approvals += len(run.approvals)
        family = GaugeMetricFamily(
            "luftpause_runtime_runs",
            "Runs in the runtime's memory by state (finished runs leave it for the archive after "
            "the retention window).",
            labels=["state"],
        )
        for state in STATES:
            family.add_metric([state], states[state])
        yield family
        yield GaugeMetricFamily(
            "luftpause_runtime_approvals_waiting",
            "Tool calls waiting for the user's approval now.",
            value=approvals,
        )


class RuntimeMetrics:
    def __init__(self, servers: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self._tool_calls = Counter(
            "luftpause_runtime_tool_calls",
            "Tool calls sub-agents asked for, by tool server and outcome "
            "(ok, error, refused, declined, not_run, unknown).",
            ["server", "outcome"],
            registry=self.registry,
        )
        for server in (*servers, NO_SERVER):
            for outcome in TOOL_OUTCOMES:
                self._tool_calls.labels(server, outcome)
        self._budget_trips = Counter(
            "luftpause_runtime_budget_trips",
            "Budgets that tripped (each cancels its run's subtree), by kind (tokens, toolCalls, seconds).",
            ["kind"],
            registry=self.registry,
        )
        for kind in BUDGET_KINDS:
            self._budget_trips.labels(kind)
        self._journal_write = Histogram(
            "luftpause_runtime_journal_write_seconds",
            "Time to write and fsync one group commit of the journal (runs.jsonl, tasks.jsonl).",
            buckets=_WRITE_BUCKETS,
            registry=self.registry,
        )

    def watch_runs(self, runs: Callable[[], Iterable[Run]]) -> None:
        self.registry.register(_RunsNow(runs))

    def tool_call(self, server: str, outcome: str) -> None:
        self._tool_calls.labels(server or NO_SERVER, outcome).inc()

    def budget_tripped(self, kind: str) -> None:
        if kind in BUDGET_KINDS:
            self._budget_trips.labels(kind).inc()

    def journal_written(self, seconds: float) -> None:
        """Called from the journal's writer thread (the histogram takes its own lock)."""
        self._journal_write.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
