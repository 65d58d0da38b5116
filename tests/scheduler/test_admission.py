"""The admission rules, one small case each, against `decide` directly (no process, no network)."""

from __future__ import annotations

import pytest
from scheduler_pool import Pool, placements, refusals, spec

from luftpause.config import LOOKAHEAD
from luftpause.scheduler import admission, fairness
from luftpause.scheduler.actions import Place, Refuse, RunForgotten, TurnExpired
from luftpause.scheduler.admission import KEEP_PAUSED_MAX_S
from luftpause.scheduler.core import RUN_IDLE_EXPIRY_S, TURN_TIMEOUT_S, decide
from luftpause.scheduler.events import (
    FirstToken,
    PoolConfigured,
    ReplicaSpec,
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


def test_unhealthy_replica_gets_no_turns_even_with_room_for_any_number():
    pool = Pool(spec("a", lookahead=0), spec("b", lookahead=0))
    pool.probe("a", healthy=False)
    assert [r for _, r in placements(pool.arrive("t1") + pool.arrive("t2") + pool.arrive("t3"))] == [
        "b",
        "b",
        "b",
    ]


def test_model_served_only_by_unhealthy_replicas_is_held_until_one_recovers():
    pool = Pool(spec("a", lookahead=0))
    pool.probe("a", healthy=False)
    assert pool.arrive("t1") == ()
    assert pool.held() == ["t1"]
    assert placements(pool.probe("a", healthy=True)) == [("t1", "a")]


# --- admission: the lookahead -----------------------------------------------------------------


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_a_replica_takes_lookahead_turns_not_yet_started_and_holds_the_next(lookahead: int):
    pool = Pool(spec("a", lookahead=lookahead))
    for i in range(lookahead):
        assert placements(pool.arrive(f"t{i}")) == [(f"t{i}", "a")]
    assert pool.arrive("next") == ()
    assert pool.held() == ["next"]
    assert pool.state.waiting_ours("a") == lookahead


def test_a_replica_configured_without_a_lookahead_gets_the_configs():
    pool = Pool(ReplicaSpec("a", "http://a", models=("m",)))
    for i in range(LOOKAHEAD):
        assert placements(pool.arrive(f"t{i}")) == [(f"t{i}", "a")]
    assert pool.arrive("next") == ()


def test_interactive_turns_count_only_among_themselves():
    pool = Pool(spec("a", lookahead=2))
    for t in ("b1", "b2", "b3"):
        pool.arrive(t, cls="batch")
    assert pool.held() == ["b3"]
    # Two batch turns may wait in the engine; two interactive ones may wait beside them.
    assert [t for t in ("i1", "i2", "i3") for t, _ in placements(pool.arrive(t))] == ["i1", "i2"]
    assert pool.held() == ["b3", "i3"]
    assert (pool.state.waiting_ours("a"), pool.state.waiting_interactive("a")) == (4, 2)


def test_batch_counts_the_interactive_turns_waiting_too():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1")
    pool.arrive("i2")
    assert pool.arrive("b1", cls="batch") == ()
    assert placements(pool.first_token("i1")) == [("b1", "a")]


def test_a_first_token_makes_room_at_once_without_waiting_for_a_probe():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    assert pool.held() == ["t3"]
    assert placements(pool.first_token("t2")) == [("t3", "a")]
    # The first token says which turn the engine started: t1 may still be waiting there.
    assert pool.unconfirmed("a") == ["t1", "t3"]


def test_turns_the_engine_runs_do_not_count_against_the_lookahead():
    pool = Pool(spec("a", lookahead=2))
    for i in range(10):
        assert placements(pool.arrive(f"t{i}")) == [(f"t{i}", "a")]
        pool.first_token(f"t{i}")
    assert pool.state.in_flight("a") == 10
    assert [r for t in ("x1", "x2", "x3") for _, r in placements(pool.arrive(t))] == ["a", "a"]
    assert pool.held() == ["x3"]


def test_a_first_token_for_a_turn_already_confirmed_or_gone_makes_no_room():
    pool = Pool(spec("a", lookahead=1))
    pool.arrive("t1")
    pool.first_token("t1")
    pool.arrive("t2")
    pool.arrive("t3")
    assert pool.first_token("t1") == ()
    assert pool.feed(FirstToken("ghost", "run-ghost", pool.now)) == ()
    assert pool.held() == ["t3"]


def test_a_probe_confirms_all_but_the_waiting_newest_of_our_turns():
    pool = Pool(spec("a", lookahead=3))
    for t in ("t1", "t2", "t3", "t4", "t5"):
        pool.arrive(t)
    assert pool.held() == ["t4", "t5"]
    # One request waits in the engine: at most one of ours, the newest; the others run.
    assert placements(pool.probe("a", running=4, waiting=1)) == [("t4", "a"), ("t5", "a")]
    assert pool.unconfirmed("a") == ["t3", "t4", "t5"]


def test_after_a_queue_clears_the_replica_fills_one_lookahead_at_a_time_not_in_a_burst():
    pool = Pool(spec("a", lookahead=2))
    for i in range(8):
        pool.arrive(f"t{i}")
    assert pool.unconfirmed("a") == ["t0", "t1"]
    assert placements(pool.probe("a", running=2, waiting=0)) == [("t2", "a"), ("t3", "a")]
    assert pool.held() == ["t4", "t5", "t6", "t7"]
    pool.wait(2)
    assert placements(pool.probe("a", running=4, waiting=0)) == [("t4", "a"), ("t5", "a")]


def test_a_probe_takes_the_turns_sent_last_for_the_ones_still_waiting_not_those_that_arrived_last():
    pool = _with_paused_interactive()  # b1 placed at 0; batch full while ri's room is kept
    pool.arrive("b2", run_id="rb2", cls="batch")  # arrives first, held
    pool.wait(1)
    pool.arrive("x1", run_id="rx")  # arrives later, goes out at 1
    pool.first_token("b1")
    pool.wait(KEEP_PAUSED_MAX_S)
    assert placements(pool.tick()) == [("b2", "a")]  # ri's kept room ended: b2 goes out at 11
    # The engine's queue is first come first served: the one still waiting is b2, sent last.
    pool.probe("a", running=2, waiting=1)
    assert pool.unconfirmed("a") == ["b2"]
    # x1 ran all along: its first token makes no room while b2 waits, so one more batch turn may go.
    assert pool.first_token("x1") == ()
    assert [t for k in (3, 4) for t, _ in placements(pool.arrive(f"b{k}", cls="batch"))] == ["b3"]


def test_a_probe_confirms_only_turns_placed_before_it_was_sent():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("t1")
    pool.wait(1)
    pool.arrive("t2")
    pool.arrive("t3")
    pool.wait(1)
    # Asked at 0.5, answered at 2: t2 went out after the question, so the empty queue says
    # nothing about it.
    assert placements(pool.probe("a", running=1, waiting=0, sent_at=0.5)) == [("t3", "a")]
    assert pool.unconfirmed("a") == ["t2", "t3"]
    # Without sent_at the load was asked for when the answer came.
    pool.arrive("t4")
    assert placements(pool.probe("a", running=3, waiting=0)) == [("t4", "a")]
    assert pool.unconfirmed("a") == ["t4"]


def test_more_requests_waiting_in_the_engine_than_ours_confirms_none_of_ours():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    assert pool.probe("a", running=8, waiting=5) == ()
    assert pool.unconfirmed("a") == ["t1", "t2"]
    assert pool.state.replicas["a"].others_waiting == 3


# --- other clients of the same engine -----------------------------------------------------------


def test_other_clients_requests_queued_in_an_engine_count_against_its_lookahead():
    pool = Pool(spec("a", lookahead=2))
    pool.probe("a", running=4, waiting=1)  # none of ours there: someone else's request waits
    pool.wait(1)
    assert placements(pool.arrive("t1")) == [("t1", "a")]
    assert pool.arrive("t2") == ()
    # t1 went out after that reading and has started: what queued ahead of it has started too.
    assert placements(pool.first_token("t1")) == [("t2", "a")]
    assert pool.state.replicas["a"].others_waiting == 0


def test_others_requests_count_until_a_turn_of_ours_sent_after_the_reading_starts():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("t1")
    pool.probe("a", running=4, waiting=2)  # t1 may be one of the two; the other is not ours
    assert pool.state.replicas["a"].others_waiting == 1
    assert pool.arrive("t2") == ()
    pool.wait(1)
    # t1 started, but it went out before the reading: the other request may still wait.
    assert placements(pool.first_token("t1")) == [("t2", "a")]
    assert pool.state.replicas["a"].others_waiting == 1
    assert pool.arrive("t3") == ()
    # t2 went out after the reading and started: the queue ahead of it is gone.
    assert placements(pool.first_token("t2")) == [("t3", "a")]
    assert pool.state.replicas["a"].others_waiting == 0
    assert placements(pool.arrive("t4")) == [("t4", "a")]


def test_a_replica_whose_queue_another_client_filled_takes_none_of_ours_while_another_does():
    pool = Pool(spec("a", lookahead=2), spec("b", lookahead=2))
    pool.probe("a", running=4, waiting=2)
    assert [r for t in ("t1", "t2", "t3") for _, r in placements(pool.arrive(t))] == ["b", "b"]
    assert pool.held() == ["t3"]
    # The next reading shows that queue gone.
    pool.wait(2)
    assert placements(pool.probe("a", running=6, waiting=0)) == [("t3", "a")]


def test_a_probe_that_could_not_read_the_load_keeps_the_last_reading_and_confirms_nothing():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    pool.probe("a", running=3, waiting=2)
    assert pool.probe("a", healthy=True, running=None, waiting=None) == ()
    assert (pool.state.replicas["a"].running, pool.state.replicas["a"].waiting) == (3, 2)
    assert pool.unconfirmed("a") == ["t1", "t2"]


def test_a_turn_whose_reply_does_not_stream_is_confirmed_when_one_of_ours_finishes_there():
    pool = Pool(spec("a", lookahead=3))
    for t in ("t1", "t2", "t3", "t4"):
        pool.arrive(t)
    pool.start("t1", "t2", "t3", streamed=False)
    assert pool.held() == ["t4"]
    # t1 finished, so the engine had room for the head of its queue: t2, the oldest of ours.
    assert placements(pool.complete("t1")) == [("t4", "a")]
    assert pool.state.turns["t2"].confirmed
    assert pool.unconfirmed("a") == ["t3", "t4"]


def test_the_turn_a_finish_confirms_is_the_first_sent_among_those_placed_at_once():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("f1", caller="x")
    pool.arrive("f2", caller="x")
    pool.arrive("x3", caller="x")  # arrives before y1...
    pool.arrive("y1", caller="y")
    # ...but y1 goes out first: its caller has nothing in flight, x has two.
    assert placements(pool.probe("a", running=2, waiting=0)) == [("y1", "a"), ("x3", "a")]
    pool.start("y1", "x3", streamed=False)
    # The engine takes the head of its queue when f1 ends: y1.
    pool.complete("f1")
    assert pool.unconfirmed("a") == ["x3"]


def test_a_streamed_turn_is_confirmed_by_its_first_token_not_by_another_finishing():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    pool.start("t1", "t2", streamed=True)
    pool.first_token("t1")
    pool.start("t3", streamed=False)
    pool.arrive("t4")
    assert pool.unconfirmed("a") == ["t2", "t3"]
    # t2 heads the engine's queue, and its own first token will say when it starts; the turn
    # behind it is not taken for started either.
    assert pool.complete("t1") == ()
    assert pool.unconfirmed("a") == ["t2", "t3"]
    assert placements(pool.first_token("t2")) == [("t4", "a")]


def test_a_turn_not_yet_reported_sent_is_not_confirmed_by_another_finishing():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("t1")
    pool.arrive("t2")
    pool.start("t1", streamed=False)
    pool.complete("t1")
    assert pool.unconfirmed("a") == ["t2"]


def test_a_turn_that_fails_before_it_was_seen_running_confirms_no_other():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    pool.start("t1", "t2", streamed=False)
    assert placements(pool.fail("t1")) == [("t3", "a")]
    assert pool.unconfirmed("a") == ["t2", "t3"]


def test_a_running_turn_that_fails_frees_engine_room_for_the_next_of_ours():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3", "t4"):
        pool.arrive(t)
    pool.start("t1", streamed=True)
    pool.first_token("t1")
    pool.start("t2", "t3", streamed=False)
    assert pool.held() == ["t4"]
    assert placements(pool.fail("t1")) == [("t4", "a")]
    assert pool.unconfirmed("a") == ["t3", "t4"]


def test_an_engine_reporting_no_load_is_limited_by_its_lookahead_too():
    pool = Pool(spec("ollama", reports_load=False, lookahead=2))
    for t in ("t1", "t2", "t3", "t4"):
        pool.arrive(t)
    assert pool.held() == ["t3", "t4"]
    assert placements(pool.first_token("t1")) == [("t3", "ollama")]
    pool.start("t2", "t3", streamed=False)
    assert placements(pool.complete("t1")) == [("t4", "ollama")]


def test_lookahead_zero_takes_any_number_of_turns_whatever_the_engine_reports():
    pool = Pool(spec("hosted", reports_load=False, lookahead=0), spec("api", "n", lookahead=0))
    assert all(placements(pool.arrive(f"t{i}")) for i in range(20))
    pool.probe("api", running=1, waiting=9)
    assert all(placements(pool.arrive(f"n{i}", model="n")) for i in range(20))
    assert (pool.state.waiting_ours("hosted"), pool.state.waiting_ours("api")) == (0, 0)


# --- strict run affinity ----------------------------------------------------------------------
# These replicas take any number of turns, so where a turn goes is the pin's doing alone.


def _uncapped() -> Pool:
    return Pool(spec("a", lookahead=0), spec("b", lookahead=0))


def test_generating_run_stays_on_its_replica_even_when_another_is_emptier():
    pool = _uncapped()
    pool.arrive("t1", run_id="r1")  # a
    pool.arrive("t2", run_id="r1")  # r1 is generating on a; b has nothing
    assert pool.replica_of("t2") == "a"


def test_paused_run_returns_to_its_replica_even_when_another_is_emptier():
    pool = _uncapped()
    pool.arrive("t1", run_id="r1")  # a
    pool.complete("t1", tool_calls=True)
    assert pool.state.runs["r1"].phase is Phase.PAUSED
    for t in ("x1", "x2", "x3"):
        pool.arrive(t)  # a, b, a
    assert (pool.state.in_flight("a"), pool.state.in_flight("b")) == (2, 1)
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "a")]


