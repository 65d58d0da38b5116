"""The run gate (scheduler/gate.py), decision by decision: which runs a replica holds, when a new
run waits for room and when it goes, how long a paused run keeps its place, and where the gate is off.

Every run here opens with a request of 3,600 bytes and max_tokens 100: 900 tokens by the
default tokens per byte, plus its reply's 100, so 1,000 tokens of working set. A pool of 12,000
tokens less the headroom holds ten of them (`FULL`), the fewest for which the gate holds runs.
"""

from __future__ import annotations

import pytest
from scheduler_pool import Pool, placements, spec

from luftpause.scheduler import gate
from luftpause.scheduler.actions import Place
from luftpause.scheduler.events import PoolConfigured, Resynced, ResyncedRun
from luftpause.scheduler.state import Phase, ServiceClass

RUN_BYTES = 3600
RUN_MAX_TOKENS = 100
RUN_SIZE = 1000
POOL_TOKENS = 12000
FULL = 10


def new_run(pool: Pool, turn_id: str, cls: str = "batch", caller: str = "flood", replica: str | None = None):
    """The first turn of run `run-<turn_id>`; returns where it went (None: it waits)."""
    pool.arrive(turn_id, cls=cls, caller=caller, request_bytes=RUN_BYTES, max_tokens=RUN_MAX_TOKENS)
    return pool.replica_of(turn_id)


def next_turn(pool: Pool, turn_id: str, run_id: str, cls: str = "batch", caller: str = "flood"):
    """A later turn of `run_id`, the same size as its first (the tests' runs do not grow)."""
    return pool.arrive(
        turn_id, run_id=run_id, cls=cls, caller=caller, request_bytes=RUN_BYTES, max_tokens=RUN_MAX_TOKENS
    )


def done(pool: Pool, turn_id: str, tool_calls: bool = False, tools: tuple[str, ...] = ()):
    """The turn completes with the usage its estimate said (900 prompt tokens at 0.25 a byte, no
    reply beyond the reservation), so its run's working set stays RUN_SIZE; with `tool_calls`, in
    calls of `tools` (by name; none named: ())."""
    return pool.complete(
        turn_id, tool_calls=tool_calls, prompt_tokens=RUN_BYTES // 4, completion_tokens=0, tools=tools
    )


def gated_pool(*names: str, kv_tokens: int | None = POOL_TOKENS) -> Pool:
    return Pool(*(spec(name, lookahead=0, kv_tokens=kv_tokens) for name in names or ("a",)))


def test_the_estimate_of_a_run_from_its_request_is_what_these_tests_assume():
    assert gate.estimated_working_set(RUN_BYTES, RUN_MAX_TOKENS, None) == RUN_SIZE
    replica = gated_pool().state.replicas["a"]
    assert FULL * RUN_SIZE <= gate.capacity(replica) < (FULL + 1) * RUN_SIZE
    assert gate.gated(replica, RUN_SIZE) and not gate.gated(replica, 2 * RUN_SIZE)


def test_a_new_run_waits_while_the_runs_held_fill_the_pool_and_goes_when_one_ends():
    pool = gated_pool()
    assert [new_run(pool, f"t{i}") for i in range(FULL + 2)] == ["a"] * FULL + [None, None]
    assert pool.state.held_runs["a"] == FULL and pool.state.held_kv["a"] == FULL * RUN_SIZE
    # t0's run answers in text: its room goes to the first run waiting.
    assert placements(done(pool, "t0")) == [(f"t{FULL}", "a")]
    assert pool.state.runs["run-t0"].phase is Phase.IDLE
    assert pool.held() == [f"t{FULL + 1}"]


def test_a_held_runs_next_turn_never_waits_for_room():
    pool = gated_pool()
    for i in range(FULL + 1):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    assert pool.state.runs["run-t0"].phase is Phase.PAUSED
    assert pool.held() == [f"t{FULL}"], "a paused run keeps its place: the new run still waits"
    pool.wait(2.0)
    assert placements(next_turn(pool, "t0b", "run-t0")) == [("t0b", "a")]
    assert pool.held() == [f"t{FULL}"]


