"""The admission rules, one small case each, against `decide` directly (no process, no network)."""

from __future__ import annotations

import pytest
from scheduler_pool import Pool, placements, refusals, spec

from luftpause.scheduler.actions import Place, Refuse, RunForgotten, TurnExpired
from luftpause.scheduler.core import RUN_IDLE_EXPIRY_S, TURN_TIMEOUT_S, decide
from luftpause.scheduler.events import (
    PoolConfigured,
    Resynced,
    ResyncedRun,
    ResyncedTurn,
    TurnCompleted,
    TurnFailed,
)
from luftpause.scheduler.state import Kind, Phase, ServiceClass, State

# --- routing by model and kind ----------------------------------------------------------------


def test_unknown_model_is_refused_at_once_and_nothing_is_recorded():
    pool = Pool()
    actions = pool.arrive("t1", run_id="r1", model="gpt-nope")
    assert actions == (Refuse("t1", "r1", "no Generative replica serves model 'gpt-nope'"),)
    assert "t1" not in pool.state.turns
    assert "r1" not in pool.state.runs


def test_single_pass_turn_for_a_model_only_generative_replicas_serve_is_refused():
    pool = Pool(spec("a", "roberta"))
    actions = pool.arrive("t1", model="roberta", kind=Kind.SINGLE_PASS)
    assert refusals(actions) == ["no SinglePass replica serves model 'roberta'"]


def test_turn_goes_only_to_a_replica_serving_its_model():
    pool = Pool(spec("a", "small"), spec("b", "large"))
    assert placements(pool.arrive("t1", model="large")) == [("t1", "b")]
    assert placements(pool.arrive("t2", model="large")) == [("t2", "b")]
    assert placements(pool.arrive("t3", model="small")) == [("t3", "a")]


def test_single_pass_turns_go_to_single_pass_replicas_and_keep_no_run():
    pool = Pool(spec("gen", "m"), spec("cls", "m", kind=Kind.SINGLE_PASS))
    assert placements(pool.arrive("t1", run_id="r1", kind=Kind.SINGLE_PASS)) == [("t1", "cls")]
    assert "r1" not in pool.state.runs
    assert placements(pool.arrive("t2", run_id="r2")) == [("t2", "gen")]


def test_place_carries_the_replica_url_and_the_time_held():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    pool.arrive("t1", run_id="r1")
    pool.wait(2.5)
    assert pool.probe("a", healthy=True) == (Place("t1", "r1", "a", "http://a", 2.5),)


# --- health ---------------------------------------------------------------------------------


def test_a_replica_never_probed_takes_turns_at_once():
    pool = Pool(spec("a"))
    assert placements(pool.arrive("t1")) == [("t1", "a")]


def test_unhealthy_replica_gets_no_turns():
    pool = Pool()
    pool.probe("a", healthy=False)
    assert [r for _, r in placements(pool.arrive("t1") + pool.arrive("t2") + pool.arrive("t3"))] == [
        "b",
        "b",
        "b",
    ]


def test_model_served_only_by_unhealthy_replicas_is_held_until_one_recovers():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    assert pool.arrive("t1") == ()
    assert pool.held() == ["t1"]
    assert placements(pool.probe("a", healthy=True)) == [("t1", "a")]


# --- engine-load admission --------------------------------------------------------------------


def test_no_waiting_queue_means_no_cap():
    pool = Pool(spec("a"))
    pool.probe("a", running=3, waiting=0)
    for i in range(10):
        assert placements(pool.arrive(f"t{i}")) == [(f"t{i}", "a")]


def test_a_queueing_engine_caps_our_turns_at_its_running_count():
    pool = Pool(spec("a"))
    pool.probe("a", running=2, waiting=1)
    assert placements(pool.arrive("t1")) == [("t1", "a")]
    assert placements(pool.arrive("t2")) == [("t2", "a")]
    assert pool.arrive("t3") == ()
    assert pool.held() == ["t3"]
    assert placements(pool.complete("t1")) == [("t3", "a")]


def test_engine_reporting_no_load_is_never_capped():
    pool = Pool(spec("ollama", reports_load=False))
    pool.probe("ollama", running=1, waiting=5)
    assert all(placements(pool.arrive(f"t{i}")) for i in range(5))