def test_paused_run_waits_for_its_full_replica_instead_of_moving():
    pool = Pool(spec("a", lookahead=1), spec("b", lookahead=1))
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.arrive("x1", run_id="other", cls="interactive")  # takes a's one turn of lookahead
    assert pool.replica_of("x1") == "a"
    assert pool.arrive("t2", run_id="r1") == ()  # b is empty, but r1's cache is on a
    assert placements(pool.complete("x1")) == [("t2", "a")]


def test_idle_run_may_move_to_the_least_loaded_replica():
    pool = _uncapped()
    pool.arrive("t1", run_id="r1")  # a
    pool.complete("t1")  # stop: idle
    pool.arrive("x1", run_id="other")  # a (tie)
    assert pool.state.runs["r1"].phase is Phase.IDLE
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "b")]


def test_run_whose_replica_is_unhealthy_may_move():
    pool = _uncapped()
    pool.arrive("t1", run_id="r1")
    pool.complete("t1", tool_calls=True)
    pool.probe("a", healthy=False)
    assert placements(pool.arrive("t2", run_id="r1")) == [("t2", "b")]


def test_fewest_in_flight_wins_and_ties_go_to_config_order():
    pool = Pool(spec("a", lookahead=0), spec("b", lookahead=0), spec("c", lookahead=0))
    got = [r for i in range(6) for _, r in placements(pool.arrive(f"t{i}"))]
    assert got == ["a", "b", "c", "a", "b", "c"]
    pool.complete("t1")  # b now has the fewest
    assert placements(pool.arrive("t9")) == [("t9", "b")]