def test_a_paused_run_past_its_keep_time_lets_go_and_its_next_turn_waits_like_a_new_runs():
    pool = gated_pool()
    for i in range(FULL + 1):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    # No pause of this caller seen yet: the longest keep time.
    assert pool.state.runs["run-t0"].hold_until == pool.now + gate.HOLD_MAX_S
    pool.wait(gate.HOLD_MAX_S)
    assert placements(pool.tick()) == [(f"t{FULL}", "a")], "the room it let go of went to the run waiting"
    run = pool.state.runs["run-t0"]
    assert (run.phase, run.replica, run.hold_until) == (Phase.PAUSED, None, None)
    # Its tool came back: it is a new run now, and waits for room like one.
    pool.arrive(
        "t0b",
        run_id="run-t0",
        cls="batch",
        caller="flood",
        request_bytes=RUN_BYTES,
        max_tokens=RUN_MAX_TOKENS,
    )
    assert pool.held() == ["t0b"]
    done(pool, "t1")
    assert pool.replica_of("t0b") == "a"


def test_a_run_paused_a_little_longer_than_its_callers_tools_usually_take_still_holds_its_place():
    pool = gated_pool()
    new_run(pool, "t0")
    for n in range(3):
        done(pool, f"t0-{n}" if n else "t0", tool_calls=True)
        pool.wait(2.0)
        next_turn(pool, f"t0-{n + 1}", "run-t0")
    assert pool.state.pause_samples["flood"] == (2.0, 2.0, 2.0)
    done(pool, "t0-3", tool_calls=True)
    keep = pool.state.runs["run-t0"].hold_until - pool.now
    assert keep == pytest.approx(2.0 * gate.HOLD_SLACK)


def test_a_caller_whose_tools_take_longer_than_a_place_is_kept_lets_go_at_once():
    pool = gated_pool()
    new_run(pool, "t0")
    long_tool = gate.HOLD_MAX_S  # times the slack, more than a place is kept for
    done(pool, "t0", tool_calls=True)
    pool.wait(long_tool)
    next_turn(pool, "t0b", "run-t0")
    done(pool, "t0b", tool_calls=True)
    run = pool.state.runs["run-t0"]
    assert run.phase is Phase.PAUSED and run.replica is None
    assert pool.state.held_runs.get("a", 0) == 0


def _pause_on(pool: Pool, run_id: str, turn_id: str, tools: tuple[str, ...], pause_s: float) -> str:
    """`turn_id` of `run_id` completes in calls of `tools`, which take `pause_s`; the run's next
    turn arrives then. Returns that turn's id."""
    done(pool, turn_id, tool_calls=True, tools=tools)
    pool.wait(pause_s)
    back = f"{turn_id}+"
    next_turn(pool, back, run_id)
    return back


def test_a_run_paused_on_a_quick_tool_keeps_its_place_though_its_caller_also_runs_slow_ones():
    pool = gated_pool()
    new_run(pool, "t0")
    turn = "t0"
    # The caller alternates a read of half a second with a test run of a minute.
    for _ in range(gate.MIN_TOOL_SAMPLES):
        turn = _pause_on(pool, "run-t0", turn, ("read_file",), 0.5)
        turn = _pause_on(pool, "run-t0", turn, ("run_tests",), 60.0)
    # All its pauses together would let go at once (their 90th percentile is a minute).
    assert gate.hold_for(pool.state.pause_samples["flood"]) == 0.0
    done(pool, turn, tool_calls=True, tools=("read_file",))
    run = pool.state.runs["run-t0"]
    assert run.tool == "read_file" and run.replica == "a"
    assert run.hold_until == pytest.approx(pool.now + max(0.5 * gate.HOLD_SLACK, gate.HOLD_MIN_S))
    # Paused on the tests, the same run lets go at once: the room goes to runs that will use it.
    pool.wait(0.5)
    next_turn(pool, "t-last", "run-t0")
    done(pool, "t-last", tool_calls=True, tools=("run_tests",))
    run = pool.state.runs["run-t0"]
    assert run.phase is Phase.PAUSED and run.replica is None and run.tool == "run_tests"


def test_a_tool_seen_fewer_times_than_asked_keeps_its_callers_time_and_an_unnamed_one_too():
    pool = gated_pool()
    new_run(pool, "t0")
    turn = _pause_on(pool, "run-t0", "t0", ("search",), 2.0)
    turn = _pause_on(pool, "run-t0", turn, ("search",), 2.0)
    turn = _pause_on(pool, "run-t0", turn, (), 1.0)  # a reply that named no tool: the caller's only
    assert dict(pool.state.tool_pauses["flood"]) == {"search": (2.0, 2.0)}
    assert pool.state.pause_samples["flood"] == (2.0, 2.0, 1.0)
    callers = gate.hold_for(pool.state.pause_samples["flood"])
    for tools in (("search",), ()):  # twice on search is below MIN_TOOL_SAMPLES
        done(pool, turn, tool_calls=True, tools=tools)
        assert pool.state.runs["run-t0"].hold_until == pytest.approx(pool.now + callers)
        pool.wait(0.1)
        turn = f"{turn}+"
        next_turn(pool, turn, "run-t0")


