"""The run journal: what a restart can rebuild from runs.jsonl, torn lines included; the replays
that do not depend on the file run against the PostgreSQL store too (tests/runtime/conftest.py)."""

import json
import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luftpause.runtime.journal import Journal, read_records


def _counters(tool_calls: int, failed: int = 0, turns: int = 0) -> dict[str, int]:
    return {
        "toolCalls": tool_calls,
        "failedToolCalls": failed,
        "turns": turns,
        "promptTokens": 10 * turns,
        "completionTokens": turns,
    }


def test_records_are_json_lines_in_the_documented_shape(tmp_path):
    journal = Journal(tmp_path / "state")
    journal.spawned("run-1", {"task": "t", "model": "m"}, "caller-1")
    journal.round("run-1", [{"role": "assistant", "content": None}], _counters(1, turns=1))
    journal.finished("run-1", "finished", "answer", None, _counters(1, turns=2))
    journal.close()

    lines = (tmp_path / "state" / "runs.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["type"] for r in records] == ["spawned", "round", "finished"]
    assert all(r["v"] == 1 and r["run"] == "run-1" and isinstance(r["at"], float) for r in records)
    assert records[0]["spec"] == {"task": "t", "model": "m"} and records[0]["caller"] == "caller-1"
    assert records[1]["messages"] == [{"role": "assistant", "content": None}] and records[1]["toolCalls"] == 1
    assert (records[2]["status"], records[2]["result"], records[2]["error"]) == ("finished", "answer", None)


def test_replay_folds_rounds_and_the_end_of_each_run(stores):
    journal = stores.open()
    journal.spawned("a", {"task": "ta"}, None)
    journal.spawned("b", {"task": "tb"}, "c")
    journal.round("a", [{"role": "assistant", "n": 1}, {"role": "tool", "n": 2}], _counters(1, 1, 1))
    journal.round("b", [{"role": "assistant", "n": 3}], _counters(1, 0, 1))
    journal.round("a", [{"role": "assistant", "n": 4}], _counters(2, 1, 2))
    journal.finished("b", "failed", None, "boom", _counters(1, 0, 2))

    runs = {r.handle: r for r in journal.replay()}
    journal.close()
    assert list(runs) == ["a", "b"]
    a, b = runs["a"], runs["b"]
    assert a.finished is None
    assert a.rounds == [
        [{"role": "assistant", "n": 1}, {"role": "tool", "n": 2}],
        [{"role": "assistant", "n": 4}],
    ]
    assert a.counters["toolCalls"] == 2 and a.counters["failedToolCalls"] == 1 and a.counters["turns"] == 2
    assert b.finished is not None and b.finished["status"] == "failed" and b.finished["error"] == "boom"
    assert b.counters["turns"] == 2 and b.caller == "c"


def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_record_is_whole(tmp_path, caplog):
    journal = Journal(tmp_path)
    journal.spawned("a", {"task": "ta"}, None)
    journal.finished("a", "finished", "done", None, _counters(0, turns=1))
    journal.close()
    with (tmp_path / "runs.jsonl").open("a") as f:
        f.write('{"v":1,"type":"spawned","run":"b","spec":{"ta')  # the crash cut it here

    with caplog.at_level(logging.WARNING):
        reopened = Journal(tmp_path)
        reopened.spawned("c", {"task": "tc"}, None)
        runs = {r.handle: r for r in reopened.replay()}

    assert sorted(runs) == ["a", "c"]
    assert runs["a"].finished["result"] == "done"
    assert any("line 3" in m and "skipped" in m for m in caplog.messages)
    # The record written after the torn one starts on its own line and reads back whole.
    assert read_records(tmp_path / "runs.jsonl")[-1]["run"] == "c"


def test_records_for_unknown_runs_and_unknown_types_are_ignored(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(
        '{"v":1,"type":"round","run":"ghost","messages":[]}\n'
        '{"v":1,"type":"spawned","run":"a","spec":{"task":"t"}}\n'
        '{"v":2,"type":"something-later","run":"a"}\n'
        "[1, 2]\n"
    )
    runs = Journal(tmp_path).replay()
    assert [r.handle for r in runs] == ["a"] and runs[0].rounds == [] and runs[0].finished is None


def test_a_record_with_fields_of_the_wrong_type_costs_only_its_own_run(tmp_path, caplog):
    path = tmp_path / "runs.jsonl"
    path.write_text(
        '{"v":1,"type":"spawned","run":"good","at":1.5,"spec":{"task":"t"}}\n'
        '{"v":1,"type":"spawned","run":"bad","at":"yesterday","spec":{"task":"t"}}\n'
        '{"v":1,"type":"spawned","run":"worse","at":2,"spec":"not an object"}\n'
        '{"v":1,"type":"round","run":"good","messages":"not a list","toolCalls":1}\n'
        '{"v":1,"type":"finished","run":"good","status":"finished","result":"ok","toolCalls":"many"}\n'
    )
    with caplog.at_level(logging.WARNING):
        runs = Journal(tmp_path).replay()
    assert [r.handle for r in runs] == ["good"]
    assert runs[0].rounds == [] and runs[0].finished["result"] == "ok"
    assert runs[0].counters["toolCalls"] == 0, "a counter of the wrong type is not read"
    assert sum("malformed" in m and "skipped" in m for m in caplog.messages) == 3


def test_a_second_spawned_record_does_not_bring_a_finished_run_back(stores, caplog):
    journal = stores.open()
    journal.spawned("a", {"task": "ta"}, None)
    journal.finished("a", "finished", "done", None, _counters(0, turns=1))
    journal.spawned("a", {"task": "ta"}, None)
    journal.close()
    with caplog.at_level(logging.WARNING):
        reopened = stores.open()
        (run,) = reopened.replay()
        reopened.close()
    assert run.finished is not None and run.finished["result"] == "done"
    assert any("spawned a second time" in m for m in caplog.messages)


# Any JSON value, for the fields of a damaged record.
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_damaged = st.fixed_dictionaries(
    {"type": st.sampled_from(["spawned", "round", "turn", "call", "approval", "finished", "other"]),
     "run": st.sampled_from(["a", "b", "zzz"]) | _json},
    optional={k: _json for k in ("v", "at", "spec", "caller", "owner", "messages", "message", "call",
                                 "allow", "status", "result", "error", "toolCalls", "turns")},
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damaged=_damaged, where=st.integers(min_value=0, max_value=5))
def test_replay_survives_any_single_damaged_record(tmp_path, damaged, where):
    good = [
        {"v": 1, "type": "spawned", "run": "a", "at": 1.0, "spec": {"task": "ta"}, "caller": None},
        {"v": 1, "type": "spawned", "run": "b", "at": 2.0, "spec": {"task": "tb"}, "caller": "c"},
        {"v": 1, "type": "round", "run": "a", "at": 3.0, "messages": [{"role": "assistant"}], "toolCalls": 1},
        {
            "v": 1,
            "type": "finished",
            "run": "b",
            "at": 4.0,
            "status": "finished",
            "result": "r",
            "toolCalls": 0,
        },
    ]
    lines = [json.dumps(r) for r in good]
    lines.insert(min(where, len(lines)), json.dumps(damaged))
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    runs = {r.handle: r for r in Journal(tmp_path).replay()}  # never raises
    # A record about another run, or one that is not a run's at all, leaves a run as it was.
    if damaged.get("run") != "a":
        assert runs["a"].spec == {"task": "ta"} and runs["a"].rounds == [[{"role": "assistant"}]]
    if damaged.get("run") != "b" or (damaged["type"] == "spawned" and where > 1):
        assert runs["b"].finished["result"] == "r"


def test_a_run_spawned_with_tracing_on_keeps_its_trace_context_across_a_replay(stores):
    """What a run resumed after a restart is traced under (runtime/spans.py): the context
    journaled with its spawned record; a run spawned with tracing off has none."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    journal = stores.open()
    journal.spawned("traced", {"task": "t"}, None, traceparent=traceparent)
    journal.spawned("untraced", {"task": "t"}, None)
    journal.close()
    reopened = stores.open()
    runs = {r.handle: r for r in reopened.replay()}
    reopened.close()
    assert runs["traced"].traceparent == traceparent
    assert runs["untraced"].traceparent is None
    assert "traceparent" not in stores.records()[1]