def test_queue_draining_on_the_engine_releases_held_turns_at_the_next_probe():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=4)
    pool.arrive("t1")
    pool.arrive("t2")
    pool.arrive("t3")
    assert pool.held() == ["t2", "t3"]
    assert placements(pool.probe("a", running=1, waiting=0)) == [("t2", "a"), ("t3", "a")]


def test_a_probe_that_could_not_read_the_load_keeps_the_last_reading():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=3)
    pool.arrive("t1")
    assert pool.probe("a", healthy=True, running=None, waiting=None) == ()
    assert pool.arrive("t2") == ()


# --- strict run affinity ----------------------------------------------------------------------


def test_generating_run_stays_on_its_replica_even_when_another_is_emptier():
    pool = Pool()
    pool.arrive("t1", run_id="r1")  # a
    pool.arrive("t2", run_id="r1")  # r1 is generating on a; b has nothing
    assert pool.replica_of("t2") == "a"


def test_paused_run_returns_to_its_replica_even_when_another_is_emptier():
    pool = Pool()
    pool.arrive("t1", run_id="r1")  # a
    pool.complete("t1", tool_calls=True)
    assert pool.state.runs["r1"].phase is Phase.PAUSED
    for t in ("x1", "x2", "x3"):
        pool.arrive(t)  # a, b, a
    assert (pool.state.in_flight("a"), pool.state.in_flight("b")) == (2, 1)
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "a")]


def test_paused_run_waits_for_its_full_replica_instead_of_moving():
    pool = Pool()
    pool.probe("a", running=1, waiting=2)
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.arrive("x1", run_id="other", cls="interactive")  # takes a's one slot
    assert pool.replica_of("x1") == "a"
    assert pool.arrive("t2", run_id="r1") == ()  # b is empty, but r1's cache is on a
    assert placements(pool.complete("x1")) == [("t2", "a")]


def test_idle_run_may_move_to_the_least_loaded_replica():
    pool = Pool()
    pool.arrive("t1", run_id="r1")  # a
    pool.complete("t1")  # stop: idle
    pool.arrive("x1", run_id="other")  # a (tie)
    assert pool.state.runs["r1"].phase is Phase.IDLE
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "b")]


def test_run_whose_replica_is_unhealthy_may_move():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.probe("a", healthy=False)
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "b")]


def test_fewest_in_flight_wins_and_ties_go_to_config_order():
    pool = Pool(spec("a"), spec("b"), spec("c"))
    got = [r for i in range(6) for _, r in placements(pool.arrive(f"t{i}"))]
    assert got == ["a", "b", "c", "a", "b", "c"]
    pool.complete("t1")  # b now has the fewest
    assert placements(pool.arrive("t9")) == [("t9", "b")]


# --- service classes ------------------------------------------------------------------------


def _capped_with_paused_interactive() -> Pool:
    """Replica a capped at 2, one interactive run paused on a tool there, one batch turn running."""
    pool = Pool(spec("a"))
    pool.probe("a", running=2, waiting=1)
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    pool.arrive("b1", run_id="rb1", cls="batch")
    return pool


def test_batch_leaves_a_slot_for_each_paused_interactive_run():
    pool = _capped_with_paused_interactive()
    assert pool.arrive("b2", run_id="rb2", cls="batch") == ()
    assert pool.held() == ["b2"]


def test_the_paused_interactive_run_takes_the_slot_batch_left():
    pool = _capped_with_paused_interactive()
    pool.arrive("b2", run_id="rb2", cls="batch")
    assert placements(pool.arrive("i2", run_id="ri")) == [("i2", "a")]


def test_other_interactive_turns_are_not_kept_out_by_the_reservation():
    pool = _capped_with_paused_interactive()
    assert placements(pool.arrive("i9", run_id="another")) == [("i9", "a")]


def test_batch_headroom_applies_only_to_a_capped_replica():
    pool = Pool(spec("a"))
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    assert all(placements(pool.arrive(f"b{i}", cls="batch")) for i in range(4))


def test_a_paused_batch_run_reserves_nothing():
    pool = Pool(spec("a"))
    pool.probe("a", running=2, waiting=1)
    pool.arrive("b0", run_id="rb0", cls="batch")
    pool.complete("b0", tool_calls=True)
    pool.arrive("b1", run_id="rb1", cls="batch")
    assert placements(pool.arrive("b2", run_id="rb2", cls="batch")) == [("b2", "a")]


# --- draining held turns ----------------------------------------------------------------------