def test_a_reply_calling_several_tools_is_paused_on_them_together():
    assert gate.tool_key(("web_search", "read_file", "web_search", "")) == "read_file+web_search"
    assert gate.tool_key(()) == ""
    assert len(gate.tool_key(tuple(f"tool_{n:03d}_{'x' * 40}" for n in range(16)))) == gate.TOOL_KEY_CHARS


def test_a_caller_keeps_the_pauses_of_its_latest_tools_only():
    tools: tuple = ()
    for n in range(gate.TOOLS_PER_CALLER + 4):
        tools = gate.learn_tool_pause(tools, f"tool{n}", 1.0)
    tools = gate.learn_tool_pause(tools, "tool5", 2.0)  # learnt again: it is the newest now
    names = [name for name, _ in tools]
    assert len(names) == gate.TOOLS_PER_CALLER
    assert names[-1] == "tool5" and names[0] == "tool4" and "tool3" not in names
    assert dict(tools)["tool5"] == (1.0, 2.0)
    assert gate.learn_tool_pause(tools, "", 9.0) == tools


def test_after_a_resync_the_gate_counts_each_run_by_the_usage_its_dataplane_kept():
    pool = gated_pool()
    pool.wait(1.0)
    view = tuple(
        ResyncedRun(
            f"run-{n}",
            "a",
            Phase.PAUSED,
            ServiceClass.BATCH,
            "flood",
            idle_s=0.5,
            prompt_tokens=RUN_BYTES // 4,
            completion_tokens=0,
            max_tokens=RUN_MAX_TOKENS,
            tool_names=("search",),
        )
        for n in range(FULL)
    )
    pool.feed(Resynced(runs=view, turns=(), at=pool.now))
    assert pool.state.held_kv["a"] == FULL * RUN_SIZE and pool.state.held_runs["a"] == FULL
    assert {run.tool for run in pool.state.runs.values()} == {"search"}
    # Before, each came back sized 0 and a new run found room beside ten that fill the pool.
    assert new_run(pool, "t-new") is None


def test_the_gate_is_off_where_the_pool_is_unknown_and_a_paused_run_keeps_its_replica():
    pool = gated_pool(kv_tokens=None)
    assert [new_run(pool, f"t{i}") for i in range(2 * FULL)] == ["a"] * (2 * FULL)
    done(pool, "t0", tool_calls=True)
    assert pool.state.runs["run-t0"].hold_until is None
    pool.wait(10 * gate.HOLD_MAX_S)
    pool.tick()
    assert pool.state.runs["run-t0"].replica == "a"


def test_the_pool_is_read_from_the_engine_and_the_config_overrides_it():
    pool = Pool(spec("a", lookahead=0), spec("b", lookahead=0, kv_tokens=POOL_TOKENS))
    pool.probe("a", running=0, waiting=0, kv_tokens=2 * POOL_TOKENS)
    pool.probe("b", running=0, waiting=0, kv_tokens=10 * POOL_TOKENS)
    assert pool.state.replicas["a"].kv_tokens == 2 * POOL_TOKENS
    assert pool.state.replicas["b"].kv_tokens == POOL_TOKENS
    # A probe that did not read it leaves the last reading.
    pool.probe("a", running=0, waiting=0)
    assert pool.state.replicas["a"].kv_tokens == 2 * POOL_TOKENS


def test_a_pool_that_keeps_too_few_runs_warm_holds_none_back_and_pins_them_as_without_the_gate():
    # Room for GATE_MIN_RUNS - 1 of them: holding so few through their tools would idle the engine.
    small = gated_pool(kv_tokens=int((gate.GATE_MIN_RUNS - 1) * RUN_SIZE / (1 - gate.KV_HEADROOM)) + 10)
    assert [new_run(small, f"t{i}") for i in range(FULL + 2)] == ["a"] * (FULL + 2)
    done(small, "t0", tool_calls=True)
    assert small.state.runs["run-t0"].hold_until is None
    small.wait(10 * gate.HOLD_MAX_S)
    small.tick()
    assert small.state.runs["run-t0"].replica == "a"


