"""What a turn leaves behind for an operator: its span and its metrics, kept together.

The proxy says what happened to a turn (refused, abandoned, admitted after a hold, answered by
the engine, first token, ended); `TurnObserver` turns each into the span's attributes and status
(OpenTelemetry's GenAI conventions, tracing on: luftpause/tracing.py) and the counts and
histograms of `DataplaneMetrics`, so that the two always speak of the same moments. A turn's span
is opened here and ended here; with tracing off no span is made and only the metrics move.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, StatusCode

from luftpause import tracing
from luftpause.dataplane.metrics import DataplaneMetrics
from luftpause.dataplane.sse import ReplyObservation
from luftpause.dataplane.turn import ProxiedTurn


class TurnObserver:
    """The span and metrics of each turn through one dataplane (`metrics` is its registry)."""

    def __init__(self, metrics: DataplaneMetrics) -> None:
        self.metrics = metrics

    def opened(self, turn: ProxiedTurn) -> None:
        """Starts the turn's span, a child of the client's `traceparent`; the scheduler and the
        engine are then sent this span's own, so that their spans are its children."""
        tracer = tracing.TRACER
        if tracer is None:
            return
        attributes = {
            "gen_ai.request.model": turn.model,
            "luftpause.route": turn.route,
            "luftpause.turn_id": turn.id,
            "luftpause.run_id": turn.run_id,
            "luftpause.service_class": turn.class_name,
        }
        if turn.route == "chat":
            attributes["gen_ai.operation.name"] = "chat"
        turn.span = tracer.start_span(
            f"{turn.route} {turn.model}",
            context=tracing.parent(turn.traceparent),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        turn.traceparent = tracing.traceparent_of(turn.span)

    def closed(self, turn: ProxiedTurn) -> None:
        if turn.span is not None:
            turn.span.end()

    def refused(self, turn: ProxiedTurn, message: str) -> None:
        """The scheduler refused the turn (it never reached a replica)."""
        if turn.span is not None:
            turn.span.set_attribute("luftpause.outcome", "refused")
            turn.span.set_status(StatusCode.ERROR, message)
        self.metrics.ended(turn.route, "refused", turn.class_name)

    def abandoned(self, turn: ProxiedTurn) -> None:
        """Its client left while it was held."""
        if turn.span is not None:
            turn.span.set_attribute("luftpause.outcome", "abandoned")
        self.metrics.ended(turn.route, "abandoned", turn.class_name)

    def admitted(self, turn: ProxiedTurn, held_s: float) -> None:
        """Placed on `turn.replica` after `held_s` held: one more turn in flight."""
        self.metrics.admitted(turn.class_name, turn.replica, held_s)
        if turn.span is not None:
            turn.span.set_attributes(
                {"luftpause.replica": turn.replica, "luftpause.held_ms": held_s * 1000.0}
            )
        self.metrics.in_flight.inc()

    def engine_answered(self, turn: ProxiedTurn) -> None:
        """The engine's response began: how long it kept the request before answering."""
        if turn.span is not None:
            turn.span.set_attribute(
                "luftpause.engine_queue_ms", (time.perf_counter() - turn.sent_at) * 1000.0
            )

    def first_token(self, turn: ProxiedTurn, to_first_s: float) -> None:
        self.metrics.first_token(turn.class_name, turn.replica, to_first_s)
        if turn.span is not None:
            turn.span.set_attribute("luftpause.time_to_first_token_ms", to_first_s * 1000.0)

    def engine_error(self, turn: ProxiedTurn, kind: str) -> None:
        """The engine failed the turn in a way of `kind` (metrics.ENGINE_ERRORS)."""
        self.metrics.engine_error(kind, turn.replica)

    def ended(self, turn: ProxiedTurn, outcome: str) -> None:
        """The turn left the engine, `outcome` "completed" or "failed": no longer in flight."""
        if turn.span is not None:
            turn.span.set_attribute("luftpause.outcome", outcome)
        self.metrics.in_flight.dec()
        self.metrics.ended(turn.route, outcome, turn.class_name)
        if turn.sent_at:
            self.metrics.turn_ended(turn.class_name, turn.replica, time.perf_counter() - turn.sent_at)

    def failed(self, turn: ProxiedTurn, error: str) -> None:
        self.ended(turn, "failed")
        if turn.span is not None:
            turn.span.set_status(StatusCode.ERROR, error)

    def completed(self, turn: ProxiedTurn, observation: ReplyObservation) -> None:
        self.ended(turn, "completed")
        if turn.span is not None:
            turn.span.set_attributes(
                {
                    "gen_ai.response.finish_reasons": [observation.finish_reason],
                    "gen_ai.usage.input_tokens": observation.prompt_tokens,
                    "gen_ai.usage.output_tokens": observation.completion_tokens,
                }
            )
