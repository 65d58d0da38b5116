"""The run gate: a new run is placed only where the runs already held there, and it, fit the KV.

Theory of operation
-------------------

An engine keeps a paused run's prefix in its KV cache only while nothing else needs the room.
Under a flood every replica is asked to run more requests than its pool holds, so during each
run's tool call a few admissions of other runs evict its prefix, and it comes back to a cold
cache: every turn re-prefills its whole context, in every routing policy alike. What a turn
costs the engine is then the same whoever sends it, and class-aware routing can only move
throughput from batch to interactive, never add any. (Measured in the simulator's flood: a
continuation turn found 0 % of its own run's prefix cached in every arm that routes turns.)

So the scheduler admits *runs*, not only turns. A replica *holds* the runs placed there that are
generating, or paused on a tool for no longer than their keep time (`hold_for`); their working
sets (`working_set`: the prompt as last reported, what the reply wrote, and the next reply's
reservation) add up to what the engine needs to keep all of them warm. A turn of a held run goes
as before, within the lookahead: it is never made to wait for room. A new run, or one whose keep
time ran out (it comes back as a new run, and may re-prefill), is placed only on a replica where
the held working sets plus its own fit the pool less a headroom (`fits`); otherwise it waits, in
the drain's order (interactive first, then the caller with the least attained service, then
arrival: fairness.py), until a run ends, lets go of its place, or shrinks. The gate holds runs only where the
pool keeps at least `GATE_MIN_RUNS` of their size warm (`gated`; a replica's `gate_min_runs`): with fewer, keeping them through
their tools leaves the engine too small a batch to be worth the prefill it saves, so such runs
are placed and pinned as without the gate. So an empty replica always has room, and the gate
never leaves an engine idle beside a waiting run. Batch cannot take room that a paused
interactive run holds: that room is counted as held.

The pool is the engine's own word (read by the prober: SGLang's `max_total_num_tokens`, vLLM's
blocks times block size, llama.cpp's slots times their context) or the config's `kv_tokens`.
Where it is unknown the gate is off for that replica: runs are pinned while paused with no keep
time, as without the gate.

Estimates. A run's first turn is known by its request's size only: bytes times the model's
tokens per byte (learnt from every turn's reported usage against its size, starting at
`TOKENS_PER_BYTE`), plus its reply reservation (its `max_tokens`, else `REPLY_RESERVE_DEFAULT`).
Each completed turn's usage replaces the estimate. What the estimate misses between two reports
(the tool's answer appended to the prompt) and the prefix that runs share (the system prompt and
tool definitions are cached once, but counted per run) is what `KV_HEADROOM` is for.

Keep time. A paused run keeps its place for a bounded high percentile of its recent pauses on
the same tool (`HOLD_PERCENTILE` of the last `HOLD_SAMPLES`, times `HOLD_SLACK`, and at least
`HOLD_MIN_S`), so that a tool a little slower than usual still finds its prefix. When that comes
to more than `HOLD_MAX_S`, the tool is long enough that holding the room idle costs more than
re-reading the prefix would, so the run lets go at once: the room goes to runs that will use it.
The pauses are the caller's, by tool (`tool_key`: the names of the tools its reply called) once
the caller has paused on that tool `MIN_TOOL_SAMPLES` times, else all of the caller's pauses
together: an agent that reads a file in a second and runs a test suite for a minute keeps its
place through the read and lets go for the tests, where one percentile over both would let go
for either. A caller keeps the pauses of its `TOOLS_PER_CALLER` tools learnt from last. A caller
with no pause seen yet keeps `HOLD_MAX_S`.

Everything here is pure arithmetic on numbers the core keeps; the core (`core/`) owns when it
is asked, and the status page reads the same functions.
"""

from __future__ import annotations

from luftpause import defaults
from luftpause.scheduler.state import Replica, ToolPauses

# Share of a replica's KV pool that held working sets may not take: the estimate's error (a
# tool's answer not yet in the reported prompt), the prefix that runs share but each counts,
# and the engine's own slack (its page granularity, requests of other clients).
KV_HEADROOM = 0.10
# Tokens a request's body carries per byte until a model's usage has taught otherwise: about
# four characters a token for English text, as the common BPE vocabularies give.
TOKENS_PER_BYTE = 0.25
# Weight of each turn's reported tokens per byte in the model's running average.
TOKENS_PER_BYTE_LEARNING_RATE = 0.1
# A turn that sets no max_tokens reserves this many for its reply (the fake engine's default and
# a common engine one; an engine reserves what it may write).
REPLY_RESERVE_DEFAULT = 4096