def _full(pool: Pool, *turns: str, caller: str = "filler") -> None:
    for t in turns:
        pool.arrive(t, caller=caller, cls="batch")


def test_interactive_drains_before_batch_that_arrived_earlier():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    _full(pool, "f1")
    pool.arrive("b1", cls="batch", caller="x")
    pool.wait(1)
    pool.arrive("i1", cls="interactive", caller="x")
    assert placements(pool.complete("f1")) == [("i1", "a")]


def test_caller_with_fewest_turns_in_flight_drains_first():
    pool = Pool(spec("a"))
    pool.probe("a", running=3, waiting=1)
    pool.arrive("greedy1", caller="greedy")
    pool.arrive("greedy2", caller="greedy")
    pool.arrive("f1", caller="filler")
    pool.arrive("greedy3", caller="greedy")  # held, arrived first
    pool.arrive("quiet1", caller="quiet")  # held
    assert pool.held() == ["greedy3", "quiet1"]
    assert placements(pool.complete("f1")) == [("quiet1", "a")]  # quiet has none in flight, greedy two


def test_equal_callers_drain_in_arrival_order():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    _full(pool, "f1")
    for t in ("x1", "x2", "x3"):
        pool.wait(0.1)
        pool.arrive(t, caller="same")
    assert placements(pool.complete("f1")) == [("x1", "a")]


def test_drain_reorders_after_each_placement():
    pool = Pool(spec("a"))
    pool.probe("a", running=2, waiting=1)
    _full(pool, "f1", "f2")
    pool.arrive("p1", caller="p")
    pool.arrive("p2", caller="p")
    pool.arrive("q1", caller="q")
    # Two slots free at once: p's first turn goes, then q (0 in flight) before p's second.
    assert placements(pool.probe("a", running=4, waiting=1)) == [("p1", "a"), ("q1", "a")]


def test_a_held_turn_pinned_to_a_full_replica_does_not_block_the_others():
    pool = Pool()
    pool.probe("a", running=1, waiting=1)
    pool.probe("b", running=1, waiting=1)
    pool.arrive("t1", run_id="r1")  # a
    pool.complete("t1", tool_calls=True)
    pool.arrive("x1", run_id="rx")  # a (fewest: 0 vs 0, config order)
    pool.arrive("t2", run_id="r1")  # pinned to a, which is full: held
    pool.arrive("y1", run_id="ry")  # b
    pool.arrive("z1", run_id="rz")  # held: both full
    assert pool.held() == ["t2", "z1"]
    assert placements(pool.complete("y1")) == [("z1", "b")]
    assert pool.held() == ["t2"]


# --- turn endings -----------------------------------------------------------------------------


def test_completion_with_tool_calls_pauses_the_run_and_otherwise_idles_it():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    assert pool.state.runs["r1"].phase is Phase.PAUSED
    pool.arrive("t2", run_id="r1")
    assert pool.state.runs["r1"].phase is Phase.GENERATING
    pool.complete("t2")
    assert pool.state.runs["r1"].phase is Phase.IDLE


def test_a_failed_turn_frees_its_slot_at_once_and_leaves_the_run_idle():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    pool.arrive("t1", run_id="r1")
    pool.arrive("t2", run_id="r2")
    assert placements(pool.fail("t1")) == [("t2", "a")]
    assert pool.state.runs["r1"].phase is Phase.IDLE


def test_failure_after_a_tool_pause_never_leaves_the_run_paused():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.arrive("t2", run_id="r1")
    pool.fail("t2")
    assert pool.state.runs["r1"].phase is Phase.IDLE


def test_an_abandoned_held_turn_leaves_the_queue():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    pool.arrive("t1", run_id="r1")
    assert pool.abandon("t1") == ()
    assert pool.held() == []
    assert pool.probe("a", healthy=True) == ()


def test_an_abandoned_placed_turn_frees_its_slot():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    pool.arrive("t1", run_id="r1")
    pool.arrive("t2", run_id="r2")
    assert placements(pool.abandon("t1")) == [("t2", "a")]


def test_a_run_with_two_turns_in_flight_stays_generating_until_both_end():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.arrive("t2", run_id="r1")
    pool.complete("t1", tool_calls=True)
    assert pool.state.runs["r1"].phase is Phase.GENERATING
    pool.complete("t2", tool_calls=True)
    assert pool.state.runs["r1"].phase is Phase.PAUSED