def test_turns_the_engine_runs_count_as_in_flight_when_choosing():
    pool = Pool(spec("a", lookahead=2), spec("b", lookahead=2))
    for t in ("a1", "a2", "a3"):
        pool.arrive(t, caller="x")  # a, b, a
        pool.first_token(t)
    # a runs two of ours and b one, none of them waiting: b, with fewer in flight, gets the next.
    assert placements(pool.arrive("t1")) == [("t1", "b")]


# --- service classes ------------------------------------------------------------------------


def _with_paused_interactive() -> Pool:
    """Replica a with lookahead 2 and one interactive run paused on a tool there, which keeps one
    turn of lookahead from batch; one batch turn placed and not yet started."""
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    assert placements(pool.arrive("b1", run_id="rb1", cls="batch")) == [("b1", "a")]
    return pool


def test_batch_leaves_a_turn_of_lookahead_for_a_paused_interactive_run():
    pool = _with_paused_interactive()
    assert pool.arrive("b2", run_id="rb2", cls="batch") == ()
    assert pool.held() == ["b2"]


def test_the_paused_interactive_run_takes_the_room_batch_left():
    pool = _with_paused_interactive()
    pool.arrive("b2", run_id="rb2", cls="batch")
    assert placements(pool.arrive("i2", run_id="ri")) == [("i2", "a")]


