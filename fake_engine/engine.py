"""The engine model: one replica of an inference engine as a deterministic step function over its own clock.

Theory of operation. Requests are submitted with their prompt as cache blocks (see
`prefix_cache`), the most they may write (max_tokens) and how many tokens they will write. Each
call to `step()` is one iteration of the engine's scheduler loop, starting at `now`:

1. Admission. While a slot is free (`EngineParams.slots`, 0 for no cap) the head of the waiting
   queue looks up its longest cached prefix, locks it, and reserves its uncached prompt plus its
   max_tokens in the KV pool (evicting unlocked cache, least recently used first). The first
   request that does not fit stops admission: the queue is first come, first served.
   With `EngineParams.priority_preemption` (SGLang's priority preemption), a head that does not
   fit, for want of a slot or of memory, may first preempt running requests: those whose
   priority is worse than its own by more than `preemption_threshold`, worst priority first,
   then the most recently admitted first, as few as make room, and only if they do. A victim
   frees its slot and reservation; its matched prefix stays cached but unlocked, and its own
   prefilled prompt is dropped, not cached (SGLang releases a preempted request's KV without
   inserting it into the radix tree, to use the room at once). It goes back to the waiting
   queue with its priority, keeping the tokens it has decoded: when admitted again its prefill
   pass recomputes their KV along with its uncached prompt and writes its next token, as
   SGLang re-prefills a retracted request's input and output ids.
2. If anything was admitted, the step is a prefill pass over the admitted requests' uncached
   tokens (a fixed cost plus a cost per token). Running requests decode nothing meanwhile, as in
   an engine that does not mix prefill into decode batches. Each admitted request has its first
   token at the end of the pass.
3. Otherwise, if anything runs, the step decodes one token for every running request; its time
   grows with the batch. With `until` given, identical decode steps are taken together as long
   as none of them would cross `until` or finish a request early, which lets the simulator jump
   ahead without changing the outcome.

A finished request frees its slot and its reservation, and its prompt and reply enter the prefix
cache. A cancelled request leaves the queue, or frees what it held.

Two modes, both off by default (the calibration has neither), model llama.cpp and host tiers:

- Slots that each keep their own KV (`EngineParams.slot_kv`, llama-server's `--parallel`): no
  shared pool and no prefix cache. Admission takes the queue's head while a slot is idle: the
  idle slot whose cached prompt shares the longest prefix with the head's (if that is more than
  `SLOT_PROMPT_SIMILARITY` of its prompt, llama-server's `--slot-prompt-similarity`), else the
  least recently used one. The head's prompt beyond the shared prefix is prefilled; what the
  slot held beyond it is dropped (counted as evicted). A finished request leaves its prompt and
  reply in its slot. A prompt longer than a slot's context is rejected. Nothing is preempted.
- A host tier (`EngineParams.host_cache_tokens`, `host_tier`): what the shared pool evicts, or
  what a slot drops, is kept in host memory. At admission, blocks of the head's prompt that the
  KV lacks but the tier holds, right after what the KV has, are restored at
  `host_restore_per_token_s` a token within the prefill pass instead of being computed. On a
  slot engine the tier holds whole prompts, as llama-server's `--cache-ram` does: when it holds
  a longer prefix of the head's prompt than the chosen slot, that prefix is loaded into the slot
  in full, and the slot's own prompt is saved to the tier before it is overwritten, each a copy
  at the same cost a token.

What the engine did is counted for the simulator's measurements, without changing what it does:
busy seconds by step kind and tokens evicted from the cache (`work()`), and each admission's
cache hit as blocks (`on_admit`). Nothing here reads a clock,
sleeps or draws a random number: the same submissions at the same times give the same steps,
which is what lets the HTTP server drive it in real time and the simulator in virtual time.
State is mutated in place (one engine belongs to one driver), for the simulator's speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from luftpause.fake_engine.host_tier import HostTier
from luftpause.fake_engine.kv_pool import KvPool
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.prefix_cache import Block, PrefixCache
from luftpause.fake_engine.waiting import WaitingQueue

SLOT_PROMPT_SIMILARITY = 0.1
"""The share of a prompt an idle slot's cached prompt must share, as its prefix, for a slot engine
to prefer that slot over the least recently used: llama-server's --slot-prompt-similarity
default."""


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One request as the engine sees it."""

    request_id: str
    blocks: tuple[Block, ...]
    completion_tokens: int
    """How many tokens the reply has (0 for a single-pass request: prefill only)."""
    max_tokens: int | None = None
    reply: Block | None = None
    """The block the reply becomes in the cache, keyed as the next turn will send it."""
    priority: int = 0
    slot: int | None = None
    """On a slot engine, the slot the request names (llama.cpp's `id_slot`): it runs there, and
    waits while that slot is busy; None: the engine picks one (`_pick_slot`)."""

    @property
    def prompt_tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)


