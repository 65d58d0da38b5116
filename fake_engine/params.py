"""The engine model's parameters, in one place, with the reasoning behind each default.

The defaults describe one replica of the description's test bed: SGLang serving Llama-3.2-1B
FP8, two replicas sharing one 8 GB laptop GPU. They were calibrated once (see
`bench/sim/CALIBRATION.md`) so that the class-blind router arms of the `flood` scenario land near
the description's class-blind router row, and are not tuned afterwards. A separate process takes
overrides from $LUFTPAUSE_FAKE_ENGINE_TIMING, written `field=value,field=value`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class EngineParams:
    """What one engine replica can hold and how fast it works."""

    slots: int = 0
    """Running requests at most (SGLang's max_running_requests). 0 means as many as the KV pool
    holds, which is SGLang's own behaviour on a small GPU: memory, not a request cap, limits it."""

    kv_pool_tokens: int = 32768
    """Tokens of KV memory: 1 GiB per replica at Llama-3.2-1B's 32 KiB a token, about what is
    left to each of two replicas on an 8 GB GPU after weights, graphs and activations. Room for
    about twelve turns of a flood run (2.3k prompt + 256 reserved for the reply) at once, far
    fewer than the 26 runs each replica carries in the flood: the pool, not a request cap, is
    what makes the engine queue, and the prefix cache churns."""

    default_max_tokens: int = 4096
    """Reply reservation when a request sets no max_tokens. A large default is what made the
    description's engine batch far fewer requests without a reply limit."""

    prefill_base_s: float = 0.010
    """Fixed cost of a prefill pass: scheduling the batch and launching kernels."""

    prefill_per_token_s: float = 0.00005
    """20k uncached prompt tokens a second: a 1B model's prefill on half a laptop GPU. A fresh
    2k-token prompt costs a tenth of a second, during which the replica decodes nothing."""

    decode_base_s: float = 0.008
    """Time of one decode step with a single sequence: a small model is memory bound, so a step
    costs about the same whatever the batch, plus the per-sequence part below."""

    decode_per_seq_s: float = 0.003
    """What each running sequence adds to a decode step (attention over its context, sampling,
    the other replica competing for the same GPU). With nine running, a step takes 35 ms."""

    reply_tokens: int = 240
    """Length of a text answer when max_tokens allows. A 1B model asked to summarise thousands of
    characters writes until close to the 256-token limit agents send; 240 keeps the answer ending
    by itself ("stop"). With it an unloaded run of the light scenario takes about 16 s, which is
    the description's light-load figure (about 14 runs a minute for 4 agents). A tool call is as
    long as its arguments' JSON (a dozen tokens)."""

    priority_scheduling: bool = False
    """Whether the waiting queue is ordered by the request's `priority` (higher first, as SGLang's
    --enable-priority-scheduling) before arrival. Off: first come, first served."""

    priority_preemption: bool = False
    """Whether a queue head that does not fit may preempt running requests whose priority is worse
    than its own by more than `preemption_threshold`, as SGLang does with priority scheduling
    unless --disable-priority-preemption (see `engine`). Off: nothing running is ever preempted,
    which is what the calibration assumed (its priorities were never that far apart)."""

    preemption_threshold: int = 10
    """How much worse a running request's priority must be to be preempted: SGLang's
    --priority-scheduling-preemption-threshold, 10 by default there too."""


def params_from_env(spec: str, base: EngineParams | None = None) -> EngineParams:
    """`base` (default: the defaults) with overrides written `field=value,field=value`.

    Tests that need a slow engine in a separate process set these through the environment.
    """
    defaults = base or EngineParams()
    # Each value has its field's type (checked above), which a single value type cannot say.
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not hasattr(defaults, key):
            known = ", ".join(f.name for f in fields(EngineParams))
            raise ValueError(
                f"bad engine timing override '{item}': expected field=value with field one of {known}"
            )
        kind = type(getattr(defaults, key))
        text = value.strip()
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"bad engine timing override '{item}': {key} must be true or false")
            overrides[key] = text.lower() in ("true", "1")
            continue
        try:
            overrides[key] = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"bad engine timing override '{item}': {key} must be {what}") from None
    return replace(defaults, **overrides)