def test_other_interactive_turns_are_not_kept_out_by_the_reservation():
    pool = _with_paused_interactive()
    assert placements(pool.arrive("i9", run_id="another")) == [("i9", "a")]


@pytest.mark.parametrize(
    ("lookahead", "paused", "batch_placed"),
    [(1, 1, 1), (2, 1, 1), (2, 2, 1), (3, 1, 2), (3, 2, 1), (3, 5, 1), (4, 2, 2)],
)
def test_each_paused_interactive_run_takes_one_turn_of_lookahead_from_batch_never_the_last(
    lookahead: int, paused: int, batch_placed: int
):
    pool = Pool(spec("a", lookahead=lookahead))
    for k in range(paused):
        pool.arrive(f"i{k}", run_id=f"ri{k}")
        pool.complete(f"i{k}", tool_calls=True)
    assert pool.state.paused_interactive("a") == paused
    got = [t for k in range(6) for t, _ in placements(pool.arrive(f"b{k}", run_id=f"rb{k}", cls="batch"))]
    assert got == [f"b{k}" for k in range(batch_placed)]
    # Interactive turns count only among themselves: the whole lookahead is still theirs.
    interactive = [t for k in range(6) for t, _ in placements(pool.arrive(f"x{k}", run_id=f"rx{k}"))]
    assert interactive == [f"x{k}" for k in range(lookahead)]


def test_batch_headroom_does_not_apply_to_a_replica_without_a_lookahead():
    pool = Pool(spec("a", lookahead=0))
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    assert all(placements(pool.arrive(f"b{i}", cls="batch")) for i in range(4))