def test_a_runs_usage_replaces_its_estimate_and_teaches_the_models_tokens_per_byte():
    pool = gated_pool()
    new_run(pool, "t0")
    assert pool.state.runs["run-t0"].working_set == RUN_SIZE
    pool.complete("t0", tool_calls=True, prompt_tokens=1800, completion_tokens=12)
    assert pool.state.runs["run-t0"].working_set == 1800 + 12 + RUN_MAX_TOKENS
    assert pool.state.held_kv["a"] == 1800 + 12 + RUN_MAX_TOKENS
    assert pool.state.tokens_per_byte["m"] == pytest.approx(1800 / RUN_BYTES)
    # The next run of that model is estimated at the learnt rate: 0.5 tokens a byte.
    new_run(pool, "t1")
    assert pool.state.runs["run-t1"].working_set == 1800 + RUN_MAX_TOKENS


def test_when_room_frees_an_interactive_run_waiting_goes_before_batch_runs_that_came_first():
    pool = gated_pool()
    for i in range(FULL):
        new_run(pool, f"t{i}")
    new_run(pool, "b1")
    new_run(pool, "b2")
    new_run(pool, "i1", cls="interactive", caller="user")
    assert pool.held() == ["b1", "b2", "i1"]
    assert placements(done(pool, "t0")) == [("i1", "a")]


def test_batch_cannot_take_the_room_a_paused_interactive_run_holds():
    pool = gated_pool()
    new_run(pool, "i0", cls="interactive", caller="user")
    for i in range(FULL - 1):
        new_run(pool, f"t{i}")
    done(pool, "i0", tool_calls=True)
    assert new_run(pool, "b1") is None
    pool.wait(2.0)
    assert placements(next_turn(pool, "i0b", "run-i0", cls="interactive", caller="user")) == [("i0b", "a")]


def test_a_new_run_goes_where_it_fits():
    pool = gated_pool("a", "b")
    runs = [new_run(pool, f"t{i}") for i in range(2 * FULL)]
    assert sorted(runs) == ["a"] * FULL + ["b"] * FULL
    on_b = next(f"t{i}" for i, r in enumerate(runs) if r == "b")
    done(pool, on_b)
    assert new_run(pool, "again") == "b"
    assert new_run(pool, "one-more") is None


def test_a_run_that_ends_gives_its_room_back_at_once():
    pool = gated_pool()
    for i in range(FULL + 1):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    assert placements(pool.end_run("run-t0")) == [(f"t{FULL}", "a")]


def test_a_replica_configured_with_gate_min_runs_0_has_no_gate():
    pool = Pool(spec("a", lookahead=0, kv_tokens=POOL_TOKENS, gate_min_runs=0))
    assert [new_run(pool, f"t{i}") for i in range(FULL + 2)] == ["a"] * (FULL + 2)


def test_a_caller_whose_tools_answer_at_once_still_keeps_its_place_for_a_second():
    pool = gated_pool()
    new_run(pool, "t0")
    for n in range(3):
        done(pool, f"t0-{n}" if n else "t0", tool_calls=True)
        pool.wait(0.01)
        next_turn(pool, f"t0-{n + 1}", "run-t0")
    done(pool, "t0-3", tool_calls=True)
    assert pool.state.runs["run-t0"].hold_until - pool.now == pytest.approx(gate.HOLD_MIN_S)
    pool.wait(0.05)  # more than 1.25 times its pauses: still held
    pool.tick()
    assert pool.state.runs["run-t0"].replica == "a"


def test_on_a_slot_engine_a_replica_holds_one_run_a_slot_whatever_their_size():
    # llama.cpp keeps each request's KV in a slot of its own: a fifth run on four slots takes a
    # paused run's slot, however small the runs are against the tokens the slots hold.
    pool = Pool(spec("a", lookahead=0, kv_slots=4), spec("b", lookahead=0))
    pool.probe("b", running=0, waiting=0, kv_slots=2)
    assert [new_run(pool, f"t{i}") for i in range(7)] == ["a", "b", "a", "b", "a", "a", None]
    done(pool, "t1", tool_calls=True)
    assert new_run(pool, "late") is None  # t1, paused on its tool, keeps its slot
    done(pool, "t0", tool_calls=True)
    assert placements(pool.end_run("run-t0")) == [("t6", "a")]
    # The config's slots stand against what a probe says; a probe's stand until the next one.
    pool.probe("a", running=0, waiting=0, kv_slots=16)
    pool.probe("b", running=0, waiting=0)
    assert (pool.state.replicas["a"].kv_slots, pool.state.replicas["b"].kv_slots) == (4, 2)


def test_where_the_engine_keeps_evicted_prefixes_in_host_memory_the_gate_holds_no_runs():
    pool = Pool(spec("a", lookahead=0, kv_slots=4, host_cache=True))
    assert [new_run(pool, f"t{i}") for i in range(6)] == ["a"] * 6
    done(pool, "t0", tool_calls=True)
    assert pool.state.runs["run-t0"].hold_until is None
    assert gate.mode(pool.state.replicas["a"]) == "off: host cache"