def test_reports_for_an_unknown_turn_change_nothing():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    before = pool.state
    assert pool.feed(TurnFailed("ghost", "r1", "boom", pool.now)) == ()
    assert pool.feed(TurnCompleted("ghost", "r1", "tool_calls", 1, 1, ("c",), pool.now)) == ()
    assert pool.state == before


def test_run_ended_forgets_the_run():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    assert pool.end_run("r1") == (RunForgotten("r1", "ended"),)
    assert "r1" not in pool.state.runs
    assert pool.end_run("r1") == ()


# --- expiry ---------------------------------------------------------------------------------


def test_a_placed_turn_never_reported_done_is_dropped_after_the_turn_timeout():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    pool.arrive("t1", run_id="r1")
    pool.arrive("t2", run_id="r2")
    pool.wait(TURN_TIMEOUT_S - 1)
    assert pool.tick() == ()
    pool.wait(1)
    actions = pool.tick()
    assert actions[0] == TurnExpired("t1", "r1", "a")
    assert placements(actions) == [("t2", "a")]
    assert pool.state.runs["r1"].phase is Phase.IDLE


def test_a_quiet_run_is_forgotten_after_the_idle_expiry():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.wait(RUN_IDLE_EXPIRY_S - 1)
    assert pool.tick() == ()
    pool.wait(1)
    assert pool.tick() == (RunForgotten("r1", "idle"),)
    assert "r1" not in pool.state.runs


def test_a_run_whose_turn_is_still_held_is_not_forgotten():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    pool.arrive("t1", run_id="r1")
    pool.wait(RUN_IDLE_EXPIRY_S + 1)
    assert pool.tick() == ()
    assert "r1" in pool.state.runs


def test_the_idle_expiry_counts_from_the_runs_last_activity():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.wait(TURN_TIMEOUT_S - 60)
    pool.complete("t1")
    pool.wait(RUN_IDLE_EXPIRY_S - 1)
    assert pool.tick() == ()
    pool.wait(1)
    assert pool.tick() == (RunForgotten("r1", "idle"),)


# --- resync and retries -----------------------------------------------------------------------


def test_resync_replaces_runs_and_turns_and_keeps_held_turns():
    pool = Pool()
    pool.probe("a", running=1, waiting=1)
    pool.probe("b", healthy=False)
    pool.arrive("old", run_id="forgotten-by-dataplane")  # placed on a
    pool.arrive("held", run_id="rh")  # held: a full, b down
    actions = pool.feed(
        Resynced(
            runs=(ResyncedRun("r1", "b", Phase.PAUSED, ServiceClass.INTERACTIVE, "c", idle_s=5.0),),
            turns=(ResyncedTurn("t9", "r9", "a", ServiceClass.BATCH, "c2", "m"),),
            at=pool.now,
        )
    )
    assert actions == ()
    assert set(pool.state.runs) == {"r1"}
    assert pool.state.runs["r1"].last_activity == pool.now - 5.0
    assert pool.replica_of("t9") == "a"
    assert "old" not in pool.state.turns
    assert pool.held() == ["held"]
    # The resynced paused run keeps its affinity to b once b is back.
    pool.probe("b", healthy=True)
    assert placements(pool.arrive("t10", run_id="r1")) == [("t10", "b")]


def test_resync_naming_a_held_turn_answers_it_with_its_replica():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    pool.arrive("t1", run_id="r1")
    pool.wait(3)
    actions = pool.feed(
        Resynced(
            runs=(), turns=(ResyncedTurn("t1", "r1", "a", ServiceClass.INTERACTIVE, "c", "m"),), at=pool.now
        )
    )
    assert actions == (Place("t1", "r1", "a", "http://a", 3.0),)


def test_a_retried_admission_of_a_placed_turn_gets_the_same_placement():
    pool = Pool()
    pool.arrive("t1", run_id="r1")
    pool.arrive("x", run_id="rx")
    assert placements(pool.arrive("t1", run_id="r1")) == [("t1", "a")]
    assert pool.state.in_flight("a") == 1


def test_a_retried_admission_of_a_held_turn_keeps_waiting():
    pool = Pool(spec("a"))
    pool.probe("a", healthy=False)
    pool.arrive("t1")
    assert pool.arrive("t1") == ()
    assert pool.held() == ["t1"]


# --- the pool ---------------------------------------------------------------------------------