@dataclass(slots=True)
class _Running:
    request: ModelRequest
    matched: tuple[Block, ...]
    uncached: int
    reserved: int
    decoded: int = 0
    prefilled: bool = False
    recompute: int = 0
    """Tokens it had decoded before it was preempted, whose KV its prefill pass computes again."""
    copied: int = 0
    """Tokens its prefill pass copies between the host tier and the KV instead of computing."""
    slot: int = -1
    """The slot it runs in, on a slot engine."""


@dataclass(slots=True)
class _Slot:
    """One slot of a slot engine: the prompt and reply of its last request, or of the one it runs."""

    chain: tuple[Block, ...] = ()
    busy: bool = False
    used_at: int = 0
    """When it was last released (a counter of admissions): the least recently used has the
    smallest, empty slots first."""


def _common_blocks(a: tuple[Block, ...], b: tuple[Block, ...]) -> int:
    """How many leading blocks two chains share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x.key != y.key:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class Step:
    """What one iteration did: between `started` and `ended`, these requests got these many tokens."""

    started: float
    ended: float
    kind: str
    """"prefill" or "decode"."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Request id -> tokens it has decoded in total, for each request that got one in this step."""
    finished: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    """Requests that can never fit the KV pool; they are gone without running."""
    preempted: tuple[str, ...] = ()
    """Running requests this step's admission preempted; they wait again, their decoded tokens kept."""