def test_an_engine_that_says_it_keeps_a_host_tier_turns_the_gate_off_unless_the_config_says_otherwise():
    # The config says nothing of "a"'s host tier, so its engine's word counts.
    pool = Pool(spec("a", lookahead=0, kv_tokens=POOL_TOKENS))
    pool.probe("a", running=0, waiting=0, host_cache=True)
    a = pool.state.replicas["a"]
    assert (a.host_cache, a.host_cache_source, gate.mode(a)) == (True, "engine", "off: host cache")
    # Every new run goes, however many the pool could keep warm, and none is held through its tool.
    assert [new_run(pool, f"a{i}") for i in range(FULL + 2)] == ["a"] * (FULL + 2)
    done(pool, "a0", tool_calls=True)
    assert pool.state.runs["run-a0"].hold_until is None
    # A probe that does not say leaves the reading standing; the engine saying no turns it back on.
    pool.probe("a", running=0, waiting=0)
    assert pool.state.replicas["a"].host_cache is True
    pool.probe("a", running=0, waiting=0, host_cache=False)
    assert gate.mode(pool.state.replicas["a"]) == "tokens"
    # The config of "b" says it keeps no host tier: the engine's word does not change that.
    pool = Pool(spec("b", lookahead=0, kv_tokens=POOL_TOKENS, host_cache_configured=True))
    pool.probe("b", running=0, waiting=0, host_cache=True)
    b = pool.state.replicas["b"]
    assert (b.host_cache, b.host_cache_source, gate.mode(b)) == (False, "config", "tokens")
    assert [new_run(pool, f"b{i}") for i in range(FULL + 1)] == ["b"] * FULL + [None]


def test_the_engines_word_on_its_host_tier_outlasts_a_pool_change_and_the_config_overrides_it():
    pool = Pool(spec("a", lookahead=0, kv_tokens=POOL_TOKENS))
    pool.probe("a", running=0, waiting=0, host_cache=True)
    pool.feed(PoolConfigured((spec("a", lookahead=0, kv_tokens=POOL_TOKENS),), pool.now))
    assert (pool.state.replicas["a"].host_cache, pool.state.replicas["a"].host_cache_source) == (
        True,
        "engine",
    )
    pool.feed(
        PoolConfigured((spec("a", lookahead=0, kv_tokens=POOL_TOKENS, host_cache_configured=True),), pool.now)
    )
    assert (pool.state.replicas["a"].host_cache, pool.state.replicas["a"].host_cache_source) == (
        False,
        "config",
    )


def _slot_named(actions) -> dict[str, int | None]:
    return {a.turn_id: a.slot for a in actions if isinstance(a, Place)}


def test_on_a_slot_engine_each_held_run_names_a_slot_of_its_own_and_a_new_run_takes_a_freed_one():
    pool = Pool(spec("a", lookahead=0, kv_slots=3))
    named = {}
    for i in range(3):
        named |= _slot_named(pool.arrive(f"t{i}", run_id=f"r{i}", cls="batch", request_bytes=RUN_BYTES))
    assert named == {"t0": 0, "t1": 1, "t2": 2}
    pool.complete("t1", tool_calls=True, prompt_tokens=900, completion_tokens=0)
    # Its next turn goes back to the slot its KV is in.
    assert _slot_named(pool.arrive("t1b", run_id="r1", cls="batch", request_bytes=RUN_BYTES)) == {"t1b": 1}
    pool.complete("t0", tool_calls=True, prompt_tokens=900, completion_tokens=0)
    # A new run waits: no slot is free.
    assert _slot_named(pool.arrive("t3", run_id="r3", cls="batch", request_bytes=RUN_BYTES)) == {}
    # r0 ends: its slot is the new run's; the paused run r1's is never given away.
    assert _slot_named(pool.end_run("r0")) == {"t3": 0}
    assert pool.state.runs["r3"].slot == 0 and pool.state.held_slots["a"] == frozenset({0, 1, 2})


def test_where_the_gate_holds_no_runs_no_slot_is_named():
    for replica in (
        spec("a", lookahead=0, kv_slots=4, host_cache=True),
        spec("a", lookahead=0, kv_tokens=POOL_TOKENS),
    ):
        pool = Pool(replica)
        assert _slot_named(pool.arrive("t0", run_id="r0", request_bytes=RUN_BYTES)) == {"t0": None}
