"""Fairness between callers: who goes first among the turns of one class, by attained service.

Within a class, the drain places first the turn of the caller that has had the least of the
engines lately: its *attained service*, the engine tokens its turns asked for (each placed turn
charges its run's working set, or its request's estimate: gate.py), over a sliding window that
forgets at a half-life of `HALF_LIFE_S`. A caller that floods the engines with long contexts
waits behind one that asks for little, whatever their numbers of runs, and what a caller asked
for minutes ago weighs less than what another asks for now (after ten half-lives, a thousandth). Ties (two callers with nothing attained yet, both new) go to
the caller with fewer turns in flight, then to arrival. This is the program-aware fairness of
llm-d's flow control and of fair queueing's virtual time, kept so that the core never has to
revisit a caller as the clock moves.

The trick. A token attained at time t counts 2^-((now - t) / H) at time `now`. Every caller's
sum has the same factor 2^-(now / H), so comparing callers at any moment is comparing
Σ tokens · 2^(t / H), which changes only when a caller is charged. Its base-2 logarithm is what
the core keeps (`attain`): it grows by one every half-life of running time, so it never
overflows, and the order of the callers' keys is their order by attained service now.
"""

from __future__ import annotations

import math

# How fast attained service is forgotten: a token counts half after this long. A minute is a
# few agent runs of the flood (about 20 s each): long enough that a caller's turns in one run
# count against it in its next, short enough that a burst an hour ago does not.
HALF_LIFE_S = 60.0
# The key of a caller charged nothing yet: before every caller that was.
NONE = -math.inf


def attain(key: float, tokens: int, now: float) -> float:
    """A caller's key after `tokens` more at `now` (a key of `NONE`: none before)."""
    added = math.log2(tokens) + now / HALF_LIFE_S
    if key == NONE:
        return added
    high, low = (key, added) if key >= added else (added, key)
    return high + math.log2(1.0 + 2.0 ** (low - high))


def attained_tokens(key: float, now: float) -> float:
    """The tokens a key stands for at `now`, decayed: what the status document shows."""
    if key == NONE:
        return 0.0
    return float(2.0 ** (key - now / HALF_LIFE_S))
