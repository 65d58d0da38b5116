"""The luftpause request and response headers, and the rules for reading the request ones.

In:  `x-luftpause-run-id` (the run: UTF-8, at most 256 bytes, no control characters), `x-luftpause-class` (interactive, the default, or batch),
     `x-luftpause-caller` (who is asking, for fairness; cut at 128 bytes, absent = the shared
     anonymous caller "").
Out: `x-luftpause-run-id` on every response but the scheduler-unreachable case (where the client
     gets no response at all while the turn is held), the refusal of a bad run id header itself
     and a 401 (the token is checked before anything of the request is read),
     `x-luftpause-replica` once a turn is placed.

HTTP servers hand header values over decoded as latin-1, byte for byte; encoding back to latin-1
recovers the bytes the client sent, which are read as UTF-8. `on_the_wire` is the way back: a run
id the client sent in UTF-8 is echoed in the same bytes.
"""

from __future__ import annotations

from luftpause import lifecycle
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.lifecycle import CALLER_MAX_BYTES
from luftpause.proto import CLASS_BY_NAME, CLASS_NAMES, pb

RUN_ID = lifecycle.RUN_ID_HEADER
SERVICE_CLASS = lifecycle.CLASS_HEADER
CALLER = lifecycle.CALLER_HEADER
REPLICA = lifecycle.REPLICA_HEADER
TRACEPARENT = lifecycle.TRACEPARENT_HEADER

RUN_ID_MAX_BYTES = 256
ANONYMOUS_CALLER = ""


def service_class(value: str | None) -> pb.ServiceClass:
    """The turn's service class; an absent header means interactive, an unknown value is a 400."""
    if value is None:
        return pb.INTERACTIVE
    try:
        return CLASS_BY_NAME[value.strip()]
    except KeyError:
        allowed = " or ".join(repr(name) for name in CLASS_BY_NAME)
        raise BadTurnRequest(f"{SERVICE_CLASS} must be {allowed}, not {value!r}") from None


def class_name(value: pb.ServiceClass) -> str:
    """The header's name for a service class: the inverse of `service_class`."""
    return CLASS_NAMES[value]


def caller(value: str | None) -> str:
    """The caller, cut to at most 128 bytes of UTF-8 without splitting a character."""
    if value is None:
        return ANONYMOUS_CALLER
    raw = value.encode("latin-1", errors="replace")
    if len(raw) > CALLER_MAX_BYTES:
        end = CALLER_MAX_BYTES
        # A continuation byte (0b10xxxxxx) right after the cut means a character straddles it:
        # back off to where that character starts and leave it out whole.
        while end > 0 and raw[end] & 0xC0 == 0x80:
            end -= 1
        raw = raw[:end]
    return raw.decode("utf-8", errors="replace")


def run_id(value: str | None) -> str | None:
    """The run the request's header names, as text, or None when the header is absent or blank.

    A value longer than 256 bytes, or one that is not UTF-8, is a 400 (BadTurnRequest).
    """
    if value is None:
        return None
    raw = value.encode("latin-1", errors="replace").strip()
    return _run_id_of(raw) if raw else None


def path_run_id(text: str) -> str:
    """A run id given in a URL path (already decoded as UTF-8), held to the header's rules."""
    raw = text.encode("utf-8").strip()
    if not raw:
        raise BadTurnRequest("the run id is empty")
    return _run_id_of(raw)


def _run_id_of(raw: bytes) -> str:
    if len(raw) > RUN_ID_MAX_BYTES:
        raise BadTurnRequest(f"the run id is {len(raw):,} bytes long; at most {RUN_ID_MAX_BYTES} are allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadTurnRequest(f"{RUN_ID} must be UTF-8 text") from None
    # It is echoed in a response header, where a control character (a CR from `%0D` in a path)
    # cannot go: refused here rather than breaking the response.
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise BadTurnRequest("the run id must not contain control characters")
    return text


def on_the_wire(text: str) -> str:
    """A header value as an ASGI server sends it (latin-1, byte for byte): the UTF-8 bytes of `text`."""
    return text.encode("utf-8").decode("latin-1")
