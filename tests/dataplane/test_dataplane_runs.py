"""The dataplane's view of runs and turns in flight, as the resync sends it."""

from luftpause.dataplane.runs import PlacedTurn, RunBook
from luftpause.lifecycle import RUN_IDLE_EXPIRY_S
from luftpause.proto import pb


def _turn(turn_id: str, run_id: str = "run-1", replica: str = "fake-a") -> PlacedTurn:
    return PlacedTurn(turn_id, run_id, replica, pb.BATCH, "caller-x", "fake-llama")


def _completed(turn_id: str, finish_reason: str, ids: list[str] = (), run_id: str = "run-1") -> pb.TurnEvent:
    return pb.TurnEvent(
        turn_id=turn_id,
        run_id=run_id,
        completed=pb.TurnCompleted(finish_reason=finish_reason, tool_call_ids=list(ids)),
    )


def test_a_placed_turn_is_in_flight_and_its_run_generating():
    book = RunBook()
    book.placed(_turn("t1"), now=10.0)
    sync = book.resync_request(now=12.0)
    (run,) = sync.runs
    assert (run.run_id, run.replica, run.phase, run.service_class, run.caller) == (
        "run-1",
        "fake-a",
        pb.GENERATING,
        pb.BATCH,
        "caller-x",
    )
    assert run.idle_s == 2.0
    (turn,) = sync.turns
    assert (turn.turn_id, turn.replica, turn.model, turn.kind) == (
        "t1",
        "fake-a",
        "fake-llama",
        pb.GENERATIVE,
    )


def test_a_reply_with_tool_calls_pauses_the_run_and_frees_the_turn():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.apply(_completed("t1", "tool_calls", ["call_1"]), now=1.0)
    sync = book.resync_request(now=1.0)
    assert [r.phase for r in sync.runs] == [pb.PAUSED]
    assert list(sync.turns) == []


def test_a_plain_reply_leaves_the_run_idle():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.apply(_completed("t1", "stop"), now=1.0)
    assert [r.phase for r in book.resync_request(now=1.0).runs] == [pb.IDLE]


def test_a_failed_turn_leaves_the_run_idle_never_paused():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.apply(_completed("t1", "tool_calls", ["c"]), now=1.0)
    book.placed(_turn("t2"), now=2.0)
    book.apply(pb.TurnEvent(turn_id="t2", run_id="run-1", failed=pb.TurnFailed(error="boom")), now=3.0)
    sync = book.resync_request(now=3.0)
    assert [r.phase for r in sync.runs] == [pb.IDLE]
    assert list(sync.turns) == []


def test_runs_with_no_turn_for_30_minutes_are_dropped_from_the_resync():
    book = RunBook()
    book.placed(_turn("t1", "old"), now=0.0)
    book.apply(_completed("t1", "stop", run_id="old"), now=0.0)
    book.placed(_turn("t2", "fresh"), now=100.0)
    book.apply(_completed("t2", "stop", run_id="fresh"), now=100.0)
    assert [r.run_id for r in book.resync_request(now=30 * 60.0 + 1).runs] == ["fresh"]


def test_the_book_forgets_a_quiet_run_at_the_moment_the_scheduler_does():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.apply(_completed("t1", "stop"), now=0.0)
    assert [r.run_id for r in book.resync_request(now=RUN_IDLE_EXPIRY_S - 1).runs] == ["run-1"]
    # At the expiry itself the core forgets it (tests/scheduler/test_admission.py), so a resync
    # then must not bring it back.
    assert list(book.resync_request(now=RUN_IDLE_EXPIRY_S).runs) == []


def test_a_run_with_a_turn_in_flight_is_kept_however_long_it_takes():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    assert [r.run_id for r in book.resync_request(now=3 * 3600.0).runs] == ["run-1"]


