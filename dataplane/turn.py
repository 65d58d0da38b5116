"""A turn as the dataplane carries it from its request to its report (`ProxiedTurn`), with the
two forms it takes on the way (what the scheduler is asked to admit, what the run book keeps
once it is placed), and what is read off a request's body to make one: the JSON object with its
model (`request_object`, for every route) and the reply limit it sets (`requested_max_tokens`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from luftpause.dataplane import headers
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.dataplane.runs import PlacedTurn
from luftpause.proto import pb


@dataclass(slots=True)
class ProxiedTurn:
    id: str
    run_id: str
    service_class: pb.ServiceClass
    caller: str
    model: str
    traceparent: str
    # Which route it came through, for the metrics: "chat" or "decide".
    route: str = "chat"
    kind: pb.ReplicaKind = pb.GENERATIVE
    # The run the scheduler is told about; "" keeps the turn outside run state (decide).
    scheduled_run_id: str | None = None
    # With no run header: the tool_call_ids the messages echo, newest first, by which the
    # scheduler may find the run (then `run_id` becomes that run's).
    echoed: tuple[str, ...] = ()
    replica: str = ""
    # The client's body has a top-level "priority" of its own, which the engine gets unchanged.
    client_priority: bool = False
    # The client asked for a streamed reply: the engine's first token is then seen as it comes,
    # which is what tells the scheduler that the engine started the turn (admission.py).
    streamed: bool = False
    # The client's body asks for usage in its stream itself (`usage.client_asked`).
    client_usage: bool = False
    # The body's size in bytes as received, and the reply limit it sets (0: none): what the
    # scheduler's run gate sizes the turn by until its usage is known (AdmitRequest).
    request_bytes: int = 0
    max_tokens: int = 0
    # When the engine request went out (perf_counter), for the time to the first token.
    sent_at: float = 0.0
    # Placed by the scheduler, and reported completed or failed: what a stop midway must tidy up.
    placed: bool = False
    ended: bool = False
    first_token_seen: bool = False
    # Its span while tracing is on (luftpause/tracing.py); None, and never made, while it is off.
    span: Span | None = None

    @property
    def scheduler_run_id(self) -> str:
        return self.run_id if self.scheduled_run_id is None else self.scheduled_run_id

    @property
    def class_name(self) -> str:
        """Its class as the metrics and spans name it ("interactive", "batch")."""
        return headers.class_name(self.service_class)

    def admit_request(self) -> pb.AdmitRequest:
        """The turn as the scheduler is asked to admit it (its span's traceparent, once opened)."""
        return pb.AdmitRequest(
            turn_id=self.id,
            run_id=self.scheduler_run_id,
            service_class=self.service_class,
            caller=self.caller,
            model=self.model,
            kind=self.kind,
            traceparent=self.traceparent,
            echoed_tool_call_ids=self.echoed,
            request_bytes=self.request_bytes,
            max_tokens=self.max_tokens,
        )

    def booked(self) -> PlacedTurn:
        """The turn as the run book keeps it once placed, for a restarted scheduler's resync."""
        return PlacedTurn(
            self.id,
            self.scheduler_run_id,
            self.replica,
            self.service_class,
            self.caller,
            self.model,
            self.kind,
            self.max_tokens,
        )


# The most an int64 field of the scheduler's messages holds.
_INT64_MAX = 2**63 - 1


def requested_max_tokens(payload: dict[str, Any]) -> int:
    """The reply limit a chat body sets: `max_completion_tokens` (OpenAI's newer name, which
    engines take over `max_tokens` when both are sent) or `max_tokens`; 0 when neither is a whole
    number above zero. The engine still gets the body as sent: this only tells the scheduler."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, _INT64_MAX)
    return 0


def request_object(body: bytes) -> dict[str, Any]:
    """A turn's request body as its JSON object, which names its model; BadTurnRequest says
    what is wrong with a body that is not that. Each route reads the rest of it for itself."""
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise BadTurnRequest(f"request body must be JSON: {e}") from None
    if not isinstance(payload, dict):
        raise BadTurnRequest("request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadTurnRequest('request body must name the model as a string in "model"')
    return payload
