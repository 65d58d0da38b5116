"""The error body every luftpause service answers with: `{"error": {"message": "..."}}`.

It is the shape OpenAI-compatible clients read, so the dataplane's own refusals, the other
services' (host guard, status page) and the fake engine's look alike to them.
"""

from __future__ import annotations

import json


def error_body(message: str) -> dict[str, dict[str, str]]:
    return {"error": {"message": message}}


def error_json(message: str) -> bytes:
    """The body as bytes, for responses written below the web framework."""
    return json.dumps(error_body(message)).encode()
