"""The request a placed turn sends its engine: the client's body as it came, but for the class's
priority where the replica's engine honours one and the slot its run's KV stays in; the engine's
own key instead of the client's; the turn's traceparent; the URL under the replica's base."""

from __future__ import annotations

from luftpause import config as lp_config
from luftpause.dataplane import headers, priority
from luftpause.dataplane.body import with_first_member
from luftpause.dataplane.engine_client import EngineRequest
from luftpause.dataplane.turn import ProxiedTurn
from luftpause.proto import pb


def engine_request(
    config: lp_config.Config, turn: ProxiedTurn, placement: pb.AdmitReply, endpoint: str, body: bytes
) -> EngineRequest:
    """A POST of `body` to the placed replica's `endpoint` (as `engine_url` reads it).

    A generative turn to a replica whose engine honours priorities carries its class's
    priority in the body. Single-pass requests (vLLM's /classify) are left alone: that
    request shape's priority handling is not one we have checked.
    """
    replica = config.replica(placement.replica)
    if replica is not None and replica.engine_priority != "none" and turn.kind == pb.GENERATIVE:
        body = priority.engine_body(body, replica.engine_priority, turn.service_class, turn.client_priority)
    if placement.HasField("slot") and turn.kind == pb.GENERATIVE:
        # The slot its run's KV stays in (scheduler/core/place.py `_slot_for`); a client's own
        # `id_slot` comes later in the body and wins.
        body = with_first_member(body, b'"id_slot":%d' % placement.slot)
    base = placement.url or (replica.url if replica else "")
    outgoing = {
        "content-type": "application/json",
        # The bytes are passed through as they come and read on the side: they must not be compressed.
        "accept-encoding": "identity",
    }
    # The client's own Authorization never goes upstream; an engine gets the key configured for it.
    api_key = replica.api_key() if replica else None
    if api_key:
        outgoing["authorization"] = f"Bearer {api_key}"
    if turn.traceparent:
        outgoing[headers.TRACEPARENT] = turn.traceparent
    return EngineRequest(engine_url(base, endpoint), outgoing, body)


def engine_url(base: str, endpoint: str) -> str:
    """The URL of `endpoint` under a replica's base URL: "chat/completions" under /v1, "/classify" at the root.

    Engines are configured by their root (`http://host:30000`); hosted APIs are often given with
    their `/v1` already on (`https://api.example.com/v1`), which must not be doubled.
    """
    base = base.rstrip("/")
    root = base.removesuffix("/v1")
    return f"{root}{endpoint}" if endpoint.startswith("/") else f"{root}/v1/{endpoint}"