# Pauses on tools remembered per caller (and per tool of it), and the keep time drawn from them.
HOLD_SAMPLES = 32
HOLD_PERCENTILE = 0.9
HOLD_SLACK = 1.25
# The longest keep time worth holding a place for. In the engine model's flood, holding runs
# through 2.5 s tools still served more runs than letting them go (91.6-92.7 runs/min against
# 89.4), through 3 s tools fewer (87.9 against 89.7-90.6): `luftpause bench sim flood --tool-s 3`.
HOLD_MAX_S = 3.5
# Pauses on one tool a caller must have shown before they, not all of the caller's, set the
# keep time of a run paused on that tool; and how many tools' pauses a caller keeps.
MIN_TOOL_SAMPLES = 3
TOOLS_PER_CALLER = 16
# The longest tool key kept (a reply's tool names, joined): longer ones are cut.
TOOL_KEY_CHARS = 128
# The shortest keep time: a caller whose tools answer at once still has its own work between a
# reply and the next turn (parsing, journaling, a model's tool-call loop), which jitters by more
# than the pauses it has shown; a place kept for 1.25 times a few milliseconds would be let go
# by that jitter alone.
HOLD_MIN_S = 1.0
# The fewest runs of a size a pool must keep warm for the gate to hold runs of that size there,
# unless a replica's config says otherwise (`gate_min_runs`).
GATE_MIN_RUNS = defaults.GATE_MIN_RUNS


def known(replica: Replica) -> bool:
    """Whether the gate can count anything on `replica`: its pool in tokens, or its slots."""
    return replica.kv_tokens is not None or replica.kv_slots is not None


def mode(replica: Replica) -> str:
    """How the gate counts runs on `replica`, as the status document names it: "slots" (at most
    one run a slot), "tokens" (working sets against the pool), or "off" and why."""
    if replica.host_cache:
        return "off: host cache"
    if replica.gate_min_runs <= 0:
        return "off: gate_min_runs = 0"
    if replica.kv_slots is not None:
        return "slots"
    if replica.kv_tokens is not None:
        return "tokens"
    return "off: pool unknown"


def names_slots(replica: Replica) -> bool:
    """Whether runs held on `replica` are each given a slot of it to name in their requests: on a
    slot engine where the gate holds runs (a new run's request would otherwise take whichever
    idle slot the engine likes, a paused run's among them)."""
    return replica.kv_slots is not None and gated(replica, 0)


def capacity(replica: Replica) -> int | None:
    """The tokens held runs may take on `replica`, None where its pool is unknown (no gate)."""
    if replica.kv_tokens is None:
        return None
    return int(replica.kv_tokens * (1.0 - KV_HEADROOM))


def gated(replica: Replica, working_set: int) -> bool:
    """Whether the gate admits runs of `working_set` tokens on `replica`. Never where its engine
    keeps evicted prefixes in host memory (they come back without being held) or its
    `gate_min_runs` is 0. On a slot engine always: a run beyond its slots takes another run's
    slot, whatever the sizes. On a shared pool where the pool is known and keeps at least
    `gate_min_runs` of them warm: where it keeps fewer, holding them idle through their tools
    costs the engine more batch than their prefixes save (see the module docstring), and such
    runs are placed and pinned as without the gate."""
    need = replica.gate_min_runs
    if replica.host_cache or need <= 0:
        return False
    if replica.kv_slots is not None:
        return True
    limit = capacity(replica)
    return limit is not None and limit >= need * max(working_set, 1)


def fits(replica: Replica, held_tokens: int, held_runs: int, working_set: int) -> bool:
    """Whether a run of `working_set` tokens may be placed on `replica`, which holds `held_runs`
    runs whose working sets come to `held_tokens`. Where the gate is off for such a run
    (`gated`), every run fits. On a slot engine, one run a slot; on a shared pool, the sizes
    against the pool: an empty replica has room for `gate_min_runs` of it, so either way the
    gate never idles an engine beside a waiting run."""
    if not gated(replica, working_set):
        return True
    if replica.kv_slots is not None:
        return held_runs < replica.kv_slots
    limit = capacity(replica)
    assert limit is not None  # `gated` says it is known
    return held_tokens + working_set <= limit


