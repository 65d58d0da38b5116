"""Token logprobs for the fake engine's text replies, deterministic from the conversation.

What they are for: `decide` with caller-given labels asks a generative replica for one token with
`top_logprobs` and scores each label by its first token's logprob. So that this works against the
fake engine, the alternatives offered for the first token are the words of the last user message
(where a caller lists its labels), each with a hash-derived probability; labels that do not make
the top `k` are simply absent, as with a real model. The emitted token is always the most likely
one (probability `EMITTED_P`); the alternatives share the rest, so the probabilities never sum
above one. Later tokens offer filler words as alternatives. Tool-call replies carry no logprobs.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from luftpause.fake_engine.replies import Reply
from luftpause.fake_engine.tokens import content_text

EMITTED_P = 0.5
_WORD = re.compile(r"[A-Za-z0-9_\-]+")
_FILLER_ALTERNATIVES = ("the", "a", "and", "so", "it", "this", "that", "then")


def _score(seed: str, word: str) -> float:
    """A pseudo-logit in [0, 4): how much the fake model likes `word` here."""
    return 4 * int.from_bytes(hashlib.sha256(f"{seed}\x1f{word}".encode()).digest()[:4], "big") / 2**32


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _alternatives(words: Sequence[str], emitted: str, seed: str, k: int) -> list[dict[str, Any]]:
    """The emitted token first, then up to `k - 1` of `words` by descending probability."""
    others = list(dict.fromkeys(w for w in words if w != emitted.strip()))
    if not others or k <= 1:
        return [_entry(emitted, math.log(EMITTED_P))][:k]
    scores = {w: _score(seed, w) for w in others}
    total = sum(math.exp(s) for s in scores.values())
    ranked = sorted(others, key=lambda w: (-scores[w], w))[: k - 1]
    rest = 1 - EMITTED_P
    return [_entry(emitted, math.log(EMITTED_P))] + [
        _entry(w, math.log(rest * math.exp(scores[w]) / total)) for w in ranked
    ]


def reply_logprobs(
    messages: Sequence[Mapping[str, Any]], reply: Reply, top_k: int
) -> list[dict[str, Any]] | None:
    """One OpenAI logprobs entry per token of a text reply; None for a tool call."""
    if reply.tool_call is not None:
        return None
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    prompt_words = [
        w.lower() for w in _WORD.findall(content_text(last_user.get("content") if last_user else ""))
    ]
    seed = hashlib.sha256(repr([content_text(m.get("content")) for m in messages]).encode()).hexdigest()
    entries = []
    for index, piece in enumerate(reply.pieces):
        words = prompt_words if index == 0 else list(_FILLER_ALTERNATIVES)
        top = _alternatives(words, piece, f"{seed}:{index}", top_k)
        entries.append({**_entry(piece, math.log(EMITTED_P)), "top_logprobs": top})
    return entries
