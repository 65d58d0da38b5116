"""The engine model alone: slots, the FIFO queue, cancellation, load counters and timing overrides."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.fake_engine.model import Engine, EngineTiming, timing_from_env
from luftpause.fake_engine.tokens import count_tokens, prompt_tokens

FAST = EngineTiming(prefill_base_s=0.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_requests_beyond_the_slots_wait_and_are_admitted_in_arrival_order() -> None:
    engine = Engine(slots=1, timing=FAST)
    release = asyncio.Event()
    order: list[str] = []

    async def request(label: str, hold: bool) -> None:
        async with engine.admit(prompt_tokens=10):
            order.append(label)
            if hold:
                await release.wait()

    first = asyncio.create_task(request("first", hold=True))
    await eventually(lambda: engine.load().running == 1)
    later = [asyncio.create_task(request(label, hold=False)) for label in ("second", "third")]
    await eventually(lambda: engine.load().waiting == 2)
    assert engine.load().running == 1
    release.set()
    await asyncio.gather(first, *later)
    assert order == ["first", "second", "third"]
    assert (engine.load().running, engine.load().waiting) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_runner_frees_its_slot() -> None:
    engine = Engine(slots=1, timing=FAST)
    hold = asyncio.Event()

    async def request() -> None:
        async with engine.admit(prompt_tokens=1):
            await hold.wait()

    runner = asyncio.create_task(request())
    await eventually(lambda: engine.load().running == 1)
    waiter = asyncio.create_task(request())
    await eventually(lambda: engine.load().waiting == 1)
    waiter.cancel()
    await eventually(lambda: engine.load().waiting == 0)
    runner.cancel()
    await eventually(lambda: engine.load().running == 0)
    # The engine is usable again: a new request is admitted at once.
    async with engine.admit(prompt_tokens=1):
        assert engine.load().running == 1


async def test_token_usage_and_token_totals_follow_the_running_requests() -> None:
    engine = Engine(
        slots=4,
        timing=EngineTiming(
            prefill_base_s=0, prefill_per_token_s=0, decode_per_token_s=0, kv_pool_tokens=1000
        ),
    )
    async with engine.admit(prompt_tokens=100) as admission:
        await admission.prefill()
        for _ in range(10):
            await admission.decode()
        load = engine.load()
        assert load.token_usage == pytest.approx(0.11)
        assert load.cache_hit_rate == 0.0
    load = engine.load()
    assert (load.token_usage, load.prompt_tokens_total, load.generation_tokens_total) == (0.0, 100, 10)


def test_timing_overrides_are_parsed_and_bad_ones_named() -> None:
    timing = timing_from_env("decode_per_token_s=0.05, reply_tokens=64")
    assert timing.decode_per_token_s == 0.05 and timing.reply_tokens == 64
    assert timing.prefill_base_s == EngineTiming().prefill_base_s
    assert timing_from_env("") == EngineTiming()
    with pytest.raises(ValueError, match="decode_ms"):
        timing_from_env("decode_ms=3")
    with pytest.raises(ValueError, match="reply_tokens must be a whole number"):
        timing_from_env("reply_tokens=lots")


def test_tokens_are_counted_from_characters() -> None:
    assert [count_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    short = prompt_tokens([{"role": "user", "content": "x" * 40}])
    long = prompt_tokens([{"role": "user", "content": "x" * 4000}])
    assert long - short == 990


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(min_value=1, max_value=3),
    steps=st.lists(st.sampled_from(["arrive", "finish", "cancel"]), min_size=1, max_size=30),
)
def test_never_more_than_the_slots_run_and_admission_follows_arrival(slots: int, steps: list[str]) -> None:
    """Whatever arrives, finishes or gives up, in any order: at most `slots` run, none waits while
    a slot is free, and requests are admitted in arrival order, skipping those that gave up."""

    async def scenario() -> None:
        engine = Engine(slots=slots, timing=FAST)
        admitted: list[int] = []
        gave_up: set[int] = set()
        tasks: dict[int, asyncio.Task] = {}
        done: dict[int, asyncio.Event] = {}

        async def request(i: int) -> None:
            async with engine.admit(prompt_tokens=1):
                admitted.append(i)
                await done[i].wait()

        for step in steps:
            live = [i for i, t in tasks.items() if not t.done()]
            if step == "arrive":
                i = len(tasks)
                done[i] = asyncio.Event()
                tasks[i] = asyncio.create_task(request(i))
            elif step == "finish" and (running := [i for i in live if i in admitted]):
                done[running[0]].set()
            elif step == "cancel" and (waiting := [i for i in live if i not in admitted]):
                gave_up.add(waiting[-1])
                tasks[waiting[-1]].cancel()
            for _ in range(5):  # let woken tasks run
                await asyncio.sleep(0)
            load = engine.load()
            assert load.running <= slots
            assert load.waiting == 0 or load.running == slots, "a request waits while a slot is free"
            assert load.running + load.waiting == len([t for t in tasks.values() if not t.done()])
        for event in done.values():
            event.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert admitted == [i for i in range(len(tasks)) if i not in gave_up]

    asyncio.run(scenario())
