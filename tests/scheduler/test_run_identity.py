"""The scheduler puts a turn sent without a run header in its run, by the tool_call_ids it echoes,
whichever dataplane sharing the scheduler carried the run's earlier turns."""

from __future__ import annotations

from luftpause import config as lp_config
from luftpause.proto import pb
from luftpause.scheduler import events as ev
from luftpause.scheduler.core import RUN_IDLE_EXPIRY_S
from luftpause.scheduler.host import Link, SchedulerHost
from luftpause.scheduler.state import Kind, ServiceClass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def host() -> tuple[SchedulerHost, Clock]:
    clock = Clock()
    config = lp_config.Config(replicas=[lp_config.Replica(name="a", url="http://127.0.0.1:9", models=["m"])])
    return SchedulerHost(config, clock), clock


def admit(host: SchedulerHost, link: Link, turn_id: str, run_id: str, echoed: tuple[str, ...] = ()) -> str:
    """Admits a turn on `link` and returns the run its placement says it is in."""
    arrived = ev.TurnArrived(
        turn_id, run_id, ServiceClass.INTERACTIVE, "c", "m", Kind.GENERATIVE, host.clock(), link.dataplane
    )
    host.admit(arrived, link, echoed)
    batch = link.take()
    assert batch is not None
    (placement,) = [p for p in batch.placements if p.turn_id == turn_id]
    assert placement.reply.outcome == pb.AdmitReply.PLACED
    return placement.reply.run_id


def complete(host: SchedulerHost, turn_id: str, run_id: str, tool_call_ids: tuple[str, ...]) -> None:
    reason = "tool_calls" if tool_call_ids else "stop"
    host.report(ev.TurnCompleted(turn_id, run_id, reason, 10, 5, tool_call_ids, host.clock()))


def test_a_turn_echoing_a_runs_tool_calls_joins_that_run_through_another_dataplane():
    scheduler, _ = host()
    first, second = Link("w1"), Link("w2")
    assert admit(scheduler, first, "t1", "run-a") == "run-a"
    complete(scheduler, "t1", "run-a", ("call_1", "call_2"))
    # The next turn reaches the other worker, with no header: its fallback id is not used.
    assert admit(scheduler, second, "t2", "fallback", echoed=("call_2", "call_1")) == "run-a"
    assert scheduler.state.turns["t2"].run_id == "run-a"
    # Ids nobody made leave the turn in a run of its own, under the dataplane's id.
    assert admit(scheduler, second, "t3", "new-run", echoed=("call_zzz",)) == "new-run"


def test_the_newest_known_id_decides_and_only_a_runs_latest_reply_counts():
    scheduler, _ = host()
    link = Link()
    admit(scheduler, link, "a1", "run-a")
    complete(scheduler, "a1", "run-a", ("a_old",))
    admit(scheduler, link, "b1", "run-b")
    complete(scheduler, "b1", "run-b", ("b_1",))
    assert admit(scheduler, link, "x", "fresh", echoed=("unknown", "b_1", "a_old")) == "run-b"
    complete(scheduler, "x", "run-b", ())
    assert admit(scheduler, link, "a2", "run-a", echoed=()) == "run-a"
    complete(scheduler, "a2", "run-a", ("a_new",))
    # run-a's earlier reply is behind it: its ids no longer name it.
    assert admit(scheduler, link, "y", "fresh-y", echoed=("a_old",)) == "fresh-y"
    assert admit(scheduler, link, "z", "fresh-z", echoed=("a_new",)) == "run-a"


def test_a_run_ended_or_gone_idle_lets_go_of_its_ids():
    scheduler, clock = host()
    link = Link()
    admit(scheduler, link, "t1", "run-a")
    complete(scheduler, "t1", "run-a", ("call_a",))
    admit(scheduler, link, "t2", "run-b")
    complete(scheduler, "t2", "run-b", ("call_b",))
    scheduler.report(ev.RunEnded("run-a", clock()))
    assert admit(scheduler, link, "t3", "other", echoed=("call_a",)) == "other"
    complete(scheduler, "t3", "other", ())
    clock.now += RUN_IDLE_EXPIRY_S + 1
    scheduler.tick()
    assert "run-b" not in scheduler.state.runs
    assert admit(scheduler, link, "t4", "later", echoed=("call_b",)) == "later"
    assert len(scheduler.identity) == 0


def test_a_resync_brings_the_ids_back_to_a_restarted_scheduler_and_scopes_them():
    scheduler, _ = host()
    w1 = pb.ResyncRequest(
        runs=[pb.RunState(run_id="run-a", replica="a", phase=pb.PAUSED, caller="c", tool_call_ids=["call_a"])]
    )
    w2 = pb.ResyncRequest(
        runs=[pb.RunState(run_id="run-b", replica="a", phase=pb.PAUSED, caller="c", tool_call_ids=["call_b"])]
    )
    scheduler.resync(w1, "w1")
    scheduler.resync(w2, "w2")
    # The run w1 resynced is found from w2 as well.
    assert admit(scheduler, Link("w2"), "t1", "x1", echoed=("call_a",)) == "run-a"
    complete(scheduler, "t1", "run-a", ())
    assert admit(scheduler, Link("w1"), "t2", "run-a") == "run-a"
    complete(scheduler, "t2", "run-a", ("call_a2",))
    # w2 restarts with nothing to say: the runs last seen through it go, and their ids; w1's stay.
    scheduler.resync(pb.ResyncRequest(), "w2")
    assert set(scheduler.state.runs) == {"run-a"}
    assert admit(scheduler, Link("w1"), "t3", "x3", echoed=("call_b",)) == "x3"
    assert admit(scheduler, Link("w2"), "t4", "x4", echoed=("call_a2",)) == "run-a"
