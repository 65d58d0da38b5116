"""The engine drill (bench/faults_engines.py) on a small scale, real processes: a replica that
streams garbage beside a good one for a few seconds, and an engine whose usage is out of range.
What the record must say: the bad replica ejected after its five failed turns, every turn after
that served whole; no turn left in flight at the scheduler for more than 5 s after its reply,
whatever the usage said; and the markdown table showing both.
"""

from __future__ import annotations

from luftpause.bench import faults_engines


def test_a_garbage_replica_is_ejected_and_the_turns_after_it_succeed():
    record = faults_engines.broken_replica("garbage", seconds=3.0, clients=2)
    assert record["time_to_eject_s"] is not None and record["time_to_eject_s"] < 3.0
    assert record["failed_before_ejection"] == 5 and record["ejections"] == 1
    assert record["turns_after_ejection"] > 10 and record["success_after_ejection"] == 1.0
    failures = {k: v for k, v in record["outcomes"].items() if k != "ok"}
    assert failures == {"502 from bad": 5}, record["outcomes"]

    usage = faults_engines.usage_overflow(turns=1)
    assert [c["case"] for c in usage["cases"]] == list(faults_engines.USAGE_CASES)
    assert usage["no_turn_stuck_past_5s"] and all(c["stuck_s_max"] < 5.0 for c in usage["cases"])
    assert all(c["statuses"] == [200] for c in usage["cases"])

    text = faults_engines.table({"seconds": 3.0, "clients": 2, "broken_replica": [record], "usage": usage,
                                 "acceptance_met": True})  # fmt: skip
    assert f"| garbage (`garbage`) | {record['turns']} | {record['succeeded']} |" in text
    assert "| `" + faults_engines.USAGE_CASES["1e30"] + "` | 200 |" in text
    assert "Acceptance (≥ 95 % after ejection, no turn stuck past 5 s): met." in text