def test_reconfiguring_the_pool_keeps_probe_results_and_refuses_turns_it_can_no_longer_serve():
    pool = Pool(spec("a", "m", "n"))
    pool.probe("a", healthy=False)
    pool.arrive("t1", model="n")
    actions = pool.feed(PoolConfigured((spec("a", "m"),), pool.now))
    assert refusals(actions) == ["no Generative replica serves model 'n'"]
    assert pool.state.replicas["a"].healthy is False


def test_decide_rejects_something_that_is_not_an_event():
    with pytest.raises(TypeError):
        decide(State(), "TurnArrived")  # type: ignore[arg-type]


# --- routers --------------------------------------------------------------------------------


def test_a_router_takes_its_load_from_the_engines_behind_it():
    # The engines are in the pool for their load; only the router serves the model clients ask for.
    pool = Pool(spec("router", "m", load_from=("e1", "e2")), spec("e1", "internal"), spec("e2", "internal"))
    pool.probe("e1", running=2, waiting=0)
    pool.probe("e2", running=1, waiting=0)
    router = pool.state.replicas["router"]
    assert (router.running, router.waiting, router.capacity()) == (3, 0, None)

    pool.probe("e2", running=1, waiting=2)
    router = pool.state.replicas["router"]
    assert (router.running, router.waiting, router.capacity()) == (3, 2, 3)
    assert [r for _, r in placements(pool.arrive("t1") + pool.arrive("t2") + pool.arrive("t3"))] == [
        "router"
    ] * 3
    assert pool.arrive("t4") == ()
    # The engines stop queueing: the held turn goes out at that probe, not the router's.
    assert placements(pool.probe("e2", running=2, waiting=0)) == [("t4", "router")]


def test_a_routers_own_metrics_are_not_its_load():
    pool = Pool(spec("router", "m", load_from=("e1",)), spec("e1", "internal"))
    pool.probe("e1", running=4, waiting=0)
    pool.probe("router", running=0, waiting=9)
    router = pool.state.replicas["router"]
    assert (router.running, router.waiting, router.capacity()) == (4, 0, None)


def test_a_router_whose_engines_were_never_read_is_not_capped():
    pool = Pool(spec("router", "m", load_from=("e1",)), spec("e1", "internal"))
    assert pool.state.replicas["router"].capacity() is None
    assert placements(pool.arrive("t1")) == [("t1", "router")]


def test_an_unhealthy_router_takes_no_turns_even_when_its_engines_are_idle():
    pool = Pool(spec("router", "m", load_from=("e1",)), spec("e1", "internal"))
    pool.probe("router", healthy=False)
    pool.probe("e1", running=0, waiting=0)
    assert pool.arrive("t1") == ()


# --- what else frees room ---------------------------------------------------------------------


def test_a_paused_interactive_run_that_ends_frees_the_slot_batch_left_for_it():
    pool = Pool(spec("a"))
    pool.probe("a", running=1, waiting=1)
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    assert pool.arrive("b1", cls="batch") == ()
    assert placements(pool.end_run("ri")) == [("b1", "a")]


def test_a_runs_held_turns_follow_its_pin_and_keep_their_order():
    pool = Pool(spec("a"), spec("b"))
    pool.probe("a", running=1, waiting=1)
    pool.probe("b", running=1, waiting=1)
    pool.arrive("t1", run_id="r1")  # on a: r1 is pinned there
    pool.arrive("x1", run_id="rx")  # on b
    for i in range(2, 6):
        pool.arrive(f"t{i}", run_id="r1")
    assert pool.held() == ["t2", "t3", "t4", "t5"]
    # b frees up first, but r1 is generating on a: its turns wait for a.
    assert pool.complete("x1") == ()
    assert placements(pool.complete("t1")) == [("t2", "a")]
    assert placements(pool.complete("t2")) == [("t3", "a")]


def test_many_held_turns_of_one_caller_do_not_delay_another_caller():
    pool = Pool(spec("a"))
    pool.probe("a", running=2, waiting=1)
    pool.arrive("f0", caller="flood")
    pool.arrive("f1", caller="flood")
    for i in range(2, 50):
        pool.arrive(f"f{i}", caller="flood")
    pool.arrive("q1", caller="quiet")
    assert placements(pool.complete("f0")) == [("q1", "a")]
    assert placements(pool.complete("f1")) == [("f2", "a")]
