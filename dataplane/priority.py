"""Engine priorities: which `priority` a turn's engine request carries, and how it is put in.

A replica whose engine orders its own waiting queue by the request body's top-level `priority`
says so in its config (`engine_priority`). For such a replica the dataplane writes the turn's
service class into the body as a number, so that inside the engine too an interactive turn goes
before a batch one. Every other replica gets the body exactly as the client sent it.

What the engines do with the field (read in their source and help texts, 2026):

- SGLang (`--enable-priority-scheduling`): the chat request's `priority` is an optional int.
  Higher values are taken first, arrival breaks ties; `--schedule-low-priority-values-first`
  turns that around. A request without one gets the worst possible value (the last place),
  unless newer versions' `--default-priority-value` says otherwise. An arriving request may
  preempt running ones whose priority is worse by more than
  `--priority-scheduling-preemption-threshold` (10 by default). With priority scheduling off the
  field is ignored, or the request is refused with `--abort-on-priority-when-disabled`.
- vLLM (`--scheduling-policy priority`): `priority` is an int, 0 by default; lower values are
  taken first, arrival breaks ties. Any value but 0 is an error unless that policy is on, which
  is why nothing is added for a replica that does not declare it.

The numbers: batch turns get 0 and interactive ones one step towards the front (+1 where
higher goes first, -1 where lower does). 0 is vLLM's default and accepted by vLLM under any
policy; SGLang needs it written, since a missing value would put batch turns behind everyone
and let any prioritised request preempt them. A gap of 1 stays far below SGLang's preemption
threshold: the engine reorders its queue but does not throw away the decoding a running batch
turn has done (the scheduler already keeps room for interactive turns). An operator who wants
preemption lowers that threshold on the engine.

The body is not decoded and encoded again: `"priority":N,` goes in right after the object's
opening brace, one copy of the bytes (`body.with_first_member`). A body whose top level already has `priority` is left
alone: the client's choice wins. Whether it has one is read from the JSON the proxy decoded
anyway (a byte search would also find the word in a message).
"""

from __future__ import annotations

from typing import Literal

from luftpause.dataplane.body import with_first_member
from luftpause.proto import pb

Convention = Literal["none", "sglang", "vllm"]

# The value each class is sent with, per convention ("none" sends none).
_PRIORITY: dict[Convention, dict[pb.ServiceClass, int]] = {
    "sglang": {pb.INTERACTIVE: 1, pb.BATCH: 0},
    "vllm": {pb.INTERACTIVE: -1, pb.BATCH: 0},
}


def priority_for(convention: Convention, service_class: pb.ServiceClass) -> int | None:
    """The priority a turn of `service_class` is sent with, or None when none is added."""
    per_class = _PRIORITY.get(convention)
    return None if per_class is None else per_class[service_class]


def engine_body(
    body: bytes, convention: Convention, service_class: pb.ServiceClass, client_chose: bool
) -> bytes:
    """The body for the engine: `body` with the class's priority in, or `body` itself.

    `client_chose` says the body's top-level object already has a `priority`; it is kept.
    """
    if client_chose:
        return body
    priority = priority_for(convention, service_class)
    return body if priority is None else with_priority(body, priority)


def with_priority(body: bytes, priority: int) -> bytes:
    """`body`, a JSON object without a top-level `priority`, with `"priority":N` as its first member
    (or unchanged where it does not open with `{` in UTF-8: `body.with_first_member`)."""
    return with_first_member(body, b'"priority":%d' % priority)
