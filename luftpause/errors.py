"""The error body every luftpause service answers with: `{"error": {"message": "..."}}`.

It is the shape OpenAI-compatible clients read, so the dataplane's own refusals, the other
services' (host guard, status page) and the fake engine's look alike to them. The refusal of a
turn no replica can take (`no_replica_serves`) is worded here once, for the scheduler that
decides it and the dataplane that answers it.
"""

from __future__ import annotations

import json


def error_body(message: str) -> dict[str, dict[str, str]]:
    return {"error": {"message": message}}


def error_json(message: str) -> bytes:
    """The body as bytes, for responses written below the web framework."""
    return json.dumps(error_body(message)).encode()


# A replica kind as the config spells it -> as messages clients see name it.
KIND_LABELS = {"generative": "Generative", "single-pass": "SinglePass"}


def no_replica_serves(kind: str, model: str) -> str:
    """Why a turn is refused at once (404 at the dataplane): no replica of `kind` serves `model`."""
    return f"no {KIND_LABELS[kind]} replica serves model '{model}'"
