"""The failures the dataplane answers itself, and the one error body clients see for them.

Every error the dataplane makes is `{"error": {"message": "..."}}` with a status that says whose
fault it is. An engine's own error response is not one of these: it goes to the client
unchanged, status, body and Retry-After included.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

from luftpause.errors import error_body


class TurnRefused(Exception):
    """A turn the dataplane answers with an error of its own instead of an engine's reply."""

    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadTurnRequest(TurnRefused):
    """The request cannot be a turn: its body or one of our headers is malformed."""

    status_code = 400


class BodyTooLarge(TurnRefused):
    """The request body is longer than the dataplane takes (`[dataplane] max_body_bytes`)."""

    status_code = 413


class UnknownModel(TurnRefused):
    """No replica of the pool serves the requested model; retrying gets the same answer."""

    status_code = 404


class ReplicaUnreachable(TurnRefused):
    """The placed turn's engine could not be reached, or broke off before answering (the 502 the
    client gets for the engine client's `EngineUnreachable`)."""

    status_code = 502

    def __init__(self, replica: str, error: BaseException) -> None:
        super().__init__(f"engine {replica}: {describe(error)}")


class ReplicaUnreadable(TurnRefused):
    """The placed turn's engine answered 200 with what is not a reply: a body that is not JSON, a
    stream that is not server-sent events of JSON, or one that ended before its reply did; the 502
    the client gets before its response began (after, a stream not of JSON ends with this as an
    error event, and one cut short just closes without its last chunk)."""

    status_code = 502

    def __init__(self, replica: str, reason: str) -> None:
        super().__init__(f"engine {replica}: {reason}")


class ReplicaTooSlow(ReplicaUnreachable):
    """The placed turn's engine took the request and sent nothing back within the first-byte
    timeout (`[dataplane] engine_first_byte_timeout_s`): hung, or stopped."""

    status_code = 504


class SchedulerFailed(TurnRefused):
    """The scheduler answered the admission with an error other than being unreachable."""

    status_code = 503


class DataplaneStopping(TurnRefused):
    """The dataplane is shutting down with the turn still open; it never ran, or its reply is lost."""

    status_code = 503


def describe(error: BaseException) -> str:
    """A one-line account of an exception; some transport errors carry no text of their own."""
    text = str(error).strip()
    return text if text else type(error).__name__


def error_response(status_code: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status_code, headers=dict(headers or {}))


def refusal_response(refusal: TurnRefused, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return error_response(refusal.status_code, refusal.message, headers)
