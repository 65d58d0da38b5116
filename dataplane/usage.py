"""A streamed turn's usage: asked of the engine whether or not the client asked for it.

The scheduler's run gate sizes each run by the prompt and completion tokens the dataplane
reports as a turn completes (scheduler/gate.py). A streamed reply carries them only when the
request sets `stream_options.include_usage` (the OpenAI API, SGLang, vLLM, llama-server): a last
chunk with `choices: []` and a `usage` object then comes before `[DONE]`. Most clients do not
ask (the OpenAI SDK's default), so for a streamed turn the dataplane asks on the client's
behalf (`asking_for_usage`), and the stream reader takes out again what the client did not ask
for (`sse.StreamObserver` with `hide_usage`). A client that set `include_usage: false` counts as
not asking. A replica whose engine refuses unknown `stream_options` says `stream_usage = false`
(luftpause/config.py) and gets the body as the client sent it; which engines those are is the
operator's to say, not guessed from the replica's other settings.
"""

from __future__ import annotations

from typing import Any

from luftpause.dataplane.body import encoded, with_first_member

_ASK = b'"stream_options":{"include_usage":true}'


def client_asked(payload: dict[str, Any]) -> bool:
    """Whether a chat body asks for usage in its stream itself."""
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def asking_for_usage(body: bytes, payload: dict[str, Any]) -> bytes:
    """`body` (whose decoded JSON is `payload`, which does not ask for usage) asking for it.

    Without `stream_options` the member goes in first and the client's bytes follow unchanged;
    with its own (other keys, or `include_usage: false`), those are kept and the body is encoded
    anew. A `stream_options` that is not an object (nor null) is left for the engine to refuse,
    as it would refuse it without luftpause.
    """
    if "stream_options" not in payload:
        return with_first_member(body, _ASK)
    options = payload["stream_options"]
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return body
    return encoded({**payload, "stream_options": {**options, "include_usage": True}})
