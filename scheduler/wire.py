"""The Turns and Resync messages as the core's vocabulary: a dataplane's admission, turn events and
resync become core events (`turn_event`, `turn_fields`, `resynced`, each number off the wire
checked by luftpause/counts.py), and the core's `Place` or `Refuse` becomes the placement the
dataplane reads (`placement`). The maps between the wire's enums and the core's are here once,
but for the classes' and the phases', which the dataplane reads too (luftpause.proto).
"""

from __future__ import annotations

from typing import Any

import grpc

from luftpause import counts
from luftpause.proto import CLASS_NAMES, DATAPLANE_KEY, PHASES, pb
from luftpause.scheduler import events as ev
from luftpause.scheduler.actions import Place, Refuse
from luftpause.scheduler.state import Kind, Phase, ServiceClass

CLASSES = {number: ServiceClass(name) for number, name in CLASS_NAMES.items()}
KINDS = {pb.GENERATIVE: Kind.GENERATIVE, pb.SINGLE_PASS: Kind.SINGLE_PASS}


def placement(action: Place | Refuse) -> pb.Placement:
    """The core's answer to a turn as the dataplane reads it."""
    if isinstance(action, Refuse):
        reply = pb.AdmitReply(
            outcome=pb.AdmitReply.UNKNOWN_MODEL, message=action.message, run_id=action.run_id
        )
    else:
        reply = pb.AdmitReply(
            outcome=pb.AdmitReply.PLACED,
            replica=action.replica,
            url=action.url,
            held_ms=action.held_s * 1000.0,
            run_id=action.run_id,
            reservation_id=action.reservation_id,
        )
        if action.slot is not None:
            reply.slot = action.slot
    return pb.Placement(turn_id=action.turn_id, reply=reply)


def turn_event(message: pb.TurnEvent, at: float) -> ev.Event | None:
    """The core event for one turn event from the Turns stream, or None for one with no event set."""
    match message.WhichOneof("event"):
        case "started":
            return ev.TurnStarted(message.turn_id, message.run_id, at, message.started.streamed)
        case "first_token":
            return ev.FirstToken(message.turn_id, message.run_id, at)
        case "completed":
            c = message.completed
            # A count out of range is unknown, as one never sent (0 on the wire): luftpause/counts.py.
            return ev.TurnCompleted(
                message.turn_id,
                message.run_id,
                c.finish_reason,
                counts.token_count(c.prompt_tokens) or 0,
                counts.token_count(c.completion_tokens) or 0,
                tuple(c.tool_call_ids),
                at,
                counts.tool_names(c.tool_names),
            )
        case "failed":
            failed = message.failed
            return ev.TurnFailed(message.turn_id, message.run_id, failed.error, at, failed.replica_fault)
        case "abandoned":
            return ev.TurnAbandoned(message.turn_id, message.run_id, at)
        case "run_ended":
            return ev.RunEnded(message.run_id, at)
    return None


def turn_fields(message: pb.AdmitRequest | pb.InFlightTurn) -> dict[str, Any]:
    """What an admission and a turn in a resync say alike about a turn, as the core's fields; an
    admission also its size, which a turn in a resync does not carry."""
    fields: dict[str, Any] = {
        "turn_id": message.turn_id,
        "run_id": message.run_id,
        "service_class": CLASSES.get(message.service_class, ServiceClass.INTERACTIVE),
        "caller": message.caller,
        "model": message.model,
        "kind": KINDS.get(message.kind, Kind.GENERATIVE),
    }
    if isinstance(message, pb.AdmitRequest):
        # 0 on the wire is "not sent" (an older dataplane, or a body without max_tokens).
        fields["request_bytes"] = max(0, message.request_bytes)
        fields["max_tokens"] = counts.token_count(message.max_tokens) or None
    return fields


def dataplane_of(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The name a call's dataplane gives itself; "" for a single unnamed one."""
    for key, value in context.invocation_metadata() or ():
        if key == DATAPLANE_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def resynced(request: pb.ResyncRequest, at: float, dataplane: str = "") -> ev.Resynced:
    """The core event for a whole resync (its messages' runs and turns put together)."""
    return ev.Resynced(
        runs=tuple(
            ev.ResyncedRun(
                run_id=r.run_id,
                replica=r.replica or None,
                phase=PHASES.get(r.phase, Phase.IDLE),
                service_class=CLASSES.get(r.service_class, ServiceClass.INTERACTIVE),
                caller=r.caller,
                # Not a finite time (NaN, inf, negative): unknown, taken as active just now.
                idle_s=counts.duration_s(r.idle_s) or 0.0,
                prompt_tokens=counts.token_count(r.prompt_tokens) or 0,
                completion_tokens=counts.token_count(r.completion_tokens) or 0,
                max_tokens=counts.token_count(r.max_tokens) or None,
                tool_names=counts.tool_names(r.tool_names),
            )
            for r in request.runs
        ),
        turns=tuple(ev.ResyncedTurn(**turn_fields(t), replica=t.replica) for t in request.turns),
        at=at,
        dataplane=dataplane,
    )
