"""The run journal: what a restart can rebuild from runs.jsonl, torn lines included."""

import json
import logging

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


def test_replay_folds_rounds_and_the_end_of_each_run(tmp_path):
    journal = Journal(tmp_path)
    journal.spawned("a", {"task": "ta"}, None)
    journal.spawned("b", {"task": "tb"}, "c")
    journal.round("a", [{"role": "assistant", "n": 1}, {"role": "tool", "n": 2}], _counters(1, 1, 1))
    journal.round("b", [{"role": "assistant", "n": 3}], _counters(1, 0, 1))
    journal.round("a", [{"role": "assistant", "n": 4}], _counters(2, 1, 2))
    journal.finished("b", "failed", None, "boom", _counters(1, 0, 2))

    runs = {r.handle: r for r in journal.replay()}
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