def test_a_paused_batch_run_reserves_nothing():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("b0", run_id="rb0", cls="batch")
    pool.complete("b0", tool_calls=True)
    assert placements(pool.arrive("b1", run_id="rb1", cls="batch")) == [("b1", "a")]
    assert placements(pool.arrive("b2", run_id="rb2", cls="batch")) == [("b2", "a")]


def test_an_interactive_run_paused_on_another_replica_leaves_batch_here_alone():
    pool = Pool(spec("a", lookahead=2), spec("b", "n", lookahead=2))
    pool.arrive("i1", run_id="ri", model="n")  # b
    pool.complete("i1", tool_calls=True)
    got = [r for k in range(3) for _, r in placements(pool.arrive(f"b{k}", cls="batch"))]
    assert got == ["a", "a"]


# --- how long batch keeps room for a paused run -----------------------------------------------


def test_keep_paused_for_is_twice_the_callers_usual_pause_at_most_ten_seconds():
    assert admission.keep_paused_for(None) == KEEP_PAUSED_MAX_S == 10.0
    assert admission.keep_paused_for(1.5) == 3.0
    assert admission.keep_paused_for(4.0) == 8.0
    assert admission.keep_paused_for(30.0) == 10.0
    assert admission.learn_pause(None, 3.0) == 3.0
    assert admission.learn_pause(1.0, 3.0) == pytest.approx(1.4)
    assert admission.learn_pause(None, -1.0) == 0.0


def test_the_room_kept_for_a_paused_run_ends_when_its_tool_takes_longer_than_expected():
    pool = _with_paused_interactive()  # paused at 0, its caller's first pause: kept for 10 s
    assert pool.state.runs["ri"].kept_until == KEEP_PAUSED_MAX_S
    pool.arrive("b2", run_id="rb2", cls="batch")
    pool.wait(KEEP_PAUSED_MAX_S - 0.5)
    assert pool.tick() == ()
    pool.wait(0.5)
    assert placements(pool.tick()) == [("b2", "a")]
    # The run is still paused there and still comes back there; batch just stopped waiting for it.
    run = pool.state.runs["ri"]
    assert (run.phase, run.replica, run.kept_until) == (Phase.PAUSED, "a", None)
    assert pool.state.paused_interactive("a") == 0


def test_any_event_after_the_kept_room_ended_lets_batch_in():
    pool = _with_paused_interactive()
    pool.wait(KEEP_PAUSED_MAX_S)
    assert placements(pool.arrive("b2", run_id="rb2", cls="batch")) == [("b2", "a")]


def test_a_turns_request_going_out_after_the_kept_room_ended_lets_batch_in():
    pool = _with_paused_interactive()
    pool.arrive("b2", run_id="rb2", cls="batch")
    pool.wait(KEEP_PAUSED_MAX_S)
    assert placements(pool.start("b1", streamed=True)) == [("b2", "a")]


def test_the_pause_learned_from_a_callers_runs_sets_how_long_room_is_kept():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1", run_id="r1", caller="quick")
    pool.complete("i1", tool_calls=True)
    pool.wait(1.0)
    pool.arrive("i2", run_id="r1", caller="quick")  # back after 1 s
    assert pool.state.pause_estimate["quick"] == 1.0
    pool.complete("i2", tool_calls=True)
    assert pool.state.runs["r1"].kept_until == 1.0 + 2.0
    pool.arrive("b1", run_id="rb1", cls="batch")
    pool.arrive("b2", run_id="rb2", cls="batch")
    assert pool.held() == ["b2"]
    pool.wait(1.5)
    assert pool.tick() == ()
    pool.wait(0.5)
    assert placements(pool.tick()) == [("b2", "a")]

    # The next pause, 3 s, moves the average to 1.4 s: room is kept for 2.8 s after it.
    pool.wait(1.0)  # 3 s after the pause at 1
    pool.arrive("i3", run_id="r1", caller="quick")
    assert pool.state.pause_estimate["quick"] == pytest.approx(1.4)
    pool.first_token("b1", "b2", "i3")
    pool.complete("i3", tool_calls=True)
    assert pool.state.runs["r1"].kept_until == pytest.approx(pool.now + 2.8)


def test_a_callers_pauses_do_not_set_another_callers_kept_room():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1", run_id="r1", caller="quick")
    pool.complete("i1", tool_calls=True)
    pool.wait(0.5)
    pool.arrive("i2", run_id="r1", caller="quick")
    pool.arrive("s1", run_id="r2", caller="slow")
    pool.complete("s1", tool_calls=True)
    assert pool.state.runs["r2"].kept_until == pool.now + KEEP_PAUSED_MAX_S


def test_a_run_paused_on_a_slow_tool_keeps_room_at_most_ten_seconds():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1", run_id="r1")
    pool.complete("i1", tool_calls=True)
    pool.wait(60.0)
    pool.arrive("i2", run_id="r1")
    pool.complete("i2", tool_calls=True)
    assert pool.state.runs["r1"].kept_until == pool.now + KEEP_PAUSED_MAX_S