@dataclass(frozen=True, slots=True)
class EngineWork:
    """What the engine has done since it started; no engine's /metrics say this, the simulator does."""

    prefill_s: float
    """Seconds spent in prefill passes."""
    decode_s: float
    """Seconds spent in decode steps."""
    tokens_evicted: int
    """Tokens of cached prefixes evicted to make room."""
    preempted: int = 0
    """Running requests preempted (each preemption once)."""

    @property
    def busy_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine reports about itself, as its /metrics do."""

    running: int
    waiting: int
    used_tokens: int
    token_usage: float
    cache_hit_rate: float
    prefix_queries_total: int
    prefix_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens: int


class Engine:
    """One replica: slots, a KV pool with a prefix cache, a waiting queue and a clock."""

    def __init__(self, params: EngineParams | None = None, now: float = 0.0) -> None:
        self.params = params or EngineParams()
        if self.params.slots < 0:
            raise ValueError(f"slots must be 0 (no cap) or more, got {self.params.slots}")
        self.now = now
        self.cache = PrefixCache()
        self.kv = KvPool(self.params.kv_pool_tokens, self.cache)
        self.waiting: WaitingQueue[ModelRequest] = WaitingQueue(self.params.priority_scheduling)
        self.running: dict[str, _Running] = {}
        self._queries = 0
        self._hits = 0
        self._prompt_total = 0
        self._generated_total = 0
        self._prefill_s = 0.0
        self._decode_s = 0.0
        # Preempted requests waiting again -> the tokens they had decoded.
        self._resume: dict[str, int] = {}
        self._preempted: list[str] = []
        self._preempted_total = 0
        self.on_admit: Callable[[ModelRequest, int], None] | None = None
        """Told of each admission: the request and how many of its leading blocks were cached
        (in the KV, or in the host tier and restored)."""
        self.host: HostTier | None = None
        if self.params.host_cache_tokens > 0:
            self.host = HostTier(self.params.host_cache_tokens)
            self.cache.on_evict = self.host.put
        self._slots: list[_Slot] = []
        self._slot_evicted = 0
        self._taken = 0
        if self.params.slot_kv:
            if self.params.slots < 1:
                raise ValueError("slot_kv needs slots: each slot keeps its own KV")
            self._slots = [_Slot() for _ in range(self.params.slots)]
        self.slot_context = self.params.kv_pool_tokens // max(self.params.slots, 1)
        """Tokens of context each slot has, on a slot engine (the pool split evenly)."""

    # --- what drivers call -----------------------------------------------------------------

    def submit(self, request: ModelRequest) -> None:
        """The request joins the waiting queue; the next step may admit it."""
        if request.request_id in self.running or request.request_id in self.waiting:
            raise ValueError(f"request {request.request_id} is already in the engine")
        self.waiting.push(request.request_id, request, request.priority)

    def cancel(self, request_id: str) -> None:
        """Its client went away: out of the queue, or its slot, memory and locks freed now."""
        if self.waiting.remove(request_id):
            self._resume.pop(request_id, None)
            return
        running = self.running.pop(request_id, None)
        if running is not None:
            self._release(running, cache_it=running.prefilled)

    @property
    def busy(self) -> bool:
        """Whether a step would do anything (something runs, or something waits and fits)."""
        return bool(self.running) or (len(self.waiting) > 0 and self._head_fits())

    def idle_until(self, at: float) -> None:
        """Moves the clock of an engine with nothing to do forward to `at`."""
        self.now = max(self.now, at)

    def step(self, until: float | None = None) -> Step | None:
        """One iteration from `now`; None when there is nothing to do (the clock stays put)."""
        started = self.now
        admitted, rejected = self._admit()
        preempted, self._preempted = tuple(self._preempted), []
        if admitted:
            uncached = sum(r.uncached - r.copied + r.recompute for r in admitted)
            duration = self.params.prefill_base_s + self.params.prefill_per_token_s * uncached
            copied = sum(r.copied for r in admitted)
            if copied:
                duration += self.params.host_restore_per_token_s * copied
            self.now += duration
            self._prefill_s += duration
            tokens: dict[str, int] = {}
            finished: list[str] = []
            for r in admitted:
                r.prefilled = True
                self._prompt_total += r.request.prompt_tokens
                if r.request.completion_tokens > 0:
                    # The pass writes the next token: a preempted request's first after those it kept.
                    r.decoded = r.recompute + 1
                    self._generated_total += 1
                    tokens[r.request.request_id] = r.decoded
                if r.decoded >= r.request.completion_tokens:
                    finished.append(self._finish(r))
            return Step(started, self.now, "prefill", tokens, tuple(finished), tuple(rejected), preempted)
        if not self.running:
            if rejected:
                return Step(started, started, "prefill", {}, (), tuple(rejected))
            return None
        step_s = self.params.decode_base_s + self.params.decode_per_seq_s * len(self.running)
        count = 1
        if until is not None:
            remaining = min(r.request.completion_tokens - r.decoded for r in self.running.values())
            count = max(1, min(remaining, int((until - self.now) / step_s) if step_s > 0 else remaining))
        self.now += step_s * count
        self._decode_s += step_s * count
        tokens = {}
        finished = []
        for r in list(self.running.values()):
            r.decoded += count
            self._generated_total += count
            tokens[r.request.request_id] = r.decoded
            if r.decoded >= r.request.completion_tokens:
                finished.append(self._finish(r))
        return Step(started, self.now, "decode", tokens, tuple(finished), tuple(rejected))

    def load(self) -> EngineLoad:
        if self._slots:
            return self._slot_load()
        used = self.cache.locked + sum(r.uncached + r.decoded for r in self.running.values())
        return EngineLoad(
            running=len(self.running),
            waiting=len(self.waiting),
            used_tokens=used,
            token_usage=min(1.0, used / self.kv.capacity),
            cache_hit_rate=self._hits / self._queries if self._queries else 0.0,
            prefix_queries_total=self._queries,
            prefix_hits_total=self._hits,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generated_total,
            cached_tokens=self.cache.size,
        )

    def work(self) -> EngineWork:
        evicted = self.cache.evicted_total + self._slot_evicted
        return EngineWork(self._prefill_s, self._decode_s, evicted, self._preempted_total)

    def slot_chains(self) -> list[tuple[Block, ...]]:
        """What each slot holds, on a slot engine (for tests and the status of the model)."""
        return [slot.chain for slot in self._slots]

    # --- inside -------------------------------------------------------------------------------

    def _reservation(self, request: ModelRequest, matched: int) -> int:
        uncached = sum(b.tokens for b in request.blocks[matched:])
        limit = request.max_tokens if request.max_tokens is not None else self.params.default_max_tokens
        return uncached + (limit if request.completion_tokens > 0 else 0)

    def _head_fits(self) -> bool:
        head = self.waiting.peek()
        if head is None or (self.params.slots and len(self.running) >= self.params.slots):
            return False
        if self._slots:
            return True  # a slot is idle (the count above), or the head is rejected
        need = self._reservation(head, self.cache.match(head.blocks))
        return need <= self.kv.free + self.cache.evictable or not self.kv.could_ever_hold(need)

    def _admit(self) -> tuple[list[_Running], list[str]]:
        if self._slots:
            return self._admit_to_slots()
        admitted: list[_Running] = []
        rejected: list[str] = []
        while len(self.waiting):
            head = self.waiting.peek()
            assert head is not None
            if self._slots_full() and not self._preempt_for(head):
                break
            matched = self.cache.match(head.blocks)
            need = self._reservation(head, matched)
            if not self.kv.could_ever_hold(need):
                self.waiting.pop()
                rejected.append(head.request_id)
                continue
            locked = head.blocks[:matched]
            # Lock first, so that making room cannot evict the prefix this request is about to use.
            self.cache.lock(locked)
            if not self.kv.reserve(need):
                self.cache.unlock(locked)
                if self._preempt_for(head):
                    continue  # room was made: the same head again, now it fits
                break
            self.waiting.pop()
            uncached = sum(b.tokens for b in head.blocks[matched:])
            # What the host tier holds right after what the KV has comes back as a copy.
            restored = copied = 0
            if self.host is not None:
                restored = self.host.match(head.blocks, matched)
                copied = self.host.restore(head.blocks[matched : matched + restored])
            self._queries += head.prompt_tokens
            self._hits += head.prompt_tokens - uncached + copied
            running = _Running(
                head, locked, uncached, need, recompute=self._resume.pop(head.request_id, 0), copied=copied
            )
            self.running[head.request_id] = running
            admitted.append(running)
            if self.on_admit is not None:
                self.on_admit(head, matched + restored)
        return admitted, rejected

    def _admit_to_slots(self) -> tuple[list[_Running], list[str]]:
        """Admission on a slot engine: the queue's head into an idle slot while one is idle."""
        admitted: list[_Running] = []
        rejected: list[str] = []
        while len(self.waiting):
            head = self.waiting.peek()
            assert head is not None
            if head.prompt_tokens > self.slot_context:
                self.waiting.pop()
                rejected.append(head.request_id)
                continue
            idle = [i for i, slot in enumerate(self._slots) if not slot.busy]
            if not idle:
                break
            named = head.slot if head.slot is not None and 0 <= head.slot < len(self._slots) else None
            if named is not None and self._slots[named].busy:
                break  # llama-server defers a request whose slot is busy until it frees
            self.waiting.pop()
            if named is not None:
                index, common, by_lru = named, _common_blocks(self._slots[named].chain, head.blocks), False
            else:
                index, common, by_lru = self._pick_slot(head, idle)
            slot = self._slots[index]
            cached = sum(b.tokens for b in head.blocks[:common])
            copied = 0
            held = sum(b.tokens for b in slot.chain)
            # llama-server updates its host cache for a slot taken as the least recently used, or
            # one that would lose more than half of what it holds.
            if self.host is not None and (by_lru or cached < 0.5 * held):
                if slot.chain[common:]:
                    # The slot's prompt is saved to host memory before it is overwritten.
                    self.host.put_chain(slot.chain)
                    copied += sum(b.tokens for b in slot.chain)
                loaded = self.host.match(head.blocks)
                if loaded > common:
                    # A longer prefix in host memory: that prompt is loaded into the slot whole.
                    copied += self.host.restore(head.blocks[:loaded])
                    common = loaded
                    cached = sum(b.tokens for b in head.blocks[:common])
            self._slot_evicted += sum(b.tokens for b in slot.chain[_common_blocks(slot.chain, head.blocks) :])
            self._taken += 1
            slot.chain, slot.busy = head.blocks, True
            uncached = head.prompt_tokens - cached
            self._queries += head.prompt_tokens
            self._hits += cached
            # `uncached` is what the pass computes; the copies are charged on top.
            running = _Running(head, (), uncached + copied, 0, copied=copied, slot=index)
            self.running[head.request_id] = running
            admitted.append(running)
            if self.on_admit is not None:
                self.on_admit(head, common)
        return admitted, rejected

    def _pick_slot(self, head: ModelRequest, idle: list[int]) -> tuple[int, int, bool]:
        """The idle slot for `head`, how many leading blocks of its prompt that slot holds, and
        whether it was taken as the least recently used (llama-server's `get_available_slot`:
        the first slot with the longest common prefix over the similarity threshold, else the
        least recently used, empty slots first)."""
        best, best_tokens, best_common = -1, 0.0, 0
        for i in idle:  # in slot order: a tie goes to the first
            common = _common_blocks(self._slots[i].chain, head.blocks)
            tokens = sum(b.tokens for b in head.blocks[:common])
            if tokens > best_tokens and tokens > SLOT_PROMPT_SIMILARITY * head.prompt_tokens:
                best, best_tokens, best_common = i, tokens, common
        if best >= 0:
            return best, best_common, False
        lru = min(idle, key=lambda i: self._slots[i].used_at)
        return lru, _common_blocks(self._slots[lru].chain, head.blocks), True

    def _slot_load(self) -> EngineLoad:
        used = sum(sum(b.tokens for b in slot.chain) for slot in self._slots)
        used += sum(r.decoded for r in self.running.values())
        cached = sum(sum(b.tokens for b in slot.chain) for slot in self._slots if not slot.busy)
        return EngineLoad(
            running=len(self.running),
            waiting=len(self.waiting),
            used_tokens=used,
            token_usage=min(1.0, used / self.params.kv_pool_tokens),
            cache_hit_rate=self._hits / self._queries if self._queries else 0.0,
            prefix_queries_total=self._queries,
            prefix_hits_total=self._hits,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generated_total,
            cached_tokens=cached,
        )

    def _slots_full(self) -> bool:
        return bool(self.params.slots) and len(self.running) >= self.params.slots

    def _preempt_for(self, head: ModelRequest) -> bool:
        """Preempts what `head` needs gone to start now, if priority preemption allows; False if nothing."""
        if self._slots or not (self.params.priority_scheduling and self.params.priority_preemption):
            return False  # a slot engine (llama.cpp) preempts nothing
        # Requests admitted in this same step have not run yet; SGLang looks at its running batch.
        candidates = [
            r
            for r in reversed(self.running.values())  # the most recently admitted first...
            if r.prefilled and head.priority - r.request.priority > self.params.preemption_threshold
        ]
        candidates.sort(key=lambda r: r.request.priority)  # ...within the worst priority first
        matched = head.blocks[: self.cache.match(head.blocks)]
        need = self._reservation(head, len(matched))
        if not self.kv.could_ever_hold(need):
            return False
        victims: list[_Running] = []
        freed = 0
        for candidate in candidates:
            victims.append(candidate)
            freed += candidate.reserved
            slot = not self.params.slots or len(self.running) - len(victims) < self.params.slots
            locked = self.cache.locked_after((v.matched for v in victims), matched)
            # What a reservation could take once they are gone: all but the reserved and the locked.
            room = self.kv.capacity - (self.kv.reserved - freed) - locked
            if slot and need <= room:
                break
        else:
            return False
        for victim in victims:
            request_id = victim.request.request_id
            del self.running[request_id]
            self._release(victim, cache_it=False)
            self._resume[request_id] = victim.decoded
            self.waiting.push(request_id, victim.request, victim.request.priority)
            self._preempted.append(request_id)
            self._preempted_total += 1
        return True

    def _finish(self, running: _Running) -> str:
        request_id = running.request.request_id
        del self.running[request_id]
        self._release(running, cache_it=True)
        return request_id

    def _release(self, running: _Running, cache_it: bool) -> None:
        if self._slots:
            # The slot keeps what it computed: the prompt, and the reply once it is whole.
            slot = self._slots[running.slot]
            request = running.request
            done = running.decoded >= request.completion_tokens and request.reply is not None
            if cache_it and done and request.reply is not None:
                slot.chain = (*request.blocks, request.reply)
            elif not cache_it:
                slot.chain = ()
            slot.busy = False
            slot.used_at = self._taken  # llama-server marks a slot used as it is released
            return
        self.cache.unlock(running.matched)
        self.kv.release(running.reserved)
        if cache_it:
            request = running.request
            done = running.decoded >= request.completion_tokens and request.reply is not None
            chain = (*request.blocks, request.reply) if done and request.reply is not None else request.blocks
            self.cache.insert(chain)
            self.kv.trim_cache()
