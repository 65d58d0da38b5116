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

from luftpause.fake_engine.kv_pool import KvPool
from luftpause.fake_engine.params import EngineParams
from luftpause.fake_engine.prefix_cache import Block, PrefixCache
from luftpause.fake_engine.waiting import WaitingQueue


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
        """Told of each admission: the request and how many of its leading blocks were cached."""

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
            uncached = sum(r.uncached + r.recompute for r in admitted)
            duration = self.params.prefill_base_s + self.params.prefill_per_token_s * uncached
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
        return EngineWork(self._prefill_s, self._decode_s, self.cache.evicted_total, self._preempted_total)

    # --- inside -------------------------------------------------------------------------------

    def _reservation(self, request: ModelRequest, matched: int) -> int:
        uncached = sum(b.tokens for b in request.blocks[matched:])
        limit = request.max_tokens if request.max_tokens is not None else self.params.default_max_tokens
        return uncached + (limit if request.completion_tokens > 0 else 0)

    def _head_fits(self) -> bool:
        head = self.waiting.peek()
        if head is None or (self.params.slots and len(self.running) >= self.params.slots):
            return False
        need = self._reservation(head, self.cache.match(head.blocks))
        return need <= self.kv.free + self.cache.evictable or not self.kv.could_ever_hold(need)

    def _admit(self) -> tuple[list[_Running], list[str]]:
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
            self._queries += head.prompt_tokens
            self._hits += head.prompt_tokens - uncached
            running = _Running(head, locked, uncached, need, recompute=self._resume.pop(head.request_id, 0))
            self.running[head.request_id] = running
            admitted.append(running)
            if self.on_admit is not None:
                self.on_admit(head, matched)
        return admitted, rejected

    def _slots_full(self) -> bool:
        return bool(self.params.slots) and len(self.running) >= self.params.slots

    def _preempt_for(self, head: ModelRequest) -> bool:
        """Preempts what `head` needs gone to start now, if priority preemption allows; False if nothing."""
        if not (self.params.priority_scheduling and self.params.priority_preemption):
            return False
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
        self.cache.unlock(running.matched)
        self.kv.release(running.reserved)
        if cache_it:
            request = running.request
            done = running.decoded >= request.completion_tokens and request.reply is not None
            chain = (*request.blocks, request.reply) if done and request.reply is not None else request.blocks
            self.cache.insert(chain)
            self.kv.trim_cache()
