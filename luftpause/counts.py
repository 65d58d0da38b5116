"""Numbers that come from an engine or a peer, checked where they come in.

An engine's usage (`prompt_tokens`, `completion_tokens`) and a dataplane's resync (a run's
`idle_s`) are read by code that trusts them: the scheduler's run gate sizes runs by the counts,
its status documents and expiry indexes take the times, the runtime's token budgets add the
counts up, and the gRPC messages that carry them hold int64s only. One engine answering
`completion_tokens: 1e30`, `-5` or `NaN` must not break any of that. So every such number goes
through one of these at the edge, and one that is out of range counts as unknown (None), which
each reader then treats as it treats a number never sent:

- a token count is a whole number (not a bool) in 0..MAX_TOKEN_COUNT (2^31 - 1: no context
  window comes near, and every message and counter that carries one holds it);
- a duration is a finite number of seconds, not negative, at most MAX_DURATION_S;
- the tool names a reply called: strings, each cut to TOOL_NAME_CHARS, the first MAX_TOOL_NAMES
  of them (a reply may call any number of tools with any names a client declared).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# The largest token count taken from an engine or a peer.
MAX_TOKEN_COUNT = 2**31 - 1
# The longest duration taken from a peer: a year, far beyond any expiry the scheduler keeps.
MAX_DURATION_S = 365 * 24 * 3600.0
# The most tool names of one reply taken, and the most characters of each.
MAX_TOOL_NAMES = 16
TOOL_NAME_CHARS = 64


def token_count(value: object) -> int | None:
    """`value` as a token count, or None when it is not a whole number in 0..MAX_TOKEN_COUNT."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


def duration_s(value: object) -> float | None:
    """`value` as seconds, or None when it is not a finite number in 0..MAX_DURATION_S."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and 0.0 <= seconds <= MAX_DURATION_S else None


def tool_names(values: Iterable[object]) -> tuple[str, ...]:
    """The non-empty strings among `values`, each once, each cut to TOOL_NAME_CHARS, the first
    MAX_TOOL_NAMES of them."""
    names: list[str] = []
    for value in values:
        if isinstance(value, str) and value:
            name = value[:TOOL_NAME_CHARS]
            if name not in names:
                names.append(name)
                if len(names) == MAX_TOOL_NAMES:
                    break
    return tuple(names)
