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

    slot_kv: bool = False
    """Whether each of the `slots` keeps its own KV, as llama.cpp's `--parallel` slots do, instead
    of one shared pool with a prefix cache (SGLang's radix tree). On: `kv_pool_tokens` is split
    evenly between the slots (llama-server's `--ctx-size` over `--parallel`); a request takes an
    idle slot, preferring the one whose cached prompt shares the longest prefix with its own,
    else the least recently used; a slot's cache is its last request's prompt and reply, and a
    request whose prompt does not fit a slot is rejected. Needs `slots` > 0. Off: the shared
    pool, as calibrated."""

    host_cache_tokens: int = 0
    """Tokens of prefixes a host tier behind the KV keeps (0: no host tier, as calibrated). A
    prefix the pool evicts (or a slot drops when another request takes it) is kept in host
    memory, least recently used going first past this many tokens, and a later request with that
    prefix restores it at `host_restore_per_token_s` instead of prefilling it: llama-server's
    `--cache-ram` (on by default there), SGLang's HiCache."""

    host_restore_per_token_s: float = 0.0
    """What restoring one token of KV from the host tier costs, in the prefill pass that admits
    the request (a copy, far below prefill's compute)."""


REAL_TOKENS_PER_TOKEN = 2702 / 4399
"""Tokens of `bench.llamacpp_model`'s tokenizer (with its chat template) per token of this model's
count (`tokens`, four characters a token): the load generator's `first_messages(seed, 17000)`
with its two tools is 2,702 tokens to llama-server (the model's docstring) and 4,399 here. The
preset below states llama.cpp's costs per token of this model's count through it."""

LLAMACPP_ONE_CORE = EngineParams(
    slots=4,
    slot_kv=True,
    kv_pool_tokens=4 * round(4096 / REAL_TOKENS_PER_TOKEN),
    prefill_base_s=0.044,
    prefill_per_token_s=0.000962 * REAL_TOKENS_PER_TOKEN,
    decode_base_s=0.0016,
    decode_per_seq_s=0.0168,
    reply_tokens=32,
    host_cache_tokens=round(8192 * 2**20 / 9216 / REAL_TOKENS_PER_TOKEN),
    host_restore_per_token_s=2 * 7.6e-6 * REAL_TOKENS_PER_TOKEN,
)
"""One replica of `bench/real_flood.py`: llama-server (the cached build, b11434) with `--parallel 4`
slots of 4096 tokens and one thread, two replicas sharing one core, serving
`bench.llamacpp_model`'s model (22.7 MB, 6 layers of 384). A calibration of its own, measured
2026-12-03 on the 2-core build machine with nothing else running, not fitted to any flood figure:

    python -m luftpause.bench.llamacpp_model /tmp/twin/model.gguf
    taskset -c 0 llama-server -m /tmp/twin/model.gguf --parallel 4 --ctx-size 16384 --threads 1 \
        --metrics --jinja --no-webui --cache-ram 0            # twice, on two ports, for two engines

driven by a short client of `/v1/chat/completions` with the load generator's messages and
tools (`first_messages(seed, 2000 | 8000 | 17000)`, then each with a tool call and its answer
appended), reading llama-server's own `timings`:

- `slots` 4, `slot_kv`: each slot keeps its own KV; `kv_pool_tokens` is 4 x 4096 tokens of the
  model's tokenizer, in this model's count (`REAL_TOKENS_PER_TOKEN`).
- `prefill_base_s` 44 ms, `prefill_per_token_s` 0.96 ms a real token: a line through the
  prefills of 120 to 1,150 tokens (the flood's range: an 8000-character first turn is about
  1,140 tokens, a tool round about 125) with two engines prefilling at once on the one core.
  Alone on the core the same line is 28 ms + 0.45 ms a token: each of two busy engines gets
  about half of it, as under the flood, where both are busy nearly all the time. Longer
  contexts cost more a token (2,420 tokens: 1.42 ms a token with two engines), which a line
  does not follow; the flood stays under 1,600.
- `decode_base_s` 1.6 ms, `decode_per_seq_s` 16.8 ms: with 1, 2, 3, 4 slots decoding at once
  on each of two engines (prompts of 1,140-1,430 tokens, each pinned to its slot with
  `id_slot` so that nothing prefilled meanwhile), 18.1, 36.2, 52.9, 68.3 ms a step; alone,
  7.6, 16.0, 24.1, 33.5. On one thread a step costs each sequence its own: no batching gain.
- `reply_tokens` 32: the real flood's max_tokens; its model's random replies run to the limit.
- `host_cache_tokens`: llama-server's `--cache-ram` default of 8192 MiB, at 9,216 bytes of KV a
  token (6 layers x K and V x 384 x f16): about 932k tokens, more than the flood ever holds.
- `host_restore_per_token_s`: one slot with the host cache on, prompt A, then B (A goes to host
  memory), then A again, against A twice: the third request took 10, 40 and 22 ms longer in three
  tries, for B's state saved and A's loaded (2 x 1,420 tokens): 7.6 us a token (median; 3.5 to
  14), alone on the core; doubled for two engines. A hundred times below prefill.
"""


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