def reply_reserve(max_tokens: int | None) -> int:
    """What the engine reserves for a reply of `max_tokens` (None: not set)."""
    return max_tokens if max_tokens is not None and max_tokens > 0 else REPLY_RESERVE_DEFAULT


def estimated_working_set(request_bytes: int, max_tokens: int | None, tokens_per_byte: float | None) -> int:
    """A turn's working set from its request alone: its prompt by size, and its reply reservation."""
    rate = tokens_per_byte if tokens_per_byte is not None else TOKENS_PER_BYTE
    return int(max(request_bytes, 0) * rate) + reply_reserve(max_tokens)


def measured_working_set(prompt_tokens: int, completion_tokens: int, max_tokens: int | None) -> int:
    """A run's working set once a turn of it reported usage: the prefix its next turn extends
    (the prompt and the reply), and that turn's reply reservation."""
    return max(prompt_tokens, 0) + max(completion_tokens, 0) + reply_reserve(max_tokens)


def learn_tokens_per_byte(
    tokens_per_byte: float | None, prompt_tokens: int, request_bytes: int
) -> float | None:
    """The model's running tokens per byte after a turn of `request_bytes` reported `prompt_tokens`;
    unchanged when either is unknown."""
    if prompt_tokens <= 0 or request_bytes <= 0:
        return tokens_per_byte
    seen = prompt_tokens / request_bytes
    if tokens_per_byte is None:
        return seen
    return tokens_per_byte + TOKENS_PER_BYTE_LEARNING_RATE * (seen - tokens_per_byte)


def learn_pause(pauses: tuple[float, ...], pause_s: float) -> tuple[float, ...]:
    """A caller's recent pauses on tools, newest last, after one more of `pause_s`."""
    return (*pauses[-(HOLD_SAMPLES - 1) :], max(pause_s, 0.0))


def tool_key(tool_names: tuple[str, ...]) -> str:
    """What a run paused on the tools of one reply is paused on: their names, each once, sorted
    and joined by "+" ("" for none: no tool is known)."""
    if not tool_names:
        return ""  # most completions call none: no set, sort or join on the decision's path
    return "+".join(sorted(set(name for name in tool_names if name)))[:TOOL_KEY_CHARS]


def learn_tool_pause(tools: ToolPauses, tool: str, pause_s: float) -> ToolPauses:
    """A caller's pauses by tool after one more of `pause_s` on `tool` ("" learns nothing)."""
    if not tool:
        return tools
    before = next((samples for name, samples in tools if name == tool), ())
    others = tuple((name, samples) for name, samples in tools if name != tool)
    return (*others[-(TOOLS_PER_CALLER - 1) :], (tool, learn_pause(before, pause_s)))


def own_pauses(tools: ToolPauses, tool: str) -> tuple[float, ...] | None:
    """A caller's pauses on `tool` where there are enough of them (`MIN_TOOL_SAMPLES`) to set the
    keep time of a run paused on it; None where there are fewer, or the tool is not known."""
    for name, samples in tools:
        if name == tool:
            return samples if len(samples) >= MIN_TOOL_SAMPLES else None
    return None


def pauses_on(caller_pauses: tuple[float, ...], tools: ToolPauses, tool: str) -> tuple[float, ...]:
    """The pauses a run of the caller paused on `tool` keeps its place by: the tool's own
    (`own_pauses`), else all of the caller's."""
    own = own_pauses(tools, tool) if tool else None
    return own if own is not None else caller_pauses


def hold_for(pauses: tuple[float, ...]) -> float:
    """How long a paused run with these recent pauses (`pauses_on`) keeps its place: 0 lets go at once."""
    if not pauses:
        return HOLD_MAX_S
    ordered = sorted(pauses)
    keep = ordered[min(len(ordered) - 1, int(HOLD_PERCENTILE * len(ordered)))] * HOLD_SLACK
    return max(keep, HOLD_MIN_S) if keep <= HOLD_MAX_S else 0.0
