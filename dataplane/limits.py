"""How much the dataplane takes in one request, and the errors for what is over.

A turn's body is read whole before anything else happens (it names the model and holds the
messages whose tool_call_ids identify the run), so without a bound one client could make the
dataplane hold any amount of memory. The bound is the config's `[dataplane] max_body_bytes`;
a body over it is refused 413 before it is read past the bound, from its Content-Length when it
has one. The other sizes a client chooses, the run id and the caller, are bounded where the
headers are read (`headers.run_id`, `headers.caller`).
"""

from __future__ import annotations

from starlette.requests import Request

from luftpause.dataplane.errors import BodyTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The request's whole body; BodyTooLarge once it is longer than `limit` bytes.

    Raises starlette's ClientDisconnect when the client leaves while sending it.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(int(declared), limit))
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(_too_large(None, limit))
        parts.append(chunk)
    return b"".join(parts)


def _too_large(size: int | None, limit: int) -> str:
    what = f"{size:,} bytes" if size is not None else "longer than that"
    return (
        f"request body is {what}; this dataplane takes at most {limit:,} bytes "
        "(raise [dataplane] max_body_bytes in the config to allow more)"
    )
