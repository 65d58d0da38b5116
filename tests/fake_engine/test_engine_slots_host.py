"""The engine model's llama.cpp modes: slots that each keep their own KV, and a host tier behind
the KV (of a slot engine and of the shared pool); both off by default."""

from __future__ import annotations

import dataclasses

import pytest

from luftpause.fake_engine.engine import Engine, ModelRequest
from luftpause.fake_engine.params import LLAMACPP_ONE_CORE, EngineParams
from luftpause.fake_engine.prefix_cache import Block

# Round numbers so that prefill times can be checked exactly.
SLOTS = EngineParams(
    slots=4,
    slot_kv=True,
    kv_pool_tokens=4 * 4_000,
    prefill_base_s=0.0,
    prefill_per_token_s=0.001,
    decode_base_s=0.01,
    decode_per_seq_s=0.002,
)
SHARED = Block(b"shared", 100)


def chain(run: str, turns: int) -> tuple[Block, ...]:
    """A run's prompt after `turns` turns: the shared block, then one block of 1,000 tokens a turn
    (the shared block is then under llama-server's similarity threshold, a tenth of the prompt)."""
    return (SHARED, *(Block(f"{run}/{i}".encode(), 1_000) for i in range(turns)))


def request(rid: str, blocks: tuple[Block, ...], reply: int = 2) -> ModelRequest:
    return ModelRequest(rid, blocks, reply, 32, reply=Block(f"{rid}/reply".encode(), reply))


def run(engine: Engine, req: ModelRequest) -> float:
    """Submits `req` alone and runs the engine until it is idle; the prefill pass's seconds."""
    engine.submit(req)
    prefill = 0.0
    while (step := engine.step()) is not None:
        if step.kind == "prefill":
            prefill += step.ended - step.started
    return prefill


def test_a_request_reuses_its_own_slots_prefix() -> None:
    engine = Engine(SLOTS)
    for r in "abcd":
        run(engine, request(f"{r}1", chain(r, 1)))
    # The next turn of run c goes to c's slot and prefills only its new block.
    assert run(engine, request("c2", chain("c", 2))) == pytest.approx(0.001 * 1_000)
    assert engine.slot_chains()[2][:2] == chain("c", 2)[:2]
    # The first turns each took an empty slot (the shared block alone is under the threshold).
    assert engine.load().prefix_hits_total == 1_100


def test_a_fifth_run_on_four_slots_takes_the_least_recently_used_idle_slot() -> None:
    engine = Engine(SLOTS)
    for r in "abcd":
        run(engine, request(f"{r}1", chain(r, 1)))
    run(engine, request("a2", chain("a", 2)))  # a's slot is now the most recently used
    # Run e shares only the shared block with every slot, under the similarity threshold of its
    # prompt: it takes b's slot, the least recently used.
    e = (SHARED, Block(b"e/0", 3_000))
    run(engine, request("e1", e))
    held = engine.slot_chains()
    assert [c[1].key for c in held] == [b"a/0", b"e/0", b"c/0", b"d/0"]
    # b's next turn finds no slot of its own: it takes the least recently used (c's) and
    # prefills everything after the shared block; c's slot loses what it held.
    assert run(engine, request("b2", chain("b", 2))) == pytest.approx(0.001 * 2_000)
    assert engine.slot_chains()[2][1].key == b"b/0"
    assert engine.work().tokens_evicted > 0


def test_a_slot_engine_rejects_a_prompt_longer_than_a_slot() -> None:
    engine = Engine(SLOTS)
    engine.submit(request("long", (Block(b"x", 4_001),)))
    step = engine.step()
    assert step is not None and step.rejected == ("long",)


def test_a_prefix_a_slot_dropped_comes_back_from_the_host_tier_at_its_cost() -> None:
    params = EngineParams(**{**SLOTS.__dict__, "slots": 1, "kv_pool_tokens": 4_000,
                             "host_cache_tokens": 100_000, "host_restore_per_token_s": 0.00001})  # fmt: skip
    engine = Engine(params)
    run(engine, request("a1", chain("a", 1)))
    run(engine, request("b1", chain("b", 1)))  # takes a's slot: a's prompt goes to host memory
    # a's next turn: b's prompt and reply saved, a's prefix loaded back; only the new block computed.
    took = run(engine, request("a2", chain("a", 2)))
    saved = 100 + 1_000 + 2  # b's prompt and reply
    loaded = 100 + 1_000  # a's prompt (a's reply block is not in a2's prompt: keyed apart here)
    assert took == pytest.approx(0.001 * 1_000 + 0.00001 * (saved + loaded))
    # Without the tier the same turn recomputes a's own block.
    bare = Engine(EngineParams(**{**params.__dict__, "host_cache_tokens": 0}))
    for rid, blocks in (("a1", chain("a", 1)), ("b1", chain("b", 1))):
        run(bare, request(rid, blocks))
    assert run(bare, request("a2", chain("a", 2))) == pytest.approx(0.001 * 2_000)


def test_the_shared_pool_restores_an_evicted_prefix_from_the_host_tier_not_prefill() -> None:
    params = EngineParams(
        kv_pool_tokens=400,
        prefill_base_s=0.0,
        prefill_per_token_s=0.001,
        host_cache_tokens=10_000,
        host_restore_per_token_s=0.00001,
    )
    engine = Engine(params)
    one = (Block(b"a", 300),)
    run(engine, ModelRequest("a1", one, 1, 10))
    run(engine, ModelRequest("b1", (Block(b"b", 300),), 1, 10))  # evicts a from the KV
    assert b"a" not in engine.cache and engine.host is not None and b"a" in engine.host
    took = run(engine, ModelRequest("a2", (*one, Block(b"a+", 50)), 1, 10))
    assert took == pytest.approx(0.001 * 50 + 0.00001 * 300)
    assert engine.load().prefix_hits_total == 300


def test_the_modes_are_off_by_default_and_the_preset_turns_slots_on() -> None:
    default = EngineParams()
    assert (default.slot_kv, default.host_cache_tokens, default.host_restore_per_token_s) == (False, 0, 0.0)
    assert Engine(default).host is None
    assert LLAMACPP_ONE_CORE.slot_kv and LLAMACPP_ONE_CORE.slots == 4
    assert LLAMACPP_ONE_CORE.host_cache_tokens > 0
    with pytest.raises(ValueError):
        Engine(EngineParams(slot_kv=True))


def test_a_request_that_names_its_slot_runs_there_and_waits_while_it_is_busy() -> None:

    engine = Engine(SLOTS)
    for r in "abcd":
        run(engine, request(f"{r}1", chain(r, 1)))
    # A new run e, named into d's slot (least recently used would be a's): a's prefix stays.
    run(engine, dataclasses.replace(request("e1", chain("e", 1)), slot=3))
    assert engine.slot_chains()[0][:2] == chain("a", 1) and engine.slot_chains()[3][:2] == chain("e", 1)
    # While slot 1 is busy, a request naming it waits though other slots are idle.
    engine.submit(request("b2", chain("b", 2)))
    engine.step()  # b2 prefills in slot 1 (its own prefix)
    engine.submit(dataclasses.replace(request("f1", chain("f", 1)), slot=1))
    step = engine.step()
    assert step is not None and step.kind == "decode" and "f1" not in engine.running