# --- draining held turns ----------------------------------------------------------------------
# With lookahead 1, one interactive turn placed and not yet started fills a replica for both classes.


def _full(pool: Pool, *turns: str, caller: str = "filler") -> None:
    for t in turns:
        pool.arrive(t, caller=caller)


def test_interactive_drains_before_batch_that_arrived_earlier():
    pool = Pool(spec("a", lookahead=1))
    _full(pool, "f1")
    pool.arrive("b1", cls="batch", caller="x")
    pool.wait(1)
    pool.arrive("i1", cls="interactive", caller="x")
    assert placements(pool.complete("f1")) == [("i1", "a")]


def test_caller_with_fewest_turns_in_flight_drains_first():
    pool = Pool(spec("a", lookahead=1))
    for t in ("greedy1", "greedy2"):
        pool.arrive(t, caller="greedy")
        pool.first_token(t)  # running: in flight, not waiting
    pool.arrive("f1", caller="filler")
    pool.arrive("greedy3", caller="greedy")  # held, arrived first
    pool.arrive("quiet1", caller="quiet")  # held
    assert pool.held() == ["greedy3", "quiet1"]
    assert placements(pool.complete("f1")) == [("quiet1", "a")]  # quiet has none in flight, greedy two


def _served(pool: Pool, turn_id: str, caller: str, request_bytes: int) -> None:
    """A turn of `caller` asking for about request_bytes / 4 tokens, placed and completed."""
    assert placements(pool.arrive(turn_id, caller=caller, request_bytes=request_bytes, max_tokens=1)) != []
    pool.complete(turn_id, prompt_tokens=request_bytes // 4, completion_tokens=1)


def test_a_caller_that_asked_the_engines_for_more_waits_behind_one_that_asked_for_less():
    pool = Pool(spec("a", lookahead=1))
    _served(pool, "big", "long-contexts", 400_000)
    _served(pool, "small", "short-contexts", 4_000)
    # Neither has a turn in flight now; the filler takes the lookahead.
    pool.arrive("f1", caller="filler", request_bytes=4, max_tokens=1)
    pool.arrive("long2", caller="long-contexts")
    pool.wait(0.1)
    pool.arrive("short2", caller="short-contexts")
    assert placements(pool.complete("f1")) == [("short2", "a")]


def test_what_a_caller_asked_for_long_ago_weighs_less_than_what_another_asks_for_now():
    pool = Pool(spec("a", lookahead=1))
    _served(pool, "big", "earlier", 400_000)
    pool.wait(10 * fairness.HALF_LIFE_S)  # 100,000 tokens then count as about a hundred now
    _served(pool, "small", "now", 4_000)  # a thousand
    pool.arrive("f1", caller="filler", request_bytes=4, max_tokens=1)
    pool.arrive("now2", caller="now")
    pool.wait(0.1)
    pool.arrive("earlier2", caller="earlier")
    assert placements(pool.complete("f1")) == [("earlier2", "a")]


def test_equal_callers_drain_in_arrival_order():
    pool = Pool(spec("a", lookahead=1))
    _full(pool, "f1")
    for t in ("x1", "x2", "x3"):
        pool.wait(0.1)
        pool.arrive(t, caller="same")
    assert placements(pool.complete("f1")) == [("x1", "a")]


def test_drain_reorders_after_each_placement():
    pool = Pool(spec("a", lookahead=2))
    _full(pool, "f1", "f2")
    pool.arrive("p1", caller="p")
    pool.arrive("p2", caller="p")
    pool.arrive("q1", caller="q")
    # Room for two at once: p's first turn goes, then q (0 in flight) before p's second.
    assert placements(pool.probe("a", running=2, waiting=0)) == [("p1", "a"), ("q1", "a")]


def test_a_held_turn_pinned_to_a_full_replica_does_not_block_the_others():
    pool = Pool(spec("a", lookahead=1), spec("b", lookahead=1))
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


def test_a_failed_turn_frees_its_room_at_once_and_leaves_the_run_idle():
    pool = Pool(spec("a", lookahead=1))
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


def test_an_abandoned_placed_turn_frees_its_room():
    pool = Pool(spec("a", lookahead=1))
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
    pool = Pool(spec("a", lookahead=1))
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
    pool = Pool(spec("a", lookahead=1), spec("b", lookahead=2))
    pool.probe("b", healthy=False)
    pool.arrive("old", run_id="forgotten-by-dataplane")  # placed on a, which it fills
    pool.arrive("held", run_id="rh")  # held: a full, b down
    actions = pool.feed(
        Resynced(
            runs=(ResyncedRun("r1", "b", Phase.PAUSED, ServiceClass.INTERACTIVE, "c", idle_s=5.0),),
            turns=(ResyncedTurn("t9", "r9", "a", ServiceClass.INTERACTIVE, "c2", "m"),),
            at=pool.now,
        )
    )
    assert actions == ()
    assert set(pool.state.runs) == {"r1"}
    assert pool.state.runs["r1"].last_activity == pool.now - 5.0
    assert pool.replica_of("t9") == "a"
    assert "old" not in pool.state.turns
    assert pool.held() == ["held"]
    # A turn the dataplane has in flight counts as not yet started until something shows otherwise.
    assert pool.unconfirmed("a") == ["t9"]
    # The resynced paused run keeps its affinity to b once b is back.
    assert placements(pool.probe("b", healthy=True)) == [("held", "b")]
    assert placements(pool.arrive("t10", run_id="r1")) == [("t10", "b")]


def test_a_resync_from_one_dataplane_leaves_what_another_sent():
    # Two dataplanes (say two workers behind one port) share the scheduler; one restarts and
    # resyncs an empty view: only its own placed turns and the runs last seen through it go.
    pool = Pool(spec("a", lookahead=4))
    pool.arrive("w1-t", run_id="r1", dataplane="w1")
    pool.arrive("w2-t", run_id="r2", dataplane="w2")
    pool.complete("w2-t", tool_calls=True)
    pool.arrive("w2-t2", run_id="r3", dataplane="w2")
    pool.wait(1)
    pool.feed(Resynced(runs=(), turns=(), at=pool.now, dataplane="w2"))
    assert set(pool.state.runs) == {"r1"}
    assert [t.turn_id for t in pool.state.placed()] == ["w1-t"]
    assert pool.state.in_flight("a") == 1
    # A run it names but whose latest turn came through the other one more recently keeps the
    # other's view; one it names that the other saw earlier takes this one's.
    pool.wait(1)
    pool.feed(
        Resynced(
            runs=(
                ResyncedRun("r1", "a", Phase.IDLE, ServiceClass.INTERACTIVE, "c", idle_s=30.0),
                ResyncedRun("r2", "a", Phase.PAUSED, ServiceClass.INTERACTIVE, "c", idle_s=1.0),
            ),
            turns=(ResyncedTurn("w2-t9", "r2", "a", ServiceClass.INTERACTIVE, "c", "m"),),
            at=pool.now,
            dataplane="w2",
        )
    )
    assert pool.state.runs["r1"].phase is Phase.GENERATING
    assert pool.state.runs["r2"].phase is Phase.PAUSED
    assert sorted(t.turn_id for t in pool.state.placed()) == ["w1-t", "w2-t9"]
    # w1's turn still ends normally, and its run goes idle.
    pool.complete("w1-t")
    assert pool.state.runs["r1"].phase is Phase.IDLE


def test_a_resynced_paused_interactive_run_keeps_room_from_batch():
    pool = Pool(spec("a", lookahead=2))
    pool.feed(
        Resynced(
            runs=(ResyncedRun("r1", "a", Phase.PAUSED, ServiceClass.INTERACTIVE, "c", idle_s=1.0),),
            turns=(),
            at=pool.now,
        )
    )
    assert pool.state.paused_interactive("a") == 1
    assert [t for k in range(3) for t, _ in placements(pool.arrive(f"b{k}", cls="batch"))] == ["b0"]


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


def test_reconfiguring_a_replicas_lookahead_applies_to_the_turns_already_there():
    pool = Pool(spec("a", lookahead=1))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    assert pool.held() == ["t2", "t3"]
    assert placements(pool.feed(PoolConfigured((spec("a", lookahead=2),), pool.now))) == [("t2", "a")]
    assert placements(pool.feed(PoolConfigured((spec("a", lookahead=0),), pool.now))) == [("t3", "a")]
    assert pool.state.waiting_ours("a") == 0


def test_decide_rejects_something_that_is_not_an_event():
    with pytest.raises(TypeError):
        decide(State(), "TurnArrived")  # type: ignore[arg-type]


# --- routers --------------------------------------------------------------------------------


def test_a_routers_load_is_its_engines_and_their_probes_confirm_its_turns():
    # The engines are in the pool for their load; only the router serves the model clients ask for.
    pool = Pool(
        spec("router", "m", load_from=("e1", "e2"), lookahead=2),
        spec("e1", "internal"),
        spec("e2", "internal"),
    )
    pool.probe("e1", running=2, waiting=0)
    pool.probe("e2", running=1, waiting=0)
    pool.wait(1)
    assert [r for _, r in placements(pool.arrive("t1") + pool.arrive("t2") + pool.arrive("t3"))] == [
        "router"
    ] * 2
    pool.wait(1)
    # e2 queues two: they may be ours.
    assert pool.probe("e2", running=1, waiting=2) == ()
    router = pool.state.replicas["router"]
    assert (router.running, router.waiting) == (3, 2)
    assert pool.probe("e1", running=3, waiting=0) == ()
    # Now neither engine queues: both of ours run, and the held turn goes out at that probe.
    assert placements(pool.probe("e2", running=2, waiting=0)) == [("t3", "router")]
    assert pool.unconfirmed("router") == ["t3"]


def test_a_routers_own_metrics_are_not_its_load():
    pool = Pool(spec("router", "m", load_from=("e1",), lookahead=2), spec("e1", "internal"))
    pool.probe("e1", running=4, waiting=0)
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    # The router's own reading neither confirms our turns nor adds others' requests.
    assert pool.probe("router", running=0, waiting=0) == ()
    assert pool.probe("router", running=0, waiting=9) == ()
    router = pool.state.replicas["router"]
    assert (router.running, router.waiting, router.others_waiting) == (4, 0, 0)
    assert pool.unconfirmed("router") == ["t1", "t2"]


def test_a_router_whose_engines_were_never_read_is_limited_by_its_lookahead():
    pool = Pool(spec("router", "m", load_from=("e1",), lookahead=2), spec("e1", "internal"))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    assert pool.held() == ["t3"]
    assert pool.state.replicas["router"].waiting is None
    assert placements(pool.first_token("t1")) == [("t3", "router")]


def test_an_unhealthy_router_takes_no_turns_even_when_its_engines_are_idle():
    pool = Pool(spec("router", "m", load_from=("e1",)), spec("e1", "internal"))
    pool.probe("router", healthy=False)
    pool.probe("e1", running=0, waiting=0)
    assert pool.arrive("t1") == ()


# --- what else frees room ---------------------------------------------------------------------


def test_a_paused_interactive_run_that_ends_frees_the_room_batch_left_for_it():
    pool = _with_paused_interactive()
    assert pool.arrive("b2", cls="batch") == ()
    assert placements(pool.end_run("ri")) == [("b2", "a")]


def test_a_paused_interactive_run_forgotten_as_idle_frees_the_room_batch_left_for_it():
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)
    pool.wait(RUN_IDLE_EXPIRY_S)
    actions = pool.tick()
    assert RunForgotten("ri", "idle") in actions
    assert [t for k in range(3) for t, _ in placements(pool.arrive(f"b{k}", cls="batch"))] == ["b0", "b1"]


