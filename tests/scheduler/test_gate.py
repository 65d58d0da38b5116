"""The run gate (scheduler/gate.py), decision by decision: which runs a replica holds, when a new
run waits for room and when it goes, how long a paused run keeps its place, and where the gate is off.

Every run here opens with a request of 3,600 bytes and max_tokens 100: 900 tokens by the
default tokens per byte, plus its reply's 100, so 1,000 tokens of working set. A pool of 5,000
tokens less the headroom holds four of them.
"""

from __future__ import annotations

import pytest
from scheduler_pool import Pool, placements, spec

from luftpause.scheduler import gate
from luftpause.scheduler.state import Phase

RUN_BYTES = 3600
RUN_MAX_TOKENS = 100
RUN_SIZE = 1000
POOL_TOKENS = 5000


def new_run(pool: Pool, turn_id: str, cls: str = "batch", caller: str = "flood", replica: str | None = None):
    """The first turn of run `run-<turn_id>`; returns where it went (None: it waits)."""
    pool.arrive(turn_id, cls=cls, caller=caller, request_bytes=RUN_BYTES, max_tokens=RUN_MAX_TOKENS)
    return pool.replica_of(turn_id)


def done(pool: Pool, turn_id: str, tool_calls: bool = False):
    """The turn completes with the usage its estimate said (900 prompt tokens at 0.25 a byte, no
    reply beyond the reservation), so its run's working set stays RUN_SIZE."""
    return pool.complete(turn_id, tool_calls=tool_calls, prompt_tokens=RUN_BYTES // 4, completion_tokens=0)


def gated_pool(*names: str, kv_tokens: int | None = POOL_TOKENS) -> Pool:
    return Pool(*(spec(name, lookahead=0, kv_tokens=kv_tokens) for name in names or ("a",)))


def test_the_estimate_of_a_run_from_its_request_is_what_these_tests_assume():
    assert gate.estimated_working_set(RUN_BYTES, RUN_MAX_TOKENS, None) == RUN_SIZE
    assert 4 * RUN_SIZE <= gate.capacity(gated_pool().state.replicas["a"]) < 5 * RUN_SIZE


def test_a_new_run_waits_while_the_runs_held_fill_the_pool_and_goes_when_one_ends():
    pool = gated_pool()
    assert [new_run(pool, f"t{i}") for i in range(6)] == ["a", "a", "a", "a", None, None]
    assert pool.state.held_runs["a"] == 4 and pool.state.held_kv["a"] == 4 * RUN_SIZE
    # t0's run answers in text: its room goes to the first run waiting.
    assert placements(done(pool, "t0")) == [("t4", "a")]
    assert pool.state.runs["run-t0"].phase is Phase.IDLE
    assert pool.held() == ["t5"]


def test_a_held_runs_next_turn_never_waits_for_room():
    pool = gated_pool()
    for i in range(5):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    assert pool.state.runs["run-t0"].phase is Phase.PAUSED
    assert pool.held() == ["t4"], "a paused run keeps its place: the new run still waits"
    pool.wait(2.0)
    assert placements(pool.arrive("t0b", run_id="run-t0", cls="batch", caller="flood")) == [("t0b", "a")]
    assert pool.held() == ["t4"]


def test_a_paused_run_past_its_keep_time_lets_go_and_its_next_turn_waits_like_a_new_runs():
    pool = gated_pool()
    for i in range(5):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    # No pause of this caller seen yet: the longest keep time.
    assert pool.state.runs["run-t0"].hold_until == pool.now + gate.HOLD_MAX_S
    pool.wait(gate.HOLD_MAX_S)
    assert placements(pool.tick()) == [("t4", "a")], "the room it let go of went to the run waiting"
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
        pool.arrive(f"t0-{n + 1}", run_id="run-t0", cls="batch", caller="flood")
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
    pool.arrive("t0b", run_id="run-t0", cls="batch", caller="flood")
    done(pool, "t0b", tool_calls=True)
    run = pool.state.runs["run-t0"]
    assert run.phase is Phase.PAUSED and run.replica is None
    assert pool.state.held_runs.get("a", 0) == 0


def test_the_gate_is_off_where_the_pool_is_unknown_and_a_paused_run_keeps_its_replica():
    pool = gated_pool(kv_tokens=None)
    assert [new_run(pool, f"t{i}") for i in range(8)] == ["a"] * 8
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


def test_a_replica_holding_no_run_takes_one_bigger_than_its_pool():
    pool = gated_pool(kv_tokens=500)
    assert new_run(pool, "t0") == "a"
    assert new_run(pool, "t1") is None


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
    for i in range(4):
        new_run(pool, f"t{i}")
    new_run(pool, "b1")
    new_run(pool, "b2")
    new_run(pool, "i1", cls="interactive", caller="user")
    assert pool.held() == ["b1", "b2", "i1"]
    assert placements(done(pool, "t0")) == [("i1", "a")]


def test_batch_cannot_take_the_room_a_paused_interactive_run_holds():
    pool = gated_pool()
    new_run(pool, "i0", cls="interactive", caller="user")
    for i in range(3):
        new_run(pool, f"t{i}")
    done(pool, "i0", tool_calls=True)
    assert new_run(pool, "b1") is None
    pool.wait(2.0)
    assert placements(pool.arrive("i0b", run_id="run-i0", caller="user")) == [("i0b", "a")]


def test_a_new_run_goes_where_it_fits():
    pool = gated_pool("a", "b")
    runs = [new_run(pool, f"t{i}") for i in range(8)]
    assert sorted(runs) == ["a"] * 4 + ["b"] * 4
    on_b = next(f"t{i}" for i, r in enumerate(runs) if r == "b")
    done(pool, on_b)
    assert new_run(pool, "t9") == "b"
    assert new_run(pool, "t10") is None


def test_a_run_that_ends_gives_its_room_back_at_once():
    pool = gated_pool()
    for i in range(5):
        new_run(pool, f"t{i}")
    done(pool, "t0", tool_calls=True)
    assert placements(pool.end_run("run-t0")) == [("t4", "a")]