def test_run_ended_forgets_the_run_but_not_its_turn_still_in_flight():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.apply(pb.TurnEvent(run_id="run-1", run_ended=pb.RunEnded()), now=1.0)
    sync = book.resync_request(now=1.0)
    assert list(sync.runs) == []
    assert [t.turn_id for t in sync.turns] == ["t1"]
    book.apply(_completed("t1", "stop"), now=2.0)
    assert list(book.resync_request(now=2.0).turns) == []


def test_a_run_stays_generating_while_another_of_its_turns_runs():
    book = RunBook()
    book.placed(_turn("t1"), now=0.0)
    book.placed(_turn("t2"), now=0.0)
    book.apply(_completed("t1", "stop"), now=1.0)
    sync = book.resync_request(now=1.0)
    assert [r.phase for r in sync.runs] == [pb.GENERATING]
    assert [t.turn_id for t in sync.turns] == ["t2"]


def test_a_run_ended_here_is_named_in_every_resync_for_30_minutes():
    book = RunBook()
    book.placed(_turn("t1"), now=10.0)
    book.apply(_completed("t1", "tool_calls", ["call-1"]), now=11.0)
    book.apply(pb.TurnEvent(run_id="run-1", run_ended=pb.RunEnded()), now=12.0)
    assert list(book.resync_request(now=13.0).ended_runs) == ["run-1"]
    assert list(book.resync_request(now=12.0 + 29 * 60).ended_runs) == ["run-1"]
    assert list(book.resync_request(now=12.0 + 31 * 60).ended_runs) == []


def test_a_new_turn_of_an_ended_run_id_uses_the_id_again():
    book = RunBook()
    book.apply(pb.TurnEvent(run_id="run-1", run_ended=pb.RunEnded()), now=1.0)
    book.placed(_turn("t2"), now=2.0)
    sync = book.resync_request(now=3.0)
    assert [r.run_id for r in sync.runs] == ["run-1"] and list(sync.ended_runs) == []


def test_ended_runs_are_remembered_up_to_a_bound_oldest_going_first():
    from luftpause.lifecycle import EndedRuns

    ended = EndedRuns(keep_s=60.0, most=3)
    for k in range(5):
        assert ended.add(f"run-{k}", now=float(k))
    assert list(ended) == ["run-2", "run-3", "run-4"]
    # Heard of again: not new, and kept from when it was first heard of.
    assert not ended.add("run-2", now=50.0)
    ended.prune(now=62.5)
    assert list(ended) == ["run-3", "run-4"]


def test_a_resync_carries_each_runs_latest_usage_reply_limit_and_tools():
    book = RunBook()
    book.placed(
        PlacedTurn("t1", "run-1", "fake-a", pb.BATCH, "caller-x", "fake-llama", max_tokens=300), now=1.0
    )
    book.apply(
        pb.TurnEvent(
            turn_id="t1",
            run_id="run-1",
            completed=pb.TurnCompleted(
                finish_reason="tool_calls",
                prompt_tokens=2100,
                completion_tokens=12,
                tool_call_ids=["call_1"],
                tool_names=["read_file"],
            ),
        ),
        now=2.0,
    )
    (run,) = book.resync_request(now=3.0).runs
    assert (run.phase, run.prompt_tokens, run.completion_tokens, run.max_tokens) == (pb.PAUSED, 2100, 12, 300)
    assert list(run.tool_names) == ["read_file"]
    # Its next turn, set no reply limit and ended without usage: the last usage stands, the limit
    # is the turn's that reported it, and a reply that called no tool names none.
    book.placed(_turn("t2"), now=4.0)
    book.apply(
        pb.TurnEvent(turn_id="t2", run_id="run-1", completed=pb.TurnCompleted(finish_reason="stop")), now=5.0
    )
    (run,) = book.resync_request(now=6.0).runs
    assert (run.prompt_tokens, run.completion_tokens, run.max_tokens, list(run.tool_names)) == (
        2100,
        12,
        300,
        [],
    )