def test_a_paused_runs_turn_for_a_model_its_replica_does_not_serve_gives_up_the_room_kept_there():
    pool = Pool(spec("a", "m", lookahead=2), spec("other", "r", lookahead=2))
    pool.arrive("i1", run_id="ri")
    pool.complete("i1", tool_calls=True)  # ri will be back on a: a keeps room for it
    pool.arrive("b1", run_id="rb1", cls="batch")
    assert pool.arrive("b2", run_id="rb2", cls="batch") == ()
    # ri's next turn asks for a model only `other` serves: a need keep nothing for it any more,
    # and the held batch turn goes in the same decision.
    assert placements(pool.arrive("i2", run_id="ri", model="r")) == [("i2", "other"), ("b2", "a")]


def test_a_runs_held_turns_follow_its_pin_and_keep_their_order():
    pool = Pool(spec("a", lookahead=1), spec("b", lookahead=1))
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
    pool = Pool(spec("a", lookahead=2))
    pool.arrive("f0", caller="flood")
    pool.arrive("f1", caller="flood")
    for i in range(2, 50):
        pool.arrive(f"f{i}", caller="flood")
    pool.arrive("q1", caller="quiet")
    assert placements(pool.complete("f0")) == [("q1", "a")]
    assert placements(pool.complete("f1")) == [("f2", "a")]


