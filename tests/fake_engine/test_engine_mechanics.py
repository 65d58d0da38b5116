"""The engine model's mechanics, stepped directly on its own clock: slots, KV reservations, the
queue, the prefix cache and its eviction, step times, priorities, and parameter overrides."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.fake_engine.engine import Engine, ModelRequest
from luftpause.fake_engine.params import EngineParams, params_from_env
from luftpause.fake_engine.prefix_cache import Block, prompt_blocks
from luftpause.fake_engine.tokens import count_tokens, prompt_tokens

# Round numbers so that step times can be checked exactly.
PARAMS = EngineParams(
    slots=0,
    kv_pool_tokens=10_000,
    prefill_base_s=0.01,
    prefill_per_token_s=0.001,
    decode_base_s=0.01,
    decode_per_seq_s=0.002,
)


def request(
    rid: str, prompt: int = 100, reply: int = 5, max_tokens: int = 50, priority: int = 0
) -> ModelRequest:
    """A one-message request whose prompt is unique to `rid`."""
    return ModelRequest(rid, (Block(rid.encode(), prompt),), reply, max_tokens, priority=priority)


def conversation(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def run_until_idle(engine: Engine) -> list[str]:
    finished: list[str] = []
    while (step := engine.step()) is not None:
        finished.extend(step.finished)
    return finished


def test_requests_queue_when_the_slots_run_out_and_not_before() -> None:
    engine = Engine(EngineParams(slots=2, kv_pool_tokens=100_000))
    for rid in ("a", "b"):
        engine.submit(request(rid))
    engine.step()
    assert (engine.load().running, engine.load().waiting) == (2, 0)
    engine.submit(request("c"))
    engine.step()
    assert (engine.load().running, engine.load().waiting) == (2, 1)
    # When one finishes, the waiting one gets its slot.
    assert sorted(run_until_idle(engine)) == ["a", "b", "c"]


def test_requests_queue_when_kv_memory_runs_out_and_not_before() -> None:
    # Each reserves its prompt plus max_tokens: 300 + 100 = 400 tokens.
    fits_three = Engine(EngineParams(kv_pool_tokens=1200))
    fits_two = Engine(EngineParams(kv_pool_tokens=1199))
    for engine in (fits_three, fits_two):
        for rid in ("a", "b", "c"):
            engine.submit(request(rid, prompt=300, max_tokens=100, reply=10))
        engine.step()
    assert (fits_three.load().running, fits_three.load().waiting) == (3, 0)
    assert (fits_two.load().running, fits_two.load().waiting) == (2, 1)
    assert fits_two.kv.reserved == 800


def test_a_short_reply_still_reserves_its_max_tokens() -> None:
    engine = Engine(EngineParams(kv_pool_tokens=1000))
    engine.submit(request("long-limit", prompt=100, reply=1, max_tokens=900))
    engine.submit(request("next", prompt=100, reply=1, max_tokens=10))
    step = engine.step()
    assert step is not None and step.finished == ("long-limit",)
    assert engine.load().waiting == 1  # it could not start beside a 1000-token reservation


def test_the_queue_is_first_come_first_served_and_a_big_head_blocks_small_ones() -> None:
    engine = Engine(EngineParams(kv_pool_tokens=1000))
    engine.submit(request("running", prompt=500, max_tokens=100, reply=3))
    engine.step()
    engine.submit(request("big", prompt=500, max_tokens=100))
    engine.submit(request("small", prompt=10, max_tokens=10))
    engine.step()
    assert engine.waiting.ids() == ["big", "small"]
    finished = run_until_idle(engine)
    assert finished.index("big") < finished.index("small")


def test_priority_scheduling_starts_higher_priorities_first_only_when_on() -> None:
    order = {}
    for on in (False, True):
        engine = Engine(EngineParams(slots=1, priority_scheduling=on))
        engine.submit(request("first", reply=2))
        engine.step()
        engine.submit(request("low", priority=0))
        engine.submit(request("high", priority=5))
        order[on] = run_until_idle(engine)
    assert order[False] == ["first", "low", "high"]
    assert order[True] == ["first", "high", "low"]


def test_a_repeated_prefix_is_cheaper_than_a_new_one() -> None:
    engine = Engine(PARAMS)
    first = conversation("x" * 4000)
    blocks = prompt_blocks(first)
    engine.submit(ModelRequest("turn-1", blocks, 3, 50))
    fresh = engine.step()
    run_until_idle(engine)
    # The next turn repeats the first message and adds one; a stranger sends as much, all new.
    again = prompt_blocks(
        [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    )
    stranger = prompt_blocks(conversation("y" * 4000, "ok", "more"))
    assert sum(b.tokens for b in again) == sum(b.tokens for b in stranger)
    engine.submit(ModelRequest("turn-2", again, 3, 50))
    cached = engine.step()
    run_until_idle(engine)
    engine.submit(ModelRequest("stranger", stranger, 3, 50))
    uncached = engine.step()
    assert fresh is not None and cached is not None and uncached is not None
    cached_s = cached.ended - cached.started
    assert cached_s == pytest.approx(0.01 + 0.001 * (again[1].tokens + again[2].tokens))
    assert cached_s < (uncached.ended - uncached.started) / 10
    load = engine.load()
    assert load.prefix_hits_total == blocks[0].tokens
    assert load.prefix_queries_total == sum(b.tokens for b in (*blocks, *again, *stranger))


def test_a_reply_is_cached_as_the_next_turn_will_send_it() -> None:
    from luftpause.fake_engine.prefix_cache import reply_block

    engine = Engine(PARAMS)
    history = conversation("question " * 100)
    answer = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}}
        ],
    }
    blocks = prompt_blocks(history)
    engine.submit(ModelRequest("t1", blocks, 4, 50, reply=reply_block(blocks, answer)))
    run_until_idle(engine)
    # The client echoes the call back with content "" and an extra field; the cache still matches.
    echoed = {**answer, "content": "", "refusal": None}
    follow_up = prompt_blocks([*history, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "r"}])
    assert engine.cache.match(follow_up) == 2


def test_eviction_frees_the_least_recently_used_prefix() -> None:
    # Room for two cached conversations of 1000 tokens, not three (a turn reserves 1100 more).
    engine = Engine(EngineParams(kv_pool_tokens=3050))
    convs = {name: prompt_blocks(conversation(name * 3984)) for name in "abc"}
    assert all(sum(b.tokens for b in c) == 1000 for c in convs.values())

    def turn(rid: str, blocks: tuple[Block, ...]) -> None:
        engine.submit(ModelRequest(rid, blocks, 1, 100))
        run_until_idle(engine)

    turn("a1", convs["a"])
    turn("b1", convs["b"])
    turn("a2", convs["a"])  # a is now more recently used than b
    assert engine.cache.size == 2000
    turn("c1", convs["c"])  # needs 1100: b, the least recently used, must go
    assert convs["a"][0].key in engine.cache and convs["c"][0].key in engine.cache
    assert convs["b"][0].key not in engine.cache
    assert engine.cache.size == 2000


def test_a_running_request_keeps_its_prefix_from_eviction() -> None:
    engine = Engine(EngineParams(kv_pool_tokens=2200))
    shared = prompt_blocks(conversation("s" * 3984))
    engine.submit(ModelRequest("warm", shared, 1, 100))
    run_until_idle(engine)
    longer = prompt_blocks([*conversation("s" * 3984), {"role": "assistant", "content": "a" * 396}])
    engine.submit(ModelRequest("reuses", longer, 50, 100))
    engine.step()
    # A stranger needing the whole pool would have to evict the locked prefix: it waits instead.
    engine.submit(request("stranger", prompt=1000, max_tokens=100))
    engine.step()
    assert engine.load().waiting == 1 and shared[0].key in engine.cache


def test_eviction_shortens_a_chain_from_its_end() -> None:
    engine = Engine(EngineParams(kv_pool_tokens=100_000))
    long = prompt_blocks(conversation("p" * 400, "q" * 400, "r" * 400))
    engine.submit(ModelRequest("t", long, 1, 10))
    run_until_idle(engine)
    engine.cache.evict(1)
    assert engine.cache.match(long) == 2


def test_decode_steps_take_longer_with_a_bigger_batch() -> None:
    durations = {}
    for batch in (1, 8):
        engine = Engine(PARAMS)
        for i in range(batch):
            engine.submit(request(f"r{i}", reply=3))
        engine.step()  # the prefill pass
        step = engine.step()
        assert step is not None and step.kind == "decode" and len(step.tokens) == batch
        durations[batch] = step.ended - step.started
    assert durations[1] == pytest.approx(0.012)
    assert durations[8] == pytest.approx(0.026)


def test_decode_steps_taken_together_end_where_single_steps_would() -> None:
    single, together = Engine(PARAMS), Engine(PARAMS)
    for engine in (single, together):
        engine.submit(request("a", reply=10))
        engine.submit(request("b", reply=4))
        engine.step()
    one_by_one = run_until_idle(single)
    jumps = []
    while (step := together.step(until=100.0)) is not None:
        jumps.append(step)
    assert [f for s in jumps for f in s.finished] == one_by_one
    assert together.now == pytest.approx(single.now)
    assert len(jumps) == 2  # one jump to b's end, one to a's


def test_the_engine_counts_its_busy_time_by_step_kind_its_evictions_and_each_admissions_hit() -> None:
    engine = Engine(replace(PARAMS, kv_pool_tokens=1000))
    admissions: list[tuple[str, int]] = []
    engine.on_admit = lambda r, matched: admissions.append((r.request_id, matched))
    shared = Block(b"shared", 100)
    # a: 300 uncached tokens, a 0.31 s prefill (which writes its first token), two 12 ms decodes.
    engine.submit(ModelRequest("a", (shared, Block(b"own-a", 200)), 3, 50))
    assert run_until_idle(engine) == ["a"]
    assert engine.cache.size == 300 and engine.work().tokens_evicted == 0
    # b matches the shared block and needs 700 + 50 of the 700 free: a's own block (200) goes.
    engine.submit(ModelRequest("b", (shared, Block(b"own-b", 700)), 1, 50))
    assert run_until_idle(engine) == ["b"]
    work = engine.work()
    assert admissions == [("a", 0), ("b", 1)]
    assert work.prefill_s == pytest.approx(0.31 + 0.71)
    assert work.decode_s == pytest.approx(2 * 0.012)
    assert work.busy_s == pytest.approx(engine.now)  # never idle in between
    assert work.tokens_evicted == 200 and b"own-a" not in engine.cache


PREEMPTING = replace(PARAMS, kv_pool_tokens=1000, priority_scheduling=True, priority_preemption=True)


def test_a_head_that_does_not_fit_preempts_a_far_worse_running_request_which_is_computed_again() -> None:
    engine = Engine(PREEMPTING)
    # The batch request reserves 600 + 100 of 1000 tokens and decodes three of its 20 tokens.
    engine.submit(request("batch", prompt=600, reply=20, max_tokens=100, priority=-100))
    for _ in range(3):
        engine.step()
    assert engine.running["batch"].decoded == 3
    # 300 + 50 do not fit beside it; the gap of 101 is over the threshold of 10.
    engine.submit(request("interactive", prompt=300, reply=2, max_tokens=50, priority=1))
    step = engine.step()
    assert step is not None and step.preempted == ("batch",) and list(step.tokens) == ["interactive"]
    assert engine.waiting.ids() == ["batch"] and engine.kv.reserved == 350
    assert b"batch" not in engine.cache  # a preempted prompt is dropped, not cached
    step = engine.step()  # the interactive request's last token; its prompt is cached
    assert step is not None and step.finished == ("interactive",)
    # Admitted again: its prefill recomputes its prompt and the three tokens it kept, writes the fourth.
    step = engine.step()
    assert step is not None and step.kind == "prefill" and step.tokens == {"batch": 4}
    assert step.ended - step.started == pytest.approx(0.01 + 0.001 * (600 + 3))
    assert run_until_idle(engine) == ["batch"]
    # Nothing was decoded twice: the kept tokens were prefilled again, not written again.
    assert engine.work().preempted == 1 and engine.load().generation_tokens_total == 2 + 20


@pytest.mark.parametrize(
    ("params", "batch_priority", "interactive_prompt"),
    [
        (PREEMPTING, -9, 300),  # a gap of 10 is not over the threshold
        (replace(PREEMPTING, priority_preemption=False), -100, 300),
        (PREEMPTING, -100, 600),  # 600 + 300 needed, 100 + 700 that preempting could free
    ],
)
def test_preemption_needs_it_on_and_a_gap_over_the_threshold_and_enough_room(
    params: EngineParams, batch_priority: int, interactive_prompt: int
) -> None:
    engine = Engine(params)
    engine.submit(request("batch", prompt=600, reply=20, max_tokens=100, priority=batch_priority))
    engine.submit(request("other", prompt=100, reply=20, max_tokens=100, priority=1))
    engine.step()
    engine.submit(request("interactive", prompt=interactive_prompt, reply=2, max_tokens=300, priority=1))
    step = engine.step()
    assert step is not None and step.preempted == () and step.kind == "decode"
    assert engine.waiting.ids() == ["interactive"]


def test_victims_are_the_worst_priority_first_then_the_newest_and_only_as_many_as_needed() -> None:
    engine = Engine(replace(PREEMPTING, kv_pool_tokens=1200))
    for rid, priority in (("old-low", -50), ("new-low", -50), ("lowest", -90)):
        engine.submit(request(rid, prompt=300, reply=20, max_tokens=100, priority=priority))
    engine.step()
    assert len(engine.running) == 3  # 3 x 400 of 1200
    engine.submit(request("interactive", prompt=700, reply=2, max_tokens=100, priority=1))
    step = engine.step()
    assert step is not None and step.preempted == ("lowest", "new-low")
    assert set(engine.running) == {"old-low", "interactive"}


def test_a_cancelled_request_leaves_the_queue_or_frees_its_slot() -> None:
    engine = Engine(EngineParams(slots=1))
    engine.submit(request("running", reply=100))
    engine.submit(request("waiting"))
    engine.submit(request("next"))
    engine.step()
    engine.cancel("waiting")
    assert engine.waiting.ids() == ["next"]
    engine.cancel("running")
    assert engine.kv.reserved == 0
    step = engine.step()
    assert step is not None and step.kind == "prefill" and list(step.tokens) == ["next"]


def test_a_request_that_can_never_fit_is_rejected_not_left_waiting() -> None:
    engine = Engine(EngineParams(kv_pool_tokens=500))
    engine.submit(request("huge", prompt=600))
    engine.submit(request("fine", prompt=100))
    step = engine.step()
    assert step is not None and step.rejected == ("huge",) and "fine" in step.tokens


def test_parameter_overrides_are_parsed_and_bad_ones_named() -> None:
    params = params_from_env("decode_base_s=0.05, reply_tokens=64, priority_scheduling=true")
    assert (params.decode_base_s, params.reply_tokens, params.priority_scheduling) == (0.05, 64, True)
    assert params.prefill_base_s == EngineParams().prefill_base_s
    assert params_from_env("") == EngineParams()
    with pytest.raises(ValueError, match="decode_ms"):
        params_from_env("decode_ms=3")
    with pytest.raises(ValueError, match="reply_tokens must be a whole number"):
        params_from_env("reply_tokens=lots")


def test_tokens_are_counted_from_characters_and_blocks_add_up() -> None:
    assert [count_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    short = prompt_tokens([{"role": "user", "content": "x" * 40}])
    long = prompt_tokens([{"role": "user", "content": "x" * 4000}])
    assert long - short == 990
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    messages = conversation("hello there", "hi")
    assert sum(b.tokens for b in prompt_blocks(messages, tools)) == prompt_tokens(messages, tools)


@settings(max_examples=80, deadline=None)
@given(
    slots=st.integers(min_value=0, max_value=3),
    pool=st.integers(min_value=300, max_value=2000),
    ops=st.lists(
        st.tuples(st.sampled_from(["submit", "step", "cancel"]), st.integers(0, 400), st.integers(1, 6)),
        min_size=1,
        max_size=40,
    ),
)
def test_the_engine_is_bounded_work_conserving_and_first_come_first_served(
    slots: int, pool: int, ops: list[tuple[str, int, int]]
) -> None:
    """Whatever arrives, steps or gives up: never more than the slots run, reservations never exceed
    the pool, a request waits only when the head cannot start, and starts follow arrival order."""
    engine = Engine(EngineParams(slots=slots, kv_pool_tokens=pool))
    submitted: list[str] = []
    started: list[str] = []
    gone: set[str] = set()
    for op, size, reply in ops:
        if op == "submit":
            rid = f"r{len(submitted)}"
            submitted.append(rid)
            engine.submit(request(rid, prompt=size, reply=reply, max_tokens=20))
        elif op == "cancel" and (live := [r for r in submitted if r not in gone]):
            victim = live[size % len(live)]
            gone.add(victim)
            engine.cancel(victim)
        else:
            step = engine.step()
            if step is not None:
                started.extend(r for r in step.tokens if r not in started)
                gone.update(step.finished, step.rejected)
        assert not slots or len(engine.running) <= slots
        assert engine.kv.reserved + engine.cache.size <= pool
        if len(engine.waiting) and not engine.busy:
            raise AssertionError("requests wait in an engine with nothing running and room to start")
    # Every request that started did so in arrival order, skipping those that left or never fit.
    assert started == [r for r in submitted if r in started]