def test_a_slot_engine_with_a_free_slot_is_running_our_turn_and_it_waits_only_beyond_its_slots():
    # llama.cpp starts a request the moment a slot is free: four turns on four slots are running,
    # however long their prefills take before a first token; only turns beyond them wait there.
    # (Its host cache on, the run gate holds no runs: this is the lookahead alone.)
    pool = Pool(spec("a", lookahead=2, kv_slots=4, host_cache=True))
    for i in range(6):
        assert placements(pool.arrive(f"t{i}", run_id=f"r{i}")) == [(f"t{i}", "a")]
    assert pool.unconfirmed("a") == ["t4", "t5"]
    assert pool.arrive("t6", run_id="r6") == ()
    # A turn ending frees its slot: the oldest waiting starts, streamed or not.
    pool.start("t4", "t5", streamed=True)
    assert placements(pool.complete("t0")) == [("t6", "a")]
    assert pool.unconfirmed("a") == ["t5", "t6"]


def test_a_slot_engine_whose_queue_holds_others_requests_confirms_none_at_placement():
    pool = Pool(spec("a", lookahead=2, kv_slots=4, host_cache=True))
    # Another client's request waits there: its slots are all taken, and ours waits behind it.
    pool.probe("a", running=4, waiting=1)
    assert placements(pool.arrive("t0")) == [("t0", "a")]
    assert pool.unconfirmed("a") == ["t0"]
